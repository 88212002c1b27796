/* Native xxh3 for kvstrata (optional; the pure-Python paths are the fallback): block hashing
 * for kvstrata.tokens, and checksums of memory ranges for verified remote reads.
 *
 * hash_blocks(tokens, block_size, seed, parent) -> (local_hashes, sequence_hashes) or None
 *
 *   tokens     : a list of ints, or a C-contiguous buffer of little-endian uint32 (numpy "<u4")
 *   block_size : tokens per block (> 0)
 *   seed       : xxh3 seed (unsigned 64-bit)
 *   parent     : the sequence hash before tokens[0], or None
 *
 * The scheme is tokens.py's (Dynamo's): local = xxh3_64(block's tokens as LE uint32, seed);
 * sequence = local for the first block of a chain, else xxh3_64(pack("<QQ", parent, local),
 * seed). Only full blocks are hashed.
 *
 * Returns None, changing nothing, when a list item is not an exact int in [0, 2**32-1] (a
 * bool, a numpy scalar, a negative or too large value...): the caller then takes the Python
 * path, which converts what it may and raises the precise TokenError otherwise.
 *
 * chain_hashes(local_hashes, seed, parent) -> list or None: sequence hashes of a list of
 * local hashes (exact ints in [0, 2**64)); None for anything else.
 *
 * checksum_ranges(addresses, lengths, per_block) -> bytes or None: the xxh3-64 (seed 0)
 * checksum of each block of bytes in this process's memory, a block being `per_block`
 * consecutive (address, length) ranges hashed as one stream; `addresses` and `lengths` are
 * C-contiguous buffers of uint64 of equal size. Returns the checksums as native uint64s,
 * hashed with the GIL let go (a verifying thread hashes while another copies). The caller
 * vouches that every range is readable memory it owns. None until bound, or when a buffer
 * is not uint64 or the counts do not divide.
 *
 * device_sums(addresses, length) -> bytes or None: the *device checksum* of each `length`-byte
 * block at `addresses` (uint64 buffer): sum over its little-endian 64-bit words w[i] of
 * fmix64(w[i] ^ (i + 1) * PHI) modulo 2**64, the function the GPU copy kernel computes while it
 * copies (physical/_triton_copy.py; checksum.device_checksum is the numpy reference). GIL let
 * go. None when `length` is not a multiple of 8 or the buffer is not uint64.
 *
 * verify_arrived(state, count) and verify_batches(state, addresses, lengths, expected, bad,
 * per_block, step, mode, lag) -> int: a verified read's batches, hashed as they arrive by a
 * verifying thread that never takes the GIL (remote/importer.py). `state` is a writable
 * uint32 array of 4: [arrived | FINISHED, claimed, done, failed]; batch b is blocks
 * [b * step, (b + 1) * step) of `expected` (uint64 per block); a block whose checksum differs
 * gets bad[block] = 1 (uint8 per block). The reading thread calls verify_arrived after each
 * batch it copied (with `finished` true it gives up: the batches nobody claimed are skipped,
 * `failed` is set, the verifying thread is let go and waited for); mode 0 (the verifying thread) claims and hashes the oldest arrived batch
 * until FINISHED is set and none is left; mode 1 (the reading thread) hashes the oldest one
 * if more than `lag` wait, and returns whether it did; mode 2 (the reading thread, last)
 * hashes what is left, sets FINISHED and waits until every claimed batch is done. Batches
 * are claimed with a compare-and-swap, so each is hashed once; waits are futexes on the
 * state words (Linux; elsewhere verify_batches is absent and the Python path runs).
 *
 * xxh3 itself is not compiled here: bind(address) hands in the address of
 * XXH3_64bits_withSeed as exported by the pinned `xxhash` package's own extension module
 * (tokens.py looks it up with ctypes and checks it against a known value); until bound, the
 * functions return None and the Python path runs. bind_stream(create, reset, update, digest,
 * free) hands in the addresses of the library's XXH3 streaming functions, for blocks of more
 * than one range.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_mix64.h"

/* xxh3_seeded(input, length, seed), the xxhash library's C ABI. */
typedef uint64_t (*xxh3_seeded_fn)(const void *input, size_t length, uint64_t seed);
static xxh3_seeded_fn xxh3_seeded = NULL;

