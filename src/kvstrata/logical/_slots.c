/* A pool's hash index and its loops over a batch of slots, in C (optional; the pure-Python
 * versions in kvstrata/logical/slots.py are the reference and the fallback: same effects,
 * same errors).
 *
 * HashIndex: a mapping of unsigned 64-bit keys to int32 values in [0, 2**31) -- open
 *   addressing, linear probing, backward-shift deletion, at most 3/4 full: 12 bytes a
 *   bucket (a dict of int objects costs ~100 bytes an entry). Keys that are not u64 ints
 *   are never held (look-ups miss; storing one raises).
 * SlotOps(arrays, index, pending, tokens, seeds, block_size): the methods of
 *   slots.PySlotOps over the store's columns (a tuple of numpy arrays, whose buffers it
 *   holds; integers of the sizes and signedness of slots.SLOT_COLUMNS / LIST_COLUMNS).
 * setup(BlockRecord): learn the record class's slot offsets (read straight, as Python's
 *   own member descriptors do; another class is read through getattr).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "../_mix64.h"

enum { RESET, PARTIAL, COMPLETE, REGISTERED };
#define HAS_PARENT 1

/* ---------------------------------------------------------------------------------------- */
/* HashIndex                                                                                */

typedef struct {
    PyObject_HEAD
    uint64_t *keys;
    int32_t *vals;          /* -1: empty bucket */
    Py_ssize_t cap;         /* 0 or a power of two */
    Py_ssize_t used;
} HashIndex;

static PyTypeObject HashIndexType;


static inline Py_ssize_t hi_find(const HashIndex *t, uint64_t k) {
    if (!t->cap) return -1;
    size_t m = (size_t)t->cap - 1, i = (size_t)kvstrata_mix64(k) & m;
    while (t->vals[i] >= 0) {
        if (t->keys[i] == k) return (Py_ssize_t)i;
        i = (i + 1) & m;
    }
    return -1;
}

static inline int32_t hi_get(const HashIndex *t, uint64_t k) {
    Py_ssize_t i = hi_find(t, k);
    return i < 0 ? -1 : t->vals[i];
}

static int hi_resize(HashIndex *t, Py_ssize_t cap) {
    uint64_t *keys = PyMem_RawMalloc((size_t)cap * sizeof(uint64_t));
    int32_t *vals = PyMem_RawMalloc((size_t)cap * sizeof(int32_t));
    if (!keys || !vals) {
        PyMem_RawFree(keys);
        PyMem_RawFree(vals);
        PyErr_NoMemory();
        return -1;
    }
    memset(vals, 0xff, (size_t)cap * sizeof(int32_t));
    size_t m = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < t->cap; j++) {
        if (t->vals[j] < 0) continue;
        size_t i = (size_t)kvstrata_mix64(t->keys[j]) & m;
        while (vals[i] >= 0) i = (i + 1) & m;
        keys[i] = t->keys[j];
        vals[i] = t->vals[j];
    }
    PyMem_RawFree(t->keys);
    PyMem_RawFree(t->vals);
    t->keys = keys;
    t->vals = vals;
    t->cap = cap;
    return 0;
}

/* Grow the table (if needed) so that `more` new keys fit within the load limit: after it
 * succeeds, that many hi_put calls cannot fail. 0, or -1 with MemoryError (table unchanged). */
static int hi_reserve(HashIndex *t, Py_ssize_t more) {
    if (more < 0 || t->used > PY_SSIZE_T_MAX / 8 - more) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t need = t->used + more, cap = t->cap ? t->cap : 8;
    while (need * 4 > cap * 3) {
        if (cap > PY_SSIZE_T_MAX / 32) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    return cap == t->cap ? 0 : hi_resize(t, cap);
}

static int hi_put(HashIndex *t, uint64_t k, int32_t v) {
    if (v < 0) {                     /* -1 marks an empty bucket: never stored */
        PyErr_Format(PyExc_ValueError, "HashIndex values are in [0, 2**31), got %d", (int)v);
        return -1;
    }
    if ((t->used + 1) * 4 > t->cap * 3 && hi_reserve(t, 1) < 0) return -1;
    size_t m = (size_t)t->cap - 1, i = (size_t)kvstrata_mix64(k) & m;
    while (t->vals[i] >= 0) {
        if (t->keys[i] == k) {
            t->vals[i] = v;
            return 0;
        }
        i = (i + 1) & m;
    }
    t->keys[i] = k;
    t->vals[i] = v;
    t->used++;
    return 0;
}

static int hi_del(HashIndex *t, uint64_t k) {
    Py_ssize_t found = hi_find(t, k);
    if (found < 0) return 0;
    size_t m = (size_t)t->cap - 1, i = (size_t)found, j = i;
    for (;;) {                       /* shift back the entries the hole would cut off */
        j = (j + 1) & m;
        if (t->vals[j] < 0) break;
        size_t home = (size_t)kvstrata_mix64(t->keys[j]) & m;
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->keys[i] = t->keys[j];
            t->vals[i] = t->vals[j];
            i = j;
        }
    }
    t->vals[i] = -1;
    t->used--;
    return 1;
}

static int index_key(PyObject *o, uint64_t *out);
static inline int int_key(PyObject *o, uint64_t *out);
static inline int long_key(PyObject *o, uint64_t *out);

/* 1 and *out set: o is an int in [0, 2**64); 0: it is not (no error); -1: an error.
 * An integer of another type (numpy's) counts as the int it equals, as a dict's look-up
 * finds it; floats and other numbers are not keys here. */
static inline int as_key(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) return index_key(o, out);
    return long_key(o, out);
}

/* as_key for an int only, bools refused (a block's own hashes: kvstrata.types.is_u64) */
static inline int int_key(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o) || PyBool_Check(o)) return 0;
    return long_key(o, out);
}

/* as_key for an object known to be an int (a bool counts as the int it equals, as in a
 * dict's look-up) */
static inline int long_key(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

static int index_key(PyObject *o, uint64_t *out) {
    if (!PyIndex_Check(o)) return 0;
    PyObject *i = PyNumber_Index(o);
    if (!i) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    int ok = PyLong_Check(i) ? as_key(i, out) : 0;
    Py_DECREF(i);
    return ok;
}

static int as_value(PyObject *o, int32_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "HashIndex values are ints, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "HashIndex values are in [0, 2**31), got %ld", v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static PyObject *hi_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "HashIndex() takes no arguments");
        return NULL;
    }
    HashIndex *t = (HashIndex *)type->tp_alloc(type, 0);
    return (PyObject *)t;
}

