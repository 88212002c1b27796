/* Native batched copy kernel for kvstrata's host copy engine (see copy.py, docs/physical.md).
 *
 * copy_pieces(dst, src, lengths, threads=2, stream=False, prefetch=True) -> int
 *
 *   dst, src  : C-contiguous buffers of 8-byte integers (numpy int64/uint64): byte addresses
 *   lengths   : an int (every piece has that length) or a buffer like dst of per-piece lengths
 *   threads   : split the batch's bytes over this many threads (this one plus threads-1
 *               pthreads); pieces are cut at byte boundaries so the parts are equal
 *   stream    : copy with non-temporal (streaming) stores, x86-64 only; ignored elsewhere.
 *               For batches much larger than the cache: no read-for-ownership of the
 *               destination lines, and the copy does not evict the cache.
 *   prefetch  : prefetch the first lines of piece i+1 when piece i starts (x86-64 only)
 *
 * Returns the number of bytes copied. The GIL is released for the whole copy. The caller
 * guarantees that every address range is valid, writable for dst, and that no destination
 * range overlaps a source range of the same call (memcpy semantics; overlapping pieces are
 * a caller bug). Only gcc/clang and the Python headers are needed; nothing else.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KV_HAVE_STREAM 1
#else
#define KV_HAVE_STREAM 0
#endif

#define KV_MAX_THREADS 64
#define KV_STREAM 1
#define KV_PREFETCH 2
/* Cache lines of the next piece prefetched when a piece starts (its first page's TLB entry
 * and the hardware prefetcher's ramp-up, which stops at every 4 KiB page boundary). */
#ifndef PF_LINES
#define PF_LINES 8
#endif

typedef struct {
    const uint64_t *dst;
    const uint64_t *src;
    const uint64_t *len;      /* NULL: uniform length */
    uint64_t uniform;
    Py_ssize_t first;         /* first piece */
    uint64_t first_skip;      /* bytes of the first piece already owned by the previous part */
    uint64_t bytes;           /* bytes this part copies */
    int stream;               /* KV_STREAM | KV_PREFETCH */
} part_t;

#if KV_HAVE_STREAM
/* Non-temporal copy: destination bytes bypass the cache (no read-for-ownership). */
static void copy_stream(char *d, const char *s, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)d) & 15u;
    if (head > n)
        head = n;
    if (head) {
        memcpy(d, s, head);
        d += head; s += head; n -= head;
    }
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)(d), a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        d += 64; s += 64; n -= 64;
    }
    if (n)
        memcpy(d, s, n);
}
#endif

static void *run_part(void *arg)
{
    part_t *p = (part_t *)arg;
    uint64_t left = p->bytes;
    Py_ssize_t i = p->first;
    uint64_t skip = p->first_skip;
    while (left) {
        uint64_t n = (p->len ? p->len[i] : p->uniform) - skip;
#if KV_HAVE_STREAM
        if ((p->stream & KV_PREFETCH) && n < left) {   /* warm the next piece's first lines + TLB */
            const char *nx = (const char *)(uintptr_t)p->src[i + 1];
            for (int k = 0; k < PF_LINES; k++)
                _mm_prefetch(nx + 64 * k, _MM_HINT_T0);
        }
#endif
        if (n > left)
            n = left;
        char *d = (char *)(uintptr_t)(p->dst[i] + skip);
        const char *s = (const char *)(uintptr_t)(p->src[i] + skip);
#if KV_HAVE_STREAM
        if (p->stream & KV_STREAM)
            copy_stream(d, s, (size_t)n);
        else
#endif
            memcpy(d, s, (size_t)n);
        left -= n;
        skip = 0;
        i++;
    }
#if KV_HAVE_STREAM
    if (p->stream & KV_STREAM)
        _mm_sfence();
#endif
    return NULL;
}