static inline void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* parent: Py_None -> have_parent = 0; an exact int in [0, 2**64) -> 1; else -1 (fallback). */
static int read_parent(PyObject *obj, uint64_t *out) {
    if (obj == Py_None) return 0;
    if (!PyLong_CheckExact(obj)) return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    *out = (uint64_t)v;
    return 1;
}

/* The sequence hash of a block with local hash `local` after *parent (none if !*have_parent);
 * it becomes the parent of the next block. */
static inline uint64_t chain(uint64_t local, uint64_t seed, int *have_parent, uint64_t *parent) {
    uint64_t seq = local;
    if (*have_parent) {
        unsigned char pair[16];
        put_le64(pair, *parent);
        put_le64(pair + 8, local);
        seq = xxh3_seeded(pair, 16, seed);
    }
    *have_parent = 1;
    *parent = seq;
    return seq;
}

/* Hash nblocks blocks of bytes at data (LE uint32 tokens); lists are filled in. */
static PyObject *hash_bytes(const unsigned char *data, Py_ssize_t nblocks, Py_ssize_t block_bytes,
                            uint64_t seed, int have_parent, uint64_t parent) {
    PyObject *locals = PyList_New(nblocks);
    PyObject *seqs = locals ? PyList_New(nblocks) : NULL;
    if (!seqs) { Py_XDECREF(locals); return NULL; }
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        uint64_t local = xxh3_seeded(data + b * block_bytes, (size_t)block_bytes, seed);
        uint64_t seq = chain(local, seed, &have_parent, &parent);
        PyObject *l = PyLong_FromUnsignedLongLong(local);
        PyObject *s = PyLong_FromUnsignedLongLong(seq);
        if (!l || !s) { Py_XDECREF(l); Py_XDECREF(s); Py_DECREF(locals); Py_DECREF(seqs); return NULL; }
        PyList_SET_ITEM(locals, b, l);
        PyList_SET_ITEM(seqs, b, s);
    }
    PyObject *out = PyTuple_Pack(2, locals, seqs);
    Py_DECREF(locals);
    Py_DECREF(seqs);
    return out;
}

static PyObject *py_hash_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hash_blocks(tokens, block_size, seed, parent)");
        return NULL;
    }
    if (xxh3_seeded == NULL) Py_RETURN_NONE;
    PyObject *tokens = args[0];
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size <= 0 || block_size > (PY_SSIZE_T_MAX / 4)) Py_RETURN_NONE;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }
    uint64_t parent = 0;
    int have_parent = read_parent(args[3], &parent);
    if (have_parent < 0) Py_RETURN_NONE;
    Py_ssize_t block_bytes = block_size * 4;

    if (PyList_CheckExact(tokens)) {
        Py_ssize_t n = PyList_GET_SIZE(tokens);
        Py_ssize_t nblocks = n / block_size;
        Py_ssize_t used = nblocks * block_size;
        unsigned char stack[4096];
        unsigned char *buf = used * 4 <= (Py_ssize_t)sizeof(stack) ? stack : PyMem_Malloc((size_t)(used * 4) + 1);
        if (!buf) return PyErr_NoMemory();
        /* Every item is checked (also the partial tail's), as the Python path converts all. */
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(tokens, i);
            if (!PyLong_CheckExact(item)) goto fallback;
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || v < 0 || v > 0xFFFFFFFFLL) goto fallback;
            if (i < used) put_le32(buf + 4 * i, (uint32_t)v);
        }
        PyObject *out = hash_bytes(buf, nblocks, block_bytes, seed, have_parent, parent);
        if (buf != stack) PyMem_Free(buf);
        return out;
    fallback:
        if (buf != stack) PyMem_Free(buf);
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* Only 4-byte unsigned items, little-endian (native on a little-endian host). */
    const char *fmt = view.format ? view.format : "B";
    int le_host = 1;
    {
        uint16_t probe = 1;
        le_host = *(unsigned char *)&probe == 1;
    }
    int ok = view.itemsize == 4 &&
             ((strcmp(fmt, "<I") == 0) || (le_host && (strcmp(fmt, "I") == 0 || strcmp(fmt, "=I") == 0)) ||
              (le_host && sizeof(unsigned long) == 4 && (strcmp(fmt, "L") == 0 || strcmp(fmt, "<L") == 0)));
    if (!ok) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t nblocks = view.len / block_bytes;
    PyObject *out = hash_bytes((const unsigned char *)view.buf, nblocks, block_bytes, seed,
                               have_parent, parent);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *py_chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain_hashes(local_hashes, seed, parent)");
        return NULL;
    }
    if (xxh3_seeded == NULL) Py_RETURN_NONE;
    PyObject *locals = args[0];
    if (!PyList_CheckExact(locals)) Py_RETURN_NONE;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[1]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }
    uint64_t parent = 0;
    int have_parent = read_parent(args[2], &parent);
    if (have_parent < 0) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(locals);
    for (Py_ssize_t i = 0; i < n; i++) {     /* check first: all or nothing */
        PyObject *item = PyList_GET_ITEM(locals, i);
        if (!PyLong_CheckExact(item)) Py_RETURN_NONE;
        unsigned long long v = PyLong_AsUnsignedLongLong(item);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }
    }
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t local = (uint64_t)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(locals, i));
        uint64_t seq = chain(local, seed, &have_parent, &parent);
        PyObject *s = PyLong_FromUnsignedLongLong(seq);
        if (!s) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, s);
    }
    return out;
}