static void hi_dealloc(HashIndex *t) {
    PyMem_RawFree(t->keys);
    PyMem_RawFree(t->vals);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t hi_len(HashIndex *t) { return t->used; }

static int hi_contains(HashIndex *t, PyObject *key) {
    uint64_t k;
    int ok = as_key(key, &k);
    if (ok <= 0) return ok;
    return hi_find(t, k) >= 0;
}

static PyObject *hi_subscript(HashIndex *t, PyObject *key) {
    uint64_t k;
    int ok = as_key(key, &k);
    if (ok < 0) return NULL;
    int32_t v = ok ? hi_get(t, k) : -1;
    if (v < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLong(v);
}

static int hi_ass_subscript(HashIndex *t, PyObject *key, PyObject *value) {
    uint64_t k;
    int ok = as_key(key, &k);
    if (ok < 0) return -1;
    if (!value) {
        if (!ok || !hi_del(t, k)) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        return 0;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "HashIndex keys are ints in [0, 2**64), got %R", key);
        return -1;
    }
    int32_t v;
    if (as_value(value, &v) < 0) return -1;
    return hi_put(t, k, v);
}

static PyObject *hi_get_method(HashIndex *t, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key[, default])");
        return NULL;
    }
    uint64_t k;
    int ok = as_key(args[0], &k);
    if (ok < 0) return NULL;
    int32_t v = ok ? hi_get(t, k) : -1;
    if (v >= 0) return PyLong_FromLong(v);
    return Py_NewRef(n == 2 ? args[1] : Py_None);
}

static PyObject *hi_pop(HashIndex *t, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    uint64_t k;
    int ok = as_key(args[0], &k);
    if (ok < 0) return NULL;
    int32_t v = ok ? hi_get(t, k) : -1;
    if (v >= 0) {
        hi_del(t, k);
        return PyLong_FromLong(v);
    }
    if (n == 2) return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *hi_clear(HashIndex *t, PyObject *unused) {
    PyMem_RawFree(t->keys);
    PyMem_RawFree(t->vals);
    t->keys = NULL;
    t->vals = NULL;
    t->cap = t->used = 0;
    Py_RETURN_NONE;
}

/* what: 0 keys, 1 values, 2 (key, value) pairs; in bucket order */
static PyObject *hi_list(HashIndex *t, int what) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        if (t->vals[i] < 0) continue;
        PyObject *item;
        if (what == 0) item = PyLong_FromUnsignedLongLong(t->keys[i]);
        else if (what == 1) item = PyLong_FromLong(t->vals[i]);
        else item = Py_BuildValue("(Kl)", (unsigned long long)t->keys[i], (long)t->vals[i]);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *hi_keys(HashIndex *t, PyObject *unused) { return hi_list(t, 0); }
static PyObject *hi_values(HashIndex *t, PyObject *unused) { return hi_list(t, 1); }
static PyObject *hi_items(HashIndex *t, PyObject *unused) { return hi_list(t, 2); }

static PyObject *hi_iter(HashIndex *t) {
    PyObject *keys = hi_list(t, 0);
    if (!keys) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *hi_nbytes(HashIndex *t, void *unused) {
    return PyLong_FromSsize_t(t->cap * (Py_ssize_t)(sizeof(uint64_t) + sizeof(int32_t)));
}

static PyMappingMethods hi_as_mapping = {(lenfunc)hi_len, (binaryfunc)hi_subscript,
                                         (objobjargproc)hi_ass_subscript};
static PySequenceMethods hi_as_sequence = {.sq_contains = (objobjproc)hi_contains};

static PyMethodDef hi_methods[] = {
    {"get", (PyCFunction)(void (*)(void))hi_get_method, METH_FASTCALL, "get(key[, default])"},
    {"pop", (PyCFunction)(void (*)(void))hi_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)hi_clear, METH_NOARGS, "drop every entry (and the table)"},
    {"keys", (PyCFunction)hi_keys, METH_NOARGS, "the keys, as a list"},
    {"values", (PyCFunction)hi_values, METH_NOARGS, "the values, as a list"},
    {"items", (PyCFunction)hi_items, METH_NOARGS, "(key, value) pairs, as a list"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef hi_getset[] = {
    {"nbytes", (getter)hi_nbytes, NULL, "bytes of the table", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HashIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.logical._slots.HashIndex",
    .tp_basicsize = sizeof(HashIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mapping of unsigned 64-bit keys to int32 values >= 0 (open addressing).",
    .tp_new = hi_new,
    .tp_dealloc = (destructor)hi_dealloc,
    .tp_as_mapping = &hi_as_mapping,
    .tp_as_sequence = &hi_as_sequence,
    .tp_iter = (getiterfunc)hi_iter,
    .tp_methods = hi_methods,
    .tp_getset = hi_getset,
};

/* ---------------------------------------------------------------------------------------- */
/* BlockRecord fields                                                                       */

enum { R_SEQ, R_LOCAL, R_PARENT, R_SIZE, R_TOKENS, R_COUNT };
static const char *record_fields[R_COUNT] = {
    "sequence_hash", "local_hash", "parent_hash", "block_size", "token_ids"};
static Py_ssize_t roff[R_COUNT];
static PyObject *rnames[R_COUNT];
static PyTypeObject *record_type = NULL;

static PyObject *py_setup(PyObject *self, PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "setup(BlockRecord)");
        return NULL;
    }
    Py_ssize_t off[R_COUNT];
    for (int i = 0; i < R_COUNT; i++) {
        PyObject *d = PyObject_GetAttrString(type, record_fields[i]);
        if (!d) return NULL;
        int plain = PyObject_TypeCheck(d, &PyMemberDescr_Type) &&
                    ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (plain) off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!plain) {
            PyErr_Format(PyExc_TypeError, "%s is not a plain __slots__ slot", record_fields[i]);
            return NULL;
        }
    }
    memcpy(roff, off, sizeof off);
    Py_XSETREF(record_type, (PyTypeObject *)Py_NewRef(type));
    Py_RETURN_NONE;
}

/* A new reference to record.<field>, or NULL with an error. */
static inline PyObject *rec_get(PyObject *r, int field) {
    if (record_type && Py_IS_TYPE(r, record_type)) {
        PyObject *v = *(PyObject **)((char *)r + roff[field]);
        if (v) return Py_NewRef(v);
    }
    return PyObject_GetAttr(r, rnames[field]);
}

/* ---------------------------------------------------------------------------------------- */
/* SlotOps                                                                                  */

enum { C_STATE, C_FLAGS, C_REFS, C_TICK, C_SEQ, C_LOCAL, C_PARENT, C_UP, C_KIDS, C_PRIO,
       C_COUNT, C_PREV, C_NEXT, C_OWNER, C_BORN, C_HEAD, C_TAIL, C_SIZE, C_N };
static const Py_ssize_t col_itemsize[C_N] = {1, 1, 4, 8, 8, 8, 8, 4, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4};
/* 1: the column holds unsigned integers, 0: signed ones (slots.SLOT_COLUMNS, LIST_COLUMNS) */
static const int col_unsigned[C_N] = {1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0};

/* Whether a buffer's struct format is one integer of the column's signedness (its size is
 * checked apart): "B", "<q", "=L", ... */
static int integer_format(const char *format, int is_unsigned) {
    if (!format) return 0;
    if (*format == '@' || *format == '=' || *format == '<' || *format == '>' || *format == '!')
        format++;
    if (!format[0] || format[1]) return 0;
    return strchr(is_unsigned ? "BHILQN" : "bhilqn", format[0]) != NULL;
}

typedef struct {
    PyObject_HEAD
    Py_buffer bufs[C_N];
    int nbufs;
    uint8_t *state, *flags;
    int32_t *refs, *up, *kids, *prio, *prev, *next, *owner, *head, *tail, *size;
    int64_t *tick, *count;
    uint32_t *born;
    uint64_t *seq, *local, *parent;
    Py_ssize_t n, nlists;
    HashIndex *index;
    PyObject *pending, *tokens, *seeds;
    Py_ssize_t block_size;
} SlotOps;

static void so_dealloc(SlotOps *o) {
    for (int i = 0; i < o->nbufs; i++) PyBuffer_Release(&o->bufs[i]);
    Py_XDECREF(o->index);
    Py_XDECREF(o->pending);
    Py_XDECREF(o->tokens);
    Py_XDECREF(o->seeds);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *so_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *arrays, *index, *pending, *tokens, *seeds;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!n", &PyTuple_Type, &arrays, &HashIndexType, &index,
                          &PyDict_Type, &pending, &PyDict_Type, &tokens, &PyDict_Type, &seeds,
                          &block_size))
        return NULL;
    if (PyTuple_GET_SIZE(arrays) != C_N) {
        PyErr_Format(PyExc_ValueError, "SlotOps needs %d columns", C_N);
        return NULL;
    }
    SlotOps *o = (SlotOps *)type->tp_alloc(type, 0);
    if (!o) return NULL;
    for (int i = 0; i < C_N; i++) {
        Py_buffer *b = &o->bufs[i];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, i), b,
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            Py_DECREF(o);
            return NULL;
        }
        o->nbufs = i + 1;
        if (b->itemsize != col_itemsize[i] || !integer_format(b->format, col_unsigned[i])) {
            PyErr_Format(PyExc_ValueError, "column %d holds %zd-byte items of format %s, not "
                         "%zd-byte %s integers", i, b->itemsize, b->format ? b->format : "?",
                         col_itemsize[i], col_unsigned[i] ? "unsigned" : "signed");
            Py_DECREF(o);
            return NULL;
        }
    }
    o->n = o->bufs[C_STATE].len;
    o->nlists = o->bufs[C_HEAD].len / 4;
    /* slot ids and list ids are int32 in the columns and the index: list ids run to
     * n + 1, so n + 2 lists must fit */
    if (o->n > INT32_MAX - 2 || o->nlists != o->n + 2) {
        PyErr_Format(PyExc_ValueError, "SlotOps takes at most 2**31 - 3 slots and n + 2 "
                     "lists, got %zd slots and %zd lists", o->n, o->nlists);
        Py_DECREF(o);
        return NULL;
    }
    for (int i = 0; i < C_N; i++) {
        Py_ssize_t want = i >= C_HEAD ? o->nlists : o->n;
        if (o->bufs[i].len / o->bufs[i].itemsize != want) {
            PyErr_Format(PyExc_ValueError, "column %d has the wrong length", i);
            Py_DECREF(o);
            return NULL;
        }
    }
