/* Non-blocking socket writes that keep the GIL (kvstrata.events._wire).
 *
 *   send_nowait(sock, buffers) -> int
 *       Writes the bytes-like objects of ``buffers`` (a list), in order, to the socket ``sock``
 *       with sendmsg(MSG_DONTWAIT | MSG_NOSIGNAL) and returns how many bytes the kernel took:
 *       all of them, fewer when its send buffer filled up, 0 if it was already full. Raises
 *       OSError for any other failure (EPIPE, ECONNRESET, ...).
 *
 * Why: Python's own socket calls let go of the GIL around every system call. The publisher's
 * batching thread writes a batch's NATS frames while the engine's thread may be running hooks;
 * once the GIL is let go, getting it back can take the interpreter's switch interval (5 ms).
 * A non-blocking send is a copy into the kernel (tens of microseconds for a batch), so it runs
 * with the GIL held. The pure-Python equivalent (natswire.py_send_nowait, socket.sendmsg) stays
 * the fallback and gives the same results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/uio.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define MAX_IOV (IOV_MAX < 512 ? IOV_MAX : 512)

static PyObject *send_nowait(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "send_nowait(sock, buffers: list)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0) return NULL;
    PyObject *list = args[1];
    Py_ssize_t count = PyList_GET_SIZE(list);
    Py_buffer views[MAX_IOV];
    struct iovec iov[MAX_IOV];
    Py_ssize_t total = 0, i = 0;
    while (i < count) {
        /* one sendmsg per MAX_IOV buffers; stop at the first partial write */
        Py_ssize_t k = 0, want = 0;
        for (; k < MAX_IOV && i + k < count; k++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(list, i + k), &views[k], PyBUF_SIMPLE) < 0) {
                for (Py_ssize_t j = 0; j < k; j++) PyBuffer_Release(&views[j]);
                return NULL;
            }
            iov[k].iov_base = views[k].buf;
            iov[k].iov_len = (size_t)views[k].len;
            want += views[k].len;
        }
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t n;
        do {
            n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        int err = errno;
        for (Py_ssize_t j = 0; j < k; j++) PyBuffer_Release(&views[j]);
        if (n < 0) {
            if (err == EAGAIN || err == EWOULDBLOCK) break;
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        total += n;
        if (n < want) break;
        i += k;
    }
    return PyLong_FromSsize_t(total);
}

static PyMethodDef methods[] = {
    {"send_nowait", (PyCFunction)(void (*)(void))send_nowait, METH_FASTCALL,
     "send_nowait(sock, buffers) -> bytes the kernel took (non-blocking, the GIL held)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire",
                                    "Non-blocking socket writes that keep the GIL.", -1, methods};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