/* XXH3 streaming functions of the same library (opaque state). */
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_reset_fn)(void *state);
typedef int (*xxh3_update_fn)(void *state, const void *input, size_t length);
typedef uint64_t (*xxh3_digest_fn)(const void *state);
typedef int (*xxh3_free_fn)(void *state);
static xxh3_create_fn xxh3_create = NULL;
static xxh3_reset_fn xxh3_reset = NULL;
static xxh3_update_fn xxh3_update = NULL;
static xxh3_digest_fn xxh3_digest = NULL;
static xxh3_free_fn xxh3_free = NULL;

/* A C-contiguous buffer of n uint64 items, or -1 (the caller falls back). */
static Py_ssize_t get_u64_buffer(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    int u64 = view->itemsize == 8 && (strcmp(fmt, "Q") == 0 || strcmp(fmt, "=Q") == 0 ||
                                      strcmp(fmt, "<Q") == 0 ||
                                      (sizeof(unsigned long) == 8 &&
                                       (strcmp(fmt, "L") == 0 || strcmp(fmt, "<L") == 0)));
    if (!u64) {
        PyBuffer_Release(view);
        return -1;
    }
    return view->len / 8;
}


/* The checksums of blocks [first, stop), each `per_block` ranges hashed as one stream into
 * sums[block - first]; `state` is a streaming state when per_block > 1. */
static void hash_blocks_of_ranges(const uint64_t *addresses, const uint64_t *lengths,
                                  Py_ssize_t per_block, Py_ssize_t first, Py_ssize_t stop,
                                  void *state, uint64_t *sums) {
    for (Py_ssize_t b = first; b < stop; b++) {
        if (per_block == 1) {
            sums[b - first] = xxh3_seeded((const void *)(uintptr_t)addresses[b],
                                          (size_t)lengths[b], 0);
            continue;
        }
        xxh3_reset(state);
        for (Py_ssize_t r = b * per_block; r < (b + 1) * per_block; r++)
            xxh3_update(state, (const void *)(uintptr_t)addresses[r], (size_t)lengths[r]);
        sums[b - first] = xxh3_digest(state);
    }
}

#ifdef __linux__
#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define VERIFY_FINISHED 0x80000000u
#define VERIFY_COUNT 0x7fffffffu
enum { V_ARRIVED = 0, V_CLAIMED = 1, V_DONE = 2, V_FAILED = 3 };