#define COL(c) (o->bufs[c].buf)
    o->state = COL(C_STATE); o->flags = COL(C_FLAGS); o->refs = COL(C_REFS);
    o->tick = COL(C_TICK); o->seq = COL(C_SEQ); o->local = COL(C_LOCAL);
    o->parent = COL(C_PARENT); o->up = COL(C_UP); o->kids = COL(C_KIDS); o->prio = COL(C_PRIO);
    o->count = COL(C_COUNT); o->prev = COL(C_PREV); o->next = COL(C_NEXT);
    o->owner = COL(C_OWNER); o->born = COL(C_BORN); o->head = COL(C_HEAD); o->tail = COL(C_TAIL); o->size = COL(C_SIZE);
#undef COL
    o->index = (HashIndex *)Py_NewRef(index);
    o->pending = Py_NewRef(pending);
    o->tokens = Py_NewRef(tokens);
    o->seeds = Py_NewRef(seeds);
    o->block_size = block_size;
    return (PyObject *)o;
}

/* ids must be a list of slot ids in range: 0, else -1 with TypeError / IndexError. */
static int check_ids(SlotOps *o, PyObject *ids) {
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "slot ids must be a list");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        PyObject *v = PyList_GET_ITEM(ids, i);
        Py_ssize_t s = PyLong_Check(v) ? PyLong_AsSsize_t(v) : -1;
        if (s < 0 || s >= o->n) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_IndexError, "no slot %R", v);
            }
            return -1;
        }
    }
    return 0;
}

#define ID(ids, i) PyLong_AsSsize_t(PyList_GET_ITEM(ids, i))

static int check_list(SlotOps *o, Py_ssize_t list_id) {
    if (list_id >= 1 && list_id < o->nlists) return 0;
    PyErr_Format(PyExc_IndexError, "no list %zd", list_id);
    return -1;
}

static inline int append_long(PyObject *out, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    if (!x) return -1;
    int r = PyList_Append(out, x);
    Py_DECREF(x);
    return r;
}

/* -- the index ---------------------------------------------------------------------------- */

/* The index is writable from Python too: a slot it gives is checked before it is used. */
static void index_past_slots(int32_t s) {
    PyErr_Format(PyExc_RuntimeError, "the hash index names slot %d, past the pool's slots", s);
}

/* stop_at_miss: prefix(), else find() */
static PyObject *lookup(SlotOps *o, PyObject *hashes, int stop_at_miss) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) goto error;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        uint64_t k;
        int ok = as_key(PySequence_Fast_GET_ITEM(seq, i), &k);
        if (ok < 0) goto error;
        int32_t slot = ok ? hi_get(o->index, k) : -1;
        if (slot < 0) {
            if (stop_at_miss) break;
            continue;
        }
        if (append_long(out, slot) < 0) goto error;
    }
    Py_DECREF(seq);
    return out;
error:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *so_prefix(SlotOps *o, PyObject *hashes) { return lookup(o, hashes, 1); }
static PyObject *so_find(SlotOps *o, PyObject *hashes) { return lookup(o, hashes, 0); }

static PyObject *so_unindex(SlotOps *o, PyObject *ids) {
    if (check_ids(o, ids) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(o->seq[ID(ids, i)]);
        if (!h) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, h);
    }
    int32_t *was = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!was) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = o->seq[ID(ids, i)];
        was[i] = hi_get(o->index, h);
        if (was[i] < 0) {
            /* not indexed (or twice in ids): put back what went, as it was (no growth:
             * the table holds fewer keys than before), and raise */
            for (Py_ssize_t j = i - 1; j >= 0; j--) hi_put(o->index, o->seq[ID(ids, j)], was[j]);
            PyMem_Free(was);
            PyErr_SetObject(PyExc_KeyError, PyList_GET_ITEM(out, i));
            Py_DECREF(out);
            return NULL;
        }
        hi_del(o->index, h);
    }
    PyMem_Free(was);
    return out;
}