static int get_u64_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        strchr("qQlLnN", view->format[view->format[0] == '<' || view->format[0] == '=' ||
                                      view->format[0] == '@' ? 1 : 0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must hold 8-byte integers (format %s)", what,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_pieces(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "src", "lengths", "threads", "stream", "prefetch", NULL};
    PyObject *dst_obj, *src_obj, *len_obj;
    int threads = 2, stream = 0, prefetch = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|ipp:copy_pieces", kwlist, &dst_obj,
                                     &src_obj, &len_obj, &threads, &stream, &prefetch))
        return NULL;
    stream = (stream ? KV_STREAM : 0) | (prefetch ? KV_PREFETCH : 0);
    Py_buffer dv, sv, lv;
    int have_len = 0;
    uint64_t uniform = 0;
    if (get_u64_buffer(dst_obj, &dv, "dst") < 0)
        return NULL;
    if (get_u64_buffer(src_obj, &sv, "src") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    Py_ssize_t n = dv.len / 8;
    PyObject *result = NULL;
    if (sv.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "dst has %zd addresses, src %zd", n, sv.len / 8);
        goto done;
    }
    if (PyLong_Check(len_obj)) {
        long long v = PyLong_AsLongLong(len_obj);
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "lengths must be >= 0");
            goto done;
        }
        uniform = (uint64_t)v;
    } else {
        if (get_u64_buffer(len_obj, &lv, "lengths") < 0)
            goto done;
        if (lv.ndim == 0) {   /* a numpy integer scalar: one length for every piece */
            int64_t v = *(const int64_t *)lv.buf;
            PyBuffer_Release(&lv);
            if (v < 0) {
                PyErr_SetString(PyExc_ValueError, "lengths must be >= 0");
                goto done;
            }
            uniform = (uint64_t)v;
        } else {
            have_len = 1;
        }
    }
    if (have_len) {
        if (lv.len / 8 != n) {
            PyErr_Format(PyExc_ValueError, "%zd addresses but %zd lengths", n, lv.len / 8);
            goto done;
        }
    }
    const uint64_t *dst = (const uint64_t *)dv.buf, *src = (const uint64_t *)sv.buf;
    const uint64_t *len = have_len ? (const uint64_t *)lv.buf : NULL;
    uint64_t total = 0;
    if (len) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if ((int64_t)len[i] < 0) {
                PyErr_SetString(PyExc_ValueError, "lengths must be >= 0");
                goto done;
            }
            total += len[i];
        }
    } else {
        total = uniform * (uint64_t)n;
    }
    if (threads < 1)
        threads = 1;
    if (threads > KV_MAX_THREADS)
        threads = KV_MAX_THREADS;
    if ((uint64_t)threads > total)
        threads = total ? (int)total : 1;
    part_t parts[KV_MAX_THREADS];
    {
        /* Cut the batch's bytes into `threads` equal parts; a part may start inside a piece. */
        Py_ssize_t i = 0;
        uint64_t before = 0;   /* bytes of pieces [0, i) */
        for (int t = 0; t < threads; t++) {
            uint64_t lo = total * (uint64_t)t / (uint64_t)threads;
            uint64_t hi = total * (uint64_t)(t + 1) / (uint64_t)threads;
            while (i < n && before + (len ? len[i] : uniform) <= lo) {
                before += len ? len[i] : uniform;
                i++;
            }
            parts[t] = (part_t){dst, src, len, uniform, i, lo - before, hi - lo, stream};
        }
    }
    pthread_t tids[KV_MAX_THREADS];
    int started = 0, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, run_part, &parts[t]) != 0) {
            failed = t;   /* run the rest on this thread */
            break;
        }
        started = t;
    }
    run_part(&parts[0]);
    if (failed)
        for (int t = failed; t < threads; t++)
            run_part(&parts[t]);
    for (int t = 1; t <= started; t++)
        pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(total);
done:
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    if (have_len)
        PyBuffer_Release(&lv);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_pieces", (PyCFunction)(void (*)(void))copy_pieces, METH_VARARGS | METH_KEYWORDS,
     "copy_pieces(dst, src, lengths, threads=2, stream=False, prefetch=True) -> bytes\n\n"
     "memcpy piece i of lengths[i] (or the int lengths) bytes from address src[i] to dst[i]\n"
     "for every i, split over `threads` threads, GIL released. dst/src/lengths: C-contiguous\n"
     "8-byte integer buffers (numpy int64/uint64). stream=True uses non-temporal stores,\n"
     "prefetch=True prefetches each next piece's first lines (both x86-64 only)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copykernel",
                                    "kvstrata native batched memcpy (see copy.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__copykernel(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HAVE_STREAM", KV_HAVE_STREAM) < 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", KV_MAX_THREADS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