static void futex_wake_all(uint32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

/* Sleep while *word == seen, 50 ms at most (the caller re-checks). */
static void futex_wait_for_change(uint32_t *word, uint32_t seen) {
    struct timespec timeout = {0, 50 * 1000 * 1000};
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, &timeout, NULL, 0);
}

typedef struct {
    uint32_t *state;
    const uint64_t *addresses, *lengths, *expected;
    uint8_t *bad;
    Py_ssize_t per_block, step, blocks;
    void *stream;
    uint64_t *sums;
} verify_job;

/* Claim the oldest arrived batch not claimed yet, if one is and more than `lag` are waiting;
 * hash it, mark its bad blocks, count it done. 1 if a batch was hashed. */
static int verify_one(verify_job *job, uint32_t lag) {
    uint32_t *state = job->state;
    uint32_t claimed = __atomic_load_n(&state[V_CLAIMED], __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t arrived = __atomic_load_n(&state[V_ARRIVED], __ATOMIC_SEQ_CST) & VERIFY_COUNT;
        if (arrived <= claimed || arrived - claimed <= lag) return 0;
        if (__atomic_compare_exchange_n(&state[V_CLAIMED], &claimed, claimed + 1, 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            break;
    }
    /* step <= blocks (checked), so a claim past the last batch is empty, never an overflow */
    Py_ssize_t batches = (job->blocks + job->step - 1) / job->step;
    Py_ssize_t first = (Py_ssize_t)claimed < batches ? (Py_ssize_t)claimed * job->step
                                                     : job->blocks;
    Py_ssize_t stop = job->blocks - first > job->step ? first + job->step : job->blocks;
    if (first < stop) {
        if (job->per_block > 1 && job->stream == NULL) {
            __atomic_store_n(&state[V_FAILED], 1, __ATOMIC_SEQ_CST);
        } else {
            hash_blocks_of_ranges(job->addresses, job->lengths, job->per_block, first, stop,
                                  job->stream, job->sums);
            for (Py_ssize_t b = first; b < stop; b++)
                if (job->sums[b - first] != job->expected[b]) job->bad[b] = 1;
        }
    }
    __atomic_add_fetch(&state[V_DONE], 1, __ATOMIC_SEQ_CST);
    futex_wake_all(&state[V_DONE]);
    return 1;
}

static void verify_run(verify_job *job) {               /* mode 0 */
    uint32_t *state = job->state;
    for (;;) {
        uint32_t arrived = __atomic_load_n(&state[V_ARRIVED], __ATOMIC_SEQ_CST);
        if (verify_one(job, 0)) continue;
        if (arrived & VERIFY_FINISHED) return;
        futex_wait_for_change(&state[V_ARRIVED], arrived);
    }
}

static void verify_finish(verify_job *job) {            /* mode 2 */
    uint32_t *state = job->state;
    while (verify_one(job, 0)) {}
    __atomic_or_fetch(&state[V_ARRIVED], VERIFY_FINISHED, __ATOMIC_SEQ_CST);
    futex_wake_all(&state[V_ARRIVED]);
    while (verify_one(job, 0)) {}                       /* none can arrive now; to be sure */
    for (;;) {
        uint32_t done = __atomic_load_n(&state[V_DONE], __ATOMIC_SEQ_CST);
        if (done >= __atomic_load_n(&state[V_CLAIMED], __ATOMIC_SEQ_CST)) return;
        futex_wait_for_change(&state[V_DONE], done);
    }
}

/* A C-contiguous writable buffer of exactly `count` native items of format `code` ('I':
 * uint32, 4-byte aligned for the futexes; 'B': uint8), or -1 with an exception set. */
static int get_writable(PyObject *obj, Py_buffer *view, char code, Py_ssize_t count) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "verify: state and bad must be writable arrays");
        }
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    if (fmt[0] == '=' || fmt[0] == '<' || fmt[0] == '@') fmt++;
    Py_ssize_t itemsize = code == 'I' ? 4 : 1;
    int format_ok = view->itemsize == itemsize &&
                    (code == 'I' ? (strcmp(fmt, "I") == 0 ||
                                    (sizeof(unsigned long) == 4 && strcmp(fmt, "L") == 0))
                                 : (strcmp(fmt, "B") == 0 || strcmp(fmt, "?") == 0));
    if (!format_ok || ((uintptr_t)view->buf & (uintptr_t)(itemsize - 1))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, code == 'I' ? "verify: state must be aligned uint32"
                                                     : "verify: bad must be uint8");
        return -1;
    }
    if (view->len != itemsize * count) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "verify: a buffer of the wrong size");
        return -1;
    }
    return 0;
}