/* -- references --------------------------------------------------------------------------- */

static PyObject *so_claim(SlotOps *o, PyObject *ids) {
    if (check_ids(o, ids) < 0) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) o->refs[ID(ids, i)] = 1;
    Py_RETURN_NONE;
}

static PyObject *so_acquire(SlotOps *o, PyObject *args) {
    PyObject *ids, *active;
    if (!PyArg_ParseTuple(args, "OO", &ids, &active) || check_ids(o, ids) < 0) return NULL;
    if (active != Py_None && !PySet_Check(active)) {
        PyErr_SetString(PyExc_TypeError, "active must be a set or None");
        return NULL;
    }
    PyObject *leaving = PyList_New(0);
    if (!leaving) return NULL;
    Py_ssize_t woken = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        Py_ssize_t s = ID(ids, i);
        if (o->refs[s] == 0) {
            woken++;
            if (active != Py_None && PySet_Add(active, PyList_GET_ITEM(ids, i)) < 0) goto error;
            if ((active == Py_None || !o->kids[s]) &&
                PyList_Append(leaving, PyList_GET_ITEM(ids, i)) < 0)
                goto error;
        }
        o->refs[s]++;
    }
    return Py_BuildValue("(Nn)", leaving, woken);
error:
    Py_DECREF(leaving);
    return NULL;
}

static PyObject *so_release(SlotOps *o, PyObject *args) {
    PyObject *ids, *active;
    long long tick;
    if (!PyArg_ParseTuple(args, "OLO", &ids, &tick, &active) || check_ids(o, ids) < 0)
        return NULL;
    if (active != Py_None && !PySet_Check(active)) {
        PyErr_SetString(PyExc_TypeError, "active must be a set or None");
        return NULL;
    }
    PyObject *idle = PyList_New(0);
    if (!idle) return NULL;
    Py_ssize_t parked = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        Py_ssize_t s = ID(ids, i);
        PyObject *item = PyList_GET_ITEM(ids, i);
        if (o->refs[s] <= 0) {
            PyErr_Format(PyExc_AssertionError, "block %zd released more than acquired", s);
            goto error;
        }
        if (--o->refs[s]) continue;
        o->tick[s] = ++tick;
        if (active != Py_None) {
            if (PySet_Discard(active, item) < 0) goto error;
            if (o->kids[s]) {
                parked++;
                continue;
            }
        }
        if (PyList_Append(idle, item) < 0) goto error;
    }
    return Py_BuildValue("(LNn)", tick, idle, parked);
error:
    Py_DECREF(idle);
    return NULL;
}

static int drop_side(PyObject *side, PyObject *ids) {
    if (!PyDict_GET_SIZE(side)) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        PyObject *key = PyList_GET_ITEM(ids, i);
        PyObject *v = PyDict_GetItemWithError(side, key);
        if (!v) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        if (PyDict_DelItem(side, key) < 0) return -1;
    }
    return 0;
}

static PyObject *so_reset(SlotOps *o, PyObject *args) {
    PyObject *ids;
    int ref_count, plain;
    if (!PyArg_ParseTuple(args, "Oip", &ids, &ref_count, &plain) || check_ids(o, ids) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        Py_ssize_t s = ID(ids, i);
        o->refs[s] = ref_count;
        o->state[s] = RESET;
        o->flags[s] = 0;
        o->prio[s] = 0;
        if (!plain) {
            o->up[s] = 0;
            o->kids[s] = 0;
            o->count[s] = 0;
        }
    }
    if (drop_side(o->pending, ids) < 0 || drop_side(o->tokens, ids) < 0 ||
        drop_side(o->seeds, ids) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A leaf-first pool's blocks leave: each that waits for its parent (no parent linked, a
 * parent hash, and the table's entry for that hash is this slot) leaves the table. Returns
 * how many left it. */
static PyObject *so_unwait(SlotOps *o, PyObject *args) {
    PyObject *ids;
    HashIndex *waiting;
    if (!PyArg_ParseTuple(args, "OO!", &ids, &HashIndexType, &waiting) || check_ids(o, ids) < 0)
        return NULL;
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids) && waiting->used; i++) {
        Py_ssize_t s = ID(ids, i);
        if (o->up[s] || !(o->flags[s] & HAS_PARENT)) continue;
        if (hi_get(waiting, o->parent[s]) == (int32_t)s) {
            hi_del(waiting, o->parent[s]);
            gone++;
        }
    }
    return PyLong_FromSsize_t(gone);
}

/* -- identity ----------------------------------------------------------------------------- */

/* 1: the pair is valid and applied; 0: invalid (nothing stored); -1: an error. */
static int apply_one(SlotOps *o, Py_ssize_t s, PyObject *slot_obj, PyObject *record,
                     Py_ssize_t size) {
    if (o->state[s] != RESET) return 0;
    PyObject *f[R_COUNT] = {NULL};
    int result = -1;
    for (int i = 0; i < R_COUNT; i++)
        if (!(f[i] = rec_get(record, i))) goto done;
    result = 0;
    if (!PyLong_Check(f[R_SIZE])) goto done;
    Py_ssize_t bs = PyLong_AsSsize_t(f[R_SIZE]);
    if (bs == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto done;
    }
    if (bs != size) goto done;
    if (f[R_TOKENS] != Py_None) {
        Py_ssize_t len = PyObject_Length(f[R_TOKENS]);
        if (len < 0) {
            result = -1;
            goto done;
        }
        if (len != size) goto done;
    }
    uint64_t h, local, parent = 0;
    int ok;
    if ((ok = int_key(f[R_SEQ], &h)) <= 0 || (ok = int_key(f[R_LOCAL], &local)) <= 0 ||
        (f[R_PARENT] != Py_None && (ok = int_key(f[R_PARENT], &parent)) <= 0)) {
        result = ok;
        goto done;
    }
    if (f[R_TOKENS] != Py_None) {
        PyObject *list = PySequence_List(f[R_TOKENS]);
        if (!list || PyDict_SetItem(o->tokens, slot_obj, list) < 0) {
            Py_XDECREF(list);
            result = -1;
            goto done;
        }
        Py_DECREF(list);
    }
    if (PyDict_SetItem(o->pending, slot_obj, record) < 0) {
        result = -1;
        goto done;
    }
    o->state[s] = COMPLETE;
    o->seq[s] = h;
    o->local[s] = local;
    if (f[R_PARENT] == Py_None) {
        o->flags[s] = 0;
    } else {
        o->parent[s] = parent;
        o->flags[s] = HAS_PARENT;
    }
    result = 1;
done:
    for (int i = 0; i < R_COUNT; i++) Py_XDECREF(f[i]);
    return result;
}

static PyObject *so_apply(SlotOps *o, PyObject *args) {
    PyObject *ids, *records;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OOn", &ids, &records, &size) || check_ids(o, ids) < 0)
        return NULL;
    /* reading a record may run Python code (a property, __len__, __iter__), which could
     * change either list: both are copies */
    PyObject *fixed = PyList_AsTuple(ids), *recs = fixed ? PySequence_Tuple(records) : NULL;
    if (!recs) {
        Py_XDECREF(fixed);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(fixed), done = 0;
    if (PyTuple_GET_SIZE(recs) < n) n = PyTuple_GET_SIZE(recs);
    for (; done < n; done++) {
        PyObject *slot = PyTuple_GET_ITEM(fixed, done);
        int r = apply_one(o, PyLong_AsSsize_t(slot), slot, PyTuple_GET_ITEM(recs, done), size);
        if (r < 0) {
            done = -1;
            break;
        }
        if (!r) break;
    }
    Py_DECREF(fixed);
    Py_DECREF(recs);
    return done < 0 ? NULL : PyLong_FromSsize_t(done);
}

static PyObject *register_ids(SlotOps *o, PyObject *ids, PyObject *tiers, int32_t bit, int link,
                              uint32_t born, PyObject *waiting);

static PyObject *so_register_new(SlotOps *o, PyObject *args) {
    PyObject *ids, *tiers, *waiting = Py_None;
    long bit;
    int link;
    long long born;
    if (!PyArg_ParseTuple(args, "OOlpL|O", &ids, &tiers, &bit, &link, &born, &waiting) ||
        check_ids(o, ids) < 0)
        return NULL;
    if (tiers != Py_None && (bit < 0 || bit > INT32_MAX)) {
        PyErr_Format(PyExc_ValueError, "a tier bit is in [0, 2**31), got %ld", bit);
        return NULL;
    }
    if (born < 0 || born + PyList_GET_SIZE(ids) > (long long)UINT32_MAX + 1) {
        PyErr_Format(PyExc_ValueError, "registration stamps %lld.. do not fit 32 bits", born);
        return NULL;
    }
    /* tiers is any mapping (its methods may run Python code): the ids are a copy */
    PyObject *fixed = PyList_AsTuple(ids);
    if (!fixed) return NULL;
    PyObject *result = register_ids(o, fixed, tiers, (int32_t)bit, link, (uint32_t)born,
                                    waiting);
    Py_DECREF(fixed);
    return result;
}

/* Whether the tiers map holds none of the batch's hashes: 1 / 0, or -1 with an error. */
static int tiers_hold_none(SlotOps *o, PyObject *ids, PyObject *tiers) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ids); i++) {
        uint64_t h = o->seq[PyLong_AsSsize_t(PyTuple_GET_ITEM(ids, i))];
        if (Py_IS_TYPE(tiers, &HashIndexType)) {
            if (hi_find((HashIndex *)tiers, h) >= 0) return 0;
            continue;
        }
        PyObject *key = PyLong_FromUnsignedLongLong(h);
        int has = key ? PySequence_Contains(tiers, key) : -1;
        Py_XDECREF(key);
        if (has) return has < 0 ? -1 : 0;
    }
    return 1;
}

/* The slots of the batch whose sequence hash is a key of ``waiting`` (a leaf-first pool's
 * parent hash -> a slot waiting for it; a HashIndex, or any mapping): they adopt those
 * children. NULL with an error. */
static PyObject *adopters_of(SlotOps *o, PyObject *ids, PyObject *waiting) {
    PyObject *out = PyList_New(0);
    if (!out || waiting == Py_None) return out;
    int native = Py_IS_TYPE(waiting, &HashIndexType);
    Py_ssize_t size = native ? ((HashIndex *)waiting)->used : PyObject_Length(waiting);
    if (size <= 0) {
        if (size == 0) return out;
        Py_DECREF(out);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ids); i++) {
        PyObject *slot = PyTuple_GET_ITEM(ids, i);
        uint64_t h = o->seq[PyLong_AsSsize_t(slot)];
        int has;
        if (native) {
            has = hi_find((HashIndex *)waiting, h) >= 0;
        } else {
            PyObject *key = PyLong_FromUnsignedLongLong(h);
            has = key ? PySequence_Contains(waiting, key) : -1;
            Py_XDECREF(key);
        }
        if (has < 0 || (has && PyList_Append(out, slot) < 0)) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* register_new on a tuple of ids in range. Everything that can fail for want of memory or
 * in the tiers map's own methods (the result lists, the tables' growth, the look-ups in the
 * map) is done before the first change. */
static PyObject *register_ids(SlotOps *o, PyObject *ids, PyObject *tiers, int32_t bit, int link,
                              uint32_t born, PyObject *waiting) {
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
#define TID(i) PyLong_AsSsize_t(PyTuple_GET_ITEM(ids, i))
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = TID(i);
        if (o->state[s] != COMPLETE) Py_RETURN_NONE;
        int has = PyDict_Contains(o->pending, PyTuple_GET_ITEM(ids, i));
        if (has < 0) return NULL;
        if (!has || hi_find(o->index, o->seq[s]) >= 0) Py_RETURN_NONE;
    }
    int tiers_new = 0;
    if (tiers != Py_None && (tiers_new = tiers_hold_none(o, ids, tiers)) < 0) return NULL;
    PyObject *records = PyList_New(n), *leaving = PyList_New(0), *unlinked = PyList_New(0);
    PyObject *adopters = link ? adopters_of(o, ids, waiting) : PyList_New(0);
    /* a table of the index's kind takes the blocks that wait for their parent here */
    HashIndex *table = link && Py_IS_TYPE(waiting, &HashIndexType) ? (HashIndex *)waiting : NULL;
    if (!records || !leaving || !unlinked || !adopters || hi_reserve(o->index, n) < 0 ||
        (table && hi_reserve(table, n) < 0) ||
        (tiers_new && Py_IS_TYPE(tiers, &HashIndexType) && hi_reserve((HashIndex *)tiers, n) < 0))
        goto error;
    /* index the batch (no growth now: cannot fail); a hash twice in it is found at its
     * second block: undo, decline */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = TID(i);
        if (hi_find(o->index, o->seq[s]) >= 0) {
            for (Py_ssize_t j = 0; j < i; j++) hi_del(o->index, o->seq[TID(j)]);
            Py_DECREF(records);
            Py_DECREF(leaving);
            Py_DECREF(unlinked);
            Py_DECREF(adopters);
            Py_RETURN_NONE;
        }
        hi_put(o->index, o->seq[s], (int32_t)s);
    }
    for (Py_ssize_t i = 0; i < n; i++) {     /* every slot is in pending (checked above) */
        PyObject *key = PyTuple_GET_ITEM(ids, i);
        PyObject *r = PyDict_GetItemWithError(o->pending, key);
        if (!r) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            goto error;
        }
        PyList_SET_ITEM(records, i, Py_NewRef(r));
        if (PyDict_DelItem(o->pending, key) < 0) goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = TID(i);
        o->state[s] = REGISTERED;
        o->born[s] = born + (uint32_t)i;
        if (!link || !(o->flags[s] & HAS_PARENT)) continue;
        /* as the Python loop, which indexes block by block: a parent later in the batch
         * (still Complete here) is not linked */
        int32_t p = hi_get(o->index, o->parent[s]);
        if (p >= o->n) {
            index_past_slots(p);
            goto error;
        }
        if (p == s) continue;                /* a block never is its own prefix */
        if (p < 0 && table && hi_find(table, o->parent[s]) < 0) {
            hi_put(table, o->parent[s], (int32_t)s);    /* reserved: cannot fail */
            continue;                        /* waits for its parent, held nowhere here */
        }
        if (p < 0 || o->state[p] != REGISTERED) {
            /* later in the batch, or another block waits for the same parent: the pool's */
            if (append_long(unlinked, s) < 0) goto error;
            continue;
        }
        o->up[s] = p + 1;
        if (++o->kids[p] == 1 && o->refs[p] == 0 && append_long(leaving, p) < 0) goto error;
    }
    for (Py_ssize_t i = 0; i < n && tiers_new; i++) {
        uint64_t h = o->seq[TID(i)];
        if (Py_IS_TYPE(tiers, &HashIndexType)) {
            hi_put((HashIndex *)tiers, h, bit);          /* reserved: cannot fail */
        } else {
            PyObject *key = PyLong_FromUnsignedLongLong(h), *v = PyLong_FromLong(bit);
            int bad = !key || !v || PyObject_SetItem(tiers, key, v) < 0;
            Py_XDECREF(key);
            Py_XDECREF(v);
            if (bad) goto error;
        }
    }