/* The reader gives up (its last call failed): claim every arrived batch not claimed yet as
 * done without hashing it, set FINISHED, then wait for the batch the verifying thread may be
 * hashing, so nothing reads the read's memory once this returns. */
static void verify_abandon(uint32_t *state) {
    uint32_t claimed = __atomic_load_n(&state[V_CLAIMED], __ATOMIC_SEQ_CST);
    __atomic_or_fetch(&state[V_ARRIVED], VERIFY_FINISHED, __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t arrived = __atomic_load_n(&state[V_ARRIVED], __ATOMIC_SEQ_CST) & VERIFY_COUNT;
        if (claimed >= arrived) break;
        if (__atomic_compare_exchange_n(&state[V_CLAIMED], &claimed, arrived, 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            __atomic_add_fetch(&state[V_DONE], arrived - claimed, __ATOMIC_SEQ_CST);
            break;
        }
    }
    __atomic_store_n(&state[V_FAILED], 1, __ATOMIC_SEQ_CST);
    futex_wake_all(&state[V_ARRIVED]);
    for (;;) {
        uint32_t done = __atomic_load_n(&state[V_DONE], __ATOMIC_SEQ_CST);
        if (done >= __atomic_load_n(&state[V_CLAIMED], __ATOMIC_SEQ_CST)) return;
        futex_wait_for_change(&state[V_DONE], done);
    }
}

static PyObject *py_verify_arrived(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "verify_arrived(state, count, finished)");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (count < 0 || count > (Py_ssize_t)VERIFY_COUNT) {
        PyErr_SetString(PyExc_ValueError, "verify_arrived: count out of range");
        return NULL;
    }
    int finished = PyObject_IsTrue(args[2]);
    if (finished < 0) return NULL;
    Py_buffer view;
    if (get_writable(args[0], &view, 'I', 4) < 0) return NULL;
    uint32_t *state = (uint32_t *)view.buf;
    uint32_t old = __atomic_load_n(&state[V_ARRIVED], __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(&state[V_ARRIVED], &old,
                                        (uint32_t)count | (old & VERIFY_FINISHED), 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    futex_wake_all(&state[V_ARRIVED]);
    if (finished) {
        Py_BEGIN_ALLOW_THREADS
        verify_abandon(state);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *py_verify_batches(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "verify_batches(state, addresses, lengths, expected, "
                                         "bad, per_block, step, mode, lag)");
        return NULL;
    }
    Py_ssize_t per_block = PyLong_AsSsize_t(args[5]), step = PyLong_AsSsize_t(args[6]);
    long mode = PyLong_AsLong(args[7]), lag = PyLong_AsLong(args[8]);
    if (PyErr_Occurred()) return NULL;
    if (xxh3_seeded == NULL || (per_block > 1 && xxh3_create == NULL) || per_block <= 0 ||
            step <= 0 || mode < 0 || mode > 2 || lag < 0) {
        PyErr_SetString(PyExc_ValueError, "verify_batches: not bound, or bad arguments");
        return NULL;
    }
    Py_buffer addr_view, len_view, exp_view, state_view, bad_view;
    Py_ssize_t n = get_u64_buffer(args[1], &addr_view);
    if (n < 0) goto wrong_type;
    Py_ssize_t m = get_u64_buffer(args[2], &len_view);
    if (m < 0) { PyBuffer_Release(&addr_view); goto wrong_type; }
    Py_ssize_t blocks = get_u64_buffer(args[3], &exp_view);
    if (blocks < 0) { PyBuffer_Release(&addr_view); PyBuffer_Release(&len_view); goto wrong_type; }
    if (m != n || n % per_block || n / per_block != blocks) {
        PyErr_SetString(PyExc_ValueError, "verify_batches: ranges do not make the blocks");
        goto release3;
    }
    if (get_writable(args[0], &state_view, 'I', 4) < 0) goto release3;
    if (get_writable(args[4], &bad_view, 'B', blocks) < 0) {
        PyBuffer_Release(&state_view);
        goto release3;
    }
    if (step > blocks) step = blocks > 0 ? blocks : 1;       /* one batch: all of them */
    uint64_t *sums = PyMem_RawMalloc((size_t)step * sizeof(uint64_t));
    if (sums == NULL) {
        PyBuffer_Release(&state_view);
        PyBuffer_Release(&bad_view);
        PyBuffer_Release(&addr_view); PyBuffer_Release(&len_view); PyBuffer_Release(&exp_view);
        return PyErr_NoMemory();
    }
    verify_job job = {(uint32_t *)state_view.buf, (const uint64_t *)addr_view.buf,
                      (const uint64_t *)len_view.buf, (const uint64_t *)exp_view.buf,
                      (uint8_t *)bad_view.buf, per_block, step, blocks, NULL, sums};
    int result = 0;
    Py_BEGIN_ALLOW_THREADS
    if (per_block > 1) job.stream = xxh3_create();
    if (mode == 0) verify_run(&job);
    else if (mode == 1) result = verify_one(&job, lag > (long)UINT32_MAX ? UINT32_MAX
                                                                          : (uint32_t)lag);
    else verify_finish(&job);
    if (job.stream != NULL) xxh3_free(job.stream);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(sums);
    PyBuffer_Release(&state_view);
    PyBuffer_Release(&bad_view);
    PyBuffer_Release(&addr_view); PyBuffer_Release(&len_view); PyBuffer_Release(&exp_view);
    return PyLong_FromLong(result);
release3:
    PyBuffer_Release(&addr_view); PyBuffer_Release(&len_view); PyBuffer_Release(&exp_view);
    return NULL;
wrong_type:
    PyErr_SetString(PyExc_TypeError, "verify_batches: addresses, lengths and expected must be "
                                     "C-contiguous uint64 buffers");
    return NULL;
}
#endif  /* __linux__ */

static PyObject *py_checksum_ranges(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "checksum_ranges(addresses, lengths, per_block)");
        return NULL;
    }
    if (xxh3_seeded == NULL) Py_RETURN_NONE;
    Py_ssize_t per_block = PyLong_AsSsize_t(args[2]);
    if (per_block == -1 && PyErr_Occurred()) return NULL;
    if (per_block <= 0 || (per_block > 1 && xxh3_create == NULL)) Py_RETURN_NONE;
    Py_buffer addr_view, len_view;
    Py_ssize_t n = get_u64_buffer(args[0], &addr_view);
    if (n < 0) Py_RETURN_NONE;
    Py_ssize_t m = get_u64_buffer(args[1], &len_view);
    if (m < 0) {
        PyBuffer_Release(&addr_view);
        Py_RETURN_NONE;
    }
    if (m != n || n % per_block) {
        PyBuffer_Release(&addr_view);
        PyBuffer_Release(&len_view);
        Py_RETURN_NONE;
    }
    Py_ssize_t blocks = n / per_block;
    PyObject *out = PyBytes_FromStringAndSize(NULL, blocks * 8);
    if (!out) {
        PyBuffer_Release(&addr_view);
        PyBuffer_Release(&len_view);
        return NULL;
    }
    const uint64_t *addresses = (const uint64_t *)addr_view.buf;
    const uint64_t *lengths = (const uint64_t *)len_view.buf;
    uint64_t *sums = (uint64_t *)PyBytes_AS_STRING(out);
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    void *state = per_block > 1 ? xxh3_create() : NULL;
    if (per_block > 1 && state == NULL)
        failed = 1;
    else
        hash_blocks_of_ranges(addresses, lengths, per_block, 0, blocks, state, sums);
    if (state != NULL) xxh3_free(state);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addr_view);
    PyBuffer_Release(&len_view);
    if (failed) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    return out;
}