#undef TID
    return Py_BuildValue("(NONNN)", records, tiers_new ? Py_True : Py_False, leaving, unlinked,
                         adopters);
error:
    Py_XDECREF(records);
    Py_XDECREF(leaving);
    Py_XDECREF(unlinked);
    Py_XDECREF(adopters);
    return NULL;
}

/* -- use ---------------------------------------------------------------------------------- */

static inline void count_hit(SlotOps *o, Py_ssize_t s, long long cap) {
    if (cap < 0 || o->count[s] < cap) o->count[s]++;
}

static PyObject *so_touch(SlotOps *o, PyObject *args) {
    PyObject *hashes;
    long long tick, cap;
    int leaf_first, hits;
    if (!PyArg_ParseTuple(args, "OLppL", &hashes, &tick, &leaf_first, &hits, &cap)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    PyObject *movers = PyList_New(0);
    if (!movers) goto error;
    Py_ssize_t touched = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        uint64_t k;
        int ok = as_key(PySequence_Fast_GET_ITEM(seq, i), &k);
        if (ok < 0) goto error;
        int32_t s = ok ? hi_get(o->index, k) : -1;
        if (s < 0) continue;
        if (s >= o->n) {
            index_past_slots(s);
            goto error;
        }
        o->tick[s] = ++tick;
        if (hits) count_hit(o, s, cap);
        if (o->refs[s] == 0 && !(leaf_first && o->kids[s]) && append_long(movers, s) < 0)
            goto error;
        touched++;
    }
    Py_DECREF(seq);
    return Py_BuildValue("(LNn)", tick, movers, touched);
error:
    Py_XDECREF(movers);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *so_count_hits(SlotOps *o, PyObject *args) {
    PyObject *ids;
    long long cap;
    if (!PyArg_ParseTuple(args, "OL", &ids, &cap) || check_ids(o, ids) < 0) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) count_hit(o, ID(ids, i), cap);
    Py_RETURN_NONE;
}

/* -- intrusive lists ---------------------------------------------------------------------- */

/* The columns are writable from Python (memoryviews), so a link read from them is checked
 * before it is followed: a damaged list raises RuntimeError instead of reaching outside
 * the arrays. */
static int corrupt(Py_ssize_t at, const char *what, long long value) {
    PyErr_Format(PyExc_RuntimeError, "slot lists are damaged (at %zd: %s %lld)", at, what,
                 value);
    return -1;
}

#define SLOT_IN(o, s) ((s) >= 0 && (s) < (o)->n)
#define LINK_IN(o, s) ((s) >= -1 && (s) < (o)->n)

/* Take s out of its list: the list's id, or -1 with RuntimeError (a damaged link). */
static inline int32_t unlink_slot(SlotOps *o, Py_ssize_t s) {
    int32_t l = o->owner[s], p = o->prev[s], nx = o->next[s];
    if (l < 1 || l >= o->nlists) return corrupt(s, "owner", l);
    if (!LINK_IN(o, p)) return corrupt(s, "prev", p);
    if (!LINK_IN(o, nx)) return corrupt(s, "next", nx);
    if (p >= 0) o->next[p] = nx;
    else o->head[l] = nx;
    if (nx >= 0) o->prev[nx] = p;
    else o->tail[l] = p;
    o->size[l]--;
    o->owner[s] = 0;
    return l;
}

/* s becomes the last (front: the first) slot of list l, leaving its list if in one;
 * 0, or -1 with RuntimeError (a damaged link). */
static inline int link_slot(SlotOps *o, Py_ssize_t l, Py_ssize_t s, int front) {
    if (o->owner[s] && unlink_slot(o, s) < 0) return -1;
    int32_t *towards = front ? o->next : o->prev, *away = front ? o->prev : o->next;
    int32_t *end = front ? o->head : o->tail, *other_end = front ? o->tail : o->head;
    int32_t old = o->size[l] ? end[l] : -1;
    if (o->size[l] && !SLOT_IN(o, old)) return corrupt(s, front ? "list head" : "list tail", old);
    towards[s] = old;
    away[s] = -1;
    if (old >= 0) away[old] = (int32_t)s;
    else other_end[l] = (int32_t)s;
    end[l] = (int32_t)s;
    o->size[l]++;
    o->owner[s] = (int32_t)l;
    return 0;
}

#define append_slot(o, l, s) link_slot(o, l, s, 0)

static PyObject *so_push_back(SlotOps *o, PyObject *args) {
    Py_ssize_t l;
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "nO", &l, &ids) || check_list(o, l) < 0 || check_ids(o, ids) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++)
        if (append_slot(o, l, ID(ids, i)) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *so_push_front(SlotOps *o, PyObject *args) {
    Py_ssize_t l, s;
    if (!PyArg_ParseTuple(args, "nn", &l, &s) || check_list(o, l) < 0) return NULL;
    if (s < 0 || s >= o->n) {
        PyErr_Format(PyExc_IndexError, "no slot %zd", s);
        return NULL;
    }
    if (link_slot(o, l, s, 1) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *so_unlink(SlotOps *o, PyObject *ids) {
    if (check_ids(o, ids) < 0) return NULL;
    PyObject *emptied = PyList_New(0);
    if (!emptied) return NULL;
    Py_ssize_t taken = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        Py_ssize_t s = ID(ids, i);
        if (!o->owner[s]) continue;
        int32_t l = unlink_slot(o, s);
        taken++;
        if (l < 0 || (!o->size[l] && append_long(emptied, l) < 0)) {
            Py_DECREF(emptied);
            return NULL;
        }
    }
    return Py_BuildValue("(nN)", taken, emptied);
}

static PyObject *so_pop_front(SlotOps *o, PyObject *args) {
    Py_ssize_t l, count;
    if (!PyArg_ParseTuple(args, "nn", &l, &count) || check_list(o, l) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    while (PyList_GET_SIZE(out) < count && o->size[l] > 0) {
        int32_t s = o->head[l];
        if ((!SLOT_IN(o, s) && corrupt(l, "head", s) < 0) || unlink_slot(o, s) < 0 ||
            append_long(out, s) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *so_members(SlotOps *o, PyObject *arg) {
    Py_ssize_t l = PyLong_AsSsize_t(arg);
    if ((l == -1 && PyErr_Occurred()) || check_list(o, l) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    /* at most size[l] steps: a damaged list (a cycle, a link out of range) raises */
    Py_ssize_t left = o->size[l];
    for (int32_t s = left > 0 ? o->head[l] : -1; s >= 0; s = o->next[s]) {
        if (!SLOT_IN(o, s) || left-- <= 0 || o->owner[s] != l) {
            corrupt(l, "member", s);
            goto error;
        }
        if (append_long(out, s) < 0) goto error;
    }
    if (left) {
        corrupt(l, "size past its members", left);
        goto error;
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

/* -- the aged-LFU and adaptive orders' common cases (eviction.py, adaptive.py) ---------- */

/* lfu_insert(ids, age, last_tick, buckets, recent) -> last tick, a list of the keys that
 * have no bucket yet (nothing changed: make them, call again), or None (nothing changed:
 * some slot is in a list already, or the ticks do not rise past last_tick; the Python loop
 * takes those). Appends each slot to the bucket of key age + count; with recent (a list),
 * "tick, slot" pairs to it too. */
static PyObject *so_lfu_insert(SlotOps *o, PyObject *args) {
    PyObject *ids, *buckets, *recent;
    long long age, last;
    if (!PyArg_ParseTuple(args, "OLLO!O", &ids, &age, &last, &PyDict_Type, &buckets, &recent) ||
        check_ids(o, ids) < 0)
        return NULL;
    if (recent != Py_None && !PyList_CheckExact(recent)) {
        PyErr_SetString(PyExc_TypeError, "recent must be a list or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    long long t = last;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = ID(ids, i);
        if (o->owner[s] || o->tick[s] <= t) Py_RETURN_NONE;
        t = o->tick[s];
    }
    PyObject *missing = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long k;
        if (__builtin_add_overflow(age, o->count[ID(ids, i)], &k)) {
            PyErr_SetString(PyExc_OverflowError, "lfu key beyond 64 bits");
            goto error;
        }
        PyObject *key = PyLong_FromLongLong(k);
        if (!key) goto error;
        PyObject *l = PyDict_GetItemWithError(buckets, key);
        if (l) {                    /* a bucket: its list must exist before anything moves */
            Py_ssize_t lid = PyLong_Check(l) ? PyLong_AsSsize_t(l) : -1;
            if ((lid == -1 && PyErr_Occurred()) || check_list(o, lid) < 0) {
                Py_DECREF(key);
                goto error;
            }
        } else if (!PyErr_Occurred()) {
            int bad = (!missing && !(missing = PyList_New(0)));
            if (!bad) {
                int has = PySequence_Contains(missing, key);
                bad = has < 0 || (!has && PyList_Append(missing, key) < 0);
            }
            if (bad) {
                Py_DECREF(key);
                goto error;
            }
        }
        Py_DECREF(key);
        if (PyErr_Occurred()) goto error;
    }
    if (missing) return missing;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = ID(ids, i);
        PyObject *key = PyLong_FromLongLong(age + o->count[s]);
        if (!key) return NULL;
        PyObject *l = PyDict_GetItemWithError(buckets, key);
        Py_DECREF(key);
        Py_ssize_t lid = l ? PyLong_AsSsize_t(l) : -1;
        if (lid < 0 || check_list(o, lid) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "bucket vanished");
            return NULL;
        }
        if (append_slot(o, lid, s) < 0) return NULL;
        if (recent != Py_None) {
            PyObject *tk = PyLong_FromLongLong(o->tick[s]);
            int bad = !tk || PyList_Append(recent, tk) < 0 ||
                      PyList_Append(recent, PyList_GET_ITEM(ids, i)) < 0;
            Py_XDECREF(tk);
            if (bad) return NULL;
        }
    }
    return PyLong_FromLongLong(t);
error:
    Py_XDECREF(missing);
    return NULL;
}

/* remember(ids, ghost, ghost_size): each evicted slot's count into the ghost (an ordered
 * dict of hash -> count, oldest first, at most ghost_size), as AgedFrequencyEviction.remember. */
static PyObject *s_move_to_end = NULL, *s_popitem = NULL;
static PyObject *remember_ids(SlotOps *o, PyObject *ids, PyObject *ghost, Py_ssize_t size);

static PyObject *so_remember(SlotOps *o, PyObject *args) {
    PyObject *ids, *ghost;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OOn", &ids, &ghost, &size) || check_ids(o, ids) < 0)
        return NULL;
    /* the ghost is any mapping: its methods may run Python code, so the ids are a copy */
    PyObject *fixed = PyList_AsTuple(ids);
    if (!fixed) return NULL;
    PyObject *result = remember_ids(o, fixed, ghost, size);
    Py_DECREF(fixed);
    return result;
}

static PyObject *remember_ids(SlotOps *o, PyObject *ids, PyObject *ghost, Py_ssize_t size) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ids); i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(ids, i));
        PyObject *h = PyLong_FromUnsignedLongLong(o->seq[s]), *c = PyLong_FromLongLong(o->count[s]);
        int bad = !h || !c;
        if (!bad) {
            int has = PySequence_Contains(ghost, h);
            bad = has < 0;
            if (has > 0) {
                PyObject *r = PyObject_CallMethodOneArg(ghost, s_move_to_end, h);
                bad = !r;
                Py_XDECREF(r);
            }
        }
        bad = bad || PyObject_SetItem(ghost, h, c) < 0;
        Py_XDECREF(h);
        Py_XDECREF(c);
        if (bad) return NULL;
        Py_ssize_t len = PyObject_Length(ghost);
        if (len < 0) return NULL;
        if (len > size) {
            PyObject *r = PyObject_CallMethodOneArg(ghost, s_popitem, Py_False);
            if (!r) return NULL;
            Py_DECREF(r);
        }
    }
    Py_RETURN_NONE;
}

/* A recency queue's pair: its tick and slot (ints only: nothing runs Python code while a
 * loop holds the list's items), the slot in range. 0, or -1 with an error. */
static int queue_pair(SlotOps *o, PyObject *tk, PyObject *sl, long long *t, Py_ssize_t *s) {
    if (!PyLong_Check(tk) || !PyLong_Check(sl)) {
        PyErr_SetString(PyExc_TypeError, "a recency queue holds ints");
        return -1;
    }
    *t = PyLong_AsLongLong(tk);
    *s = PyLong_AsSsize_t(sl);
    if (PyErr_Occurred()) return -1;
    if (*s < 0 || *s >= o->n) {
        PyErr_Format(PyExc_IndexError, "no slot %zd", *s);
        return -1;
    }
    return 0;
}

/* recent_take(recent, head, count) -> (slots, head, emptied lists): the next count live
 * pairs of the recency queue from head (live: the slot is in a list, with that tick), each
 * slot taken out of its list; as DuelingEviction._recent_victims. */
static PyObject *so_recent_take(SlotOps *o, PyObject *args) {
    PyObject *recent;
    Py_ssize_t head, count;
    if (!PyArg_ParseTuple(args, "O!nn", &PyList_Type, &recent, &head, &count)) return NULL;
    if (head < 0) {
        PyErr_Format(PyExc_IndexError, "recency queue head %zd < 0", head);
        return NULL;
    }
    PyObject *out = PyList_New(0), *emptied = PyList_New(0);
    if (!out || !emptied) goto error;
    while (PyList_GET_SIZE(out) < count && head + 1 < PyList_GET_SIZE(recent)) {
        PyObject *tk = PyList_GET_ITEM(recent, head), *sl = PyList_GET_ITEM(recent, head + 1);
        head += 2;
        long long t;
        Py_ssize_t s;
        if (queue_pair(o, tk, sl, &t, &s) < 0) goto error;
        if (o->tick[s] != t || !o->owner[s]) continue;
        int32_t l = unlink_slot(o, s);
        if (l < 0 || PyList_Append(out, sl) < 0 || (!o->size[l] && append_long(emptied, l) < 0))
            goto error;
    }
    return Py_BuildValue("(NnN)", out, head, emptied);
error:
    Py_XDECREF(out);
    Py_XDECREF(emptied);
    return NULL;
}

/* recent_prune(recent, head) -> list: the live pairs of the queue from head on, in order. */
static PyObject *so_recent_prune(SlotOps *o, PyObject *args) {
    PyObject *recent;
    Py_ssize_t head;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &recent, &head)) return NULL;
    if (head < 0) {
        PyErr_Format(PyExc_IndexError, "recency queue head %zd < 0", head);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = head; i + 1 < PyList_GET_SIZE(recent); i += 2) {
        PyObject *tk = PyList_GET_ITEM(recent, i), *sl = PyList_GET_ITEM(recent, i + 1);
        long long t;
        Py_ssize_t s;
        if (queue_pair(o, tk, sl, &t, &s) < 0) goto error;
        if (o->tick[s] == t && o->owner[s] &&
            (PyList_Append(out, tk) < 0 || PyList_Append(out, sl) < 0))
            goto error;
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef so_methods[] = {
    {"prefix", (PyCFunction)so_prefix, METH_O, "prefix(hashes) -> slots"},
    {"find", (PyCFunction)so_find, METH_O, "find(hashes) -> slots"},
    {"unindex", (PyCFunction)so_unindex, METH_O, "unindex(ids) -> hashes"},
    {"claim", (PyCFunction)so_claim, METH_O, "claim(ids)"},
    {"acquire", (PyCFunction)so_acquire, METH_VARARGS, "acquire(ids, active) -> (leaving, woken)"},
    {"release", (PyCFunction)so_release, METH_VARARGS, "release(ids, tick, active) -> (tick, idle, parked)"},
    {"reset", (PyCFunction)so_reset, METH_VARARGS, "reset(ids, ref_count, plain)"},
    {"unwait", (PyCFunction)so_unwait, METH_VARARGS, "unwait(ids, waiting) -> how many left it"},
    {"apply", (PyCFunction)so_apply, METH_VARARGS, "apply(ids, records, size) -> applied"},
    {"register_new", (PyCFunction)so_register_new, METH_VARARGS, "register_new(ids, tiers, bit, link, born, waiting=None) -> (records, tiers_done, leaving, unlinked, adopters) or None"},
    {"touch", (PyCFunction)so_touch, METH_VARARGS, "touch(hashes, tick, leaf_first, hits, cap) -> (tick, movers, touched)"},
    {"count_hits", (PyCFunction)so_count_hits, METH_VARARGS, "count_hits(ids, cap)"},
    {"push_back", (PyCFunction)so_push_back, METH_VARARGS, "push_back(list_id, ids)"},
    {"push_front", (PyCFunction)so_push_front, METH_VARARGS, "push_front(list_id, slot)"},
    {"unlink", (PyCFunction)so_unlink, METH_O, "unlink(ids) -> (taken, emptied lists)"},
    {"pop_front", (PyCFunction)so_pop_front, METH_VARARGS, "pop_front(list_id, count) -> slots"},
    {"members", (PyCFunction)so_members, METH_O, "members(list_id) -> slots"},
    {"lfu_insert", (PyCFunction)so_lfu_insert, METH_VARARGS, "lfu_insert(ids, age, last_tick, buckets, recent) -> last tick, missing keys or None"},
    {"remember", (PyCFunction)so_remember, METH_VARARGS, "remember(ids, ghost, ghost_size)"},
    {"recent_prune", (PyCFunction)so_recent_prune, METH_VARARGS, "recent_prune(recent, head) -> live pairs"},
    {"recent_take", (PyCFunction)so_recent_take, METH_VARARGS, "recent_take(recent, head, count) -> (slots, head, emptied)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotOpsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.logical._slots.SlotOps",
    .tp_basicsize = sizeof(SlotOps),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The loops of slots.PySlotOps over a store's columns, in C.",
    .tp_new = so_new,
    .tp_dealloc = (destructor)so_dealloc,
    .tp_methods = so_methods,
};

static PyMethodDef module_methods[] = {
    {"setup", py_setup, METH_O, "setup(BlockRecord): read the record class's slot offsets"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slots",
    "A pool's hash index and slot loops in C; see kvstrata/logical/slots.py.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__slots(void) {
    for (int i = 0; i < R_COUNT; i++)
        if (!(rnames[i] = PyUnicode_InternFromString(record_fields[i]))) return NULL;
    if (!(s_move_to_end = PyUnicode_InternFromString("move_to_end")) ||
        !(s_popitem = PyUnicode_InternFromString("popitem")))
        return NULL;
    if (PyType_Ready(&HashIndexType) < 0 || PyType_Ready(&SlotOpsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "HashIndex", (PyObject *)&HashIndexType) < 0 ||
        PyModule_AddObjectRef(m, "SlotOps", (PyObject *)&SlotOpsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