static PyObject *py_device_sums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "device_sums(addresses, length)");
        return NULL;
    }
    Py_ssize_t length = PyLong_AsSsize_t(args[1]);
    if (length == -1 && PyErr_Occurred()) return NULL;
    if (length < 0 || length % 8) Py_RETURN_NONE;
    Py_buffer addr_view;
    Py_ssize_t n = get_u64_buffer(args[0], &addr_view);
    if (n < 0) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) {
        PyBuffer_Release(&addr_view);
        return NULL;
    }
    const uint64_t *addresses = (const uint64_t *)addr_view.buf;
    uint64_t *sums = (uint64_t *)PyBytes_AS_STRING(out);
    const uint64_t words = (uint64_t)length / 8, phi = 0x9E3779B97F4A7C15ULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n; b++) {
        const unsigned char *data = (const unsigned char *)(uintptr_t)addresses[b];
        uint64_t acc = 0;
        for (uint64_t i = 0; i < words; i++) {
            uint64_t w;
            memcpy(&w, data + 8 * i, 8);   /* little-endian hosts: the kernel's word order */
            acc += kvstrata_mix64(w ^ ((i + 1) * phi));
        }
        sums[b] = acc;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addr_view);
    return out;
}

static PyObject *py_bind_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "bind_stream(create, reset, update, digest, free)");
        return NULL;
    }
    void *fns[5];
    for (int i = 0; i < 5; i++) {
        fns[i] = PyLong_AsVoidPtr(args[i]);
        if (fns[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function address");
            return NULL;
        }
    }
    xxh3_create = (xxh3_create_fn)fns[0];
    xxh3_reset = (xxh3_reset_fn)fns[1];
    xxh3_update = (xxh3_update_fn)fns[2];
    xxh3_digest = (xxh3_digest_fn)fns[3];
    xxh3_free = (xxh3_free_fn)fns[4];
    Py_RETURN_NONE;
}

static PyObject *py_bind(PyObject *self, PyObject *address) {
    void *fn = PyLong_AsVoidPtr(address);
    if (fn == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function address");
        return NULL;
    }
    xxh3_seeded = (xxh3_seeded_fn)fn;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)py_bind, METH_O,
     "bind(address): use the XXH3_64bits_withSeed function at this address"},
    {"hash_blocks", (PyCFunction)(void (*)(void))py_hash_blocks, METH_FASTCALL,
     "hash_blocks(tokens, block_size, seed, parent) -> (local_hashes, sequence_hashes) or None"},
    {"chain_hashes", (PyCFunction)(void (*)(void))py_chain_hashes, METH_FASTCALL,
     "chain_hashes(local_hashes, seed, parent) -> sequence_hashes or None"},
    {"bind_stream", (PyCFunction)(void (*)(void))py_bind_stream, METH_FASTCALL,
     "bind_stream(create, reset, update, digest, free): the XXH3 streaming functions"},
    {"checksum_ranges", (PyCFunction)(void (*)(void))py_checksum_ranges, METH_FASTCALL,
     "checksum_ranges(addresses, lengths, per_block) -> bytes of uint64 checksums or None"},
    {"device_sums", (PyCFunction)(void (*)(void))py_device_sums, METH_FASTCALL,
     "device_sums(addresses, length) -> bytes of uint64 device checksums or None"},
#ifdef __linux__
    {"verify_arrived", (PyCFunction)(void (*)(void))py_verify_arrived, METH_FASTCALL,
     "verify_arrived(state, count, finished): `count` batches of a verified read have arrived"},
    {"verify_batches", (PyCFunction)(void (*)(void))py_verify_batches, METH_FASTCALL,
     "verify_batches(state, addresses, lengths, expected, bad, per_block, step, mode, lag) -> int"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tokenhash",
    "Native xxh3 for kvstrata: block hash chains (tokens.py) and checksums of memory ranges.", -1, methods,
};

PyMODINIT_FUNC PyInit__tokenhash(void) { return PyModule_Create(&module); }
