/* Native loops over pool blocks for kvstrata.logical (optional; logical/blockops.py has the
 * pure-Python versions, which are the reference and the fallback: same effects, same errors).
 *
 * A pool's hot paths store a dozen slots per block (reset on eviction, identity on
 * apply_token_blocks, references and recency on release); in Python each store is a
 * bytecode round trip. These functions do the same stores in C, straight into the slots of
 * Block and BlockRecord objects, whose offsets setup() reads from the classes' own slot
 * descriptors (so a changed __slots__ is picked up, and a slot that is not a plain object
 * slot makes setup() fail, leaving the Python path in charge).
 *
 * setup(Block, BlockRecord, RESET, COMPLETE, REGISTERED, DEFAULT_SEED)
 * reset(blocks, ref_count, plain)     Block.reset() on each, ref_count set; plain: leave
 *                                      parent_id, children, policy_state (never set)
 * apply(blocks, records, size) -> n   apply_token_block's stores for blocks[i] <- records[i]
 *                                      while valid (Reset, block_size == size, tokens of
 *                                      that length); returns how many were applied
 * release(blocks, tick) -> (tick, idle) or None: ref_count -= 1; those reaching 0 get
 *                                      release_tick = ++tick and are listed in idle
 * mark(blocks, state)                 state = state on each
 * register_new(blocks, by_hash, tiers, bit) -> (records, tiers_done) or None: see below
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

enum { B_STATE, B_TOKENS, B_SEED, B_PARENT_HASH, B_LOCAL_HASH, B_SEQUENCE_HASH, B_PRIORITY,
       B_REF_COUNT, B_RELEASE_TICK, B_PARENT_ID, B_CHILDREN, B_CACHED_RECORD, B_POLICY_STATE,
       B_COUNT };
static const char *block_slots[B_COUNT] = {
    "state", "tokens", "seed", "parent_hash", "local_hash", "sequence_hash", "priority",
    "ref_count", "release_tick", "parent_id", "children", "cached_record", "policy_state"};
enum { R_SEQUENCE_HASH, R_LOCAL_HASH, R_PARENT_HASH, R_BLOCK_SIZE, R_TOKEN_IDS, R_COUNT };
static const char *record_slots[R_COUNT] = {
    "sequence_hash", "local_hash", "parent_hash", "block_size", "token_ids"};

static Py_ssize_t boff[B_COUNT], roff[R_COUNT];
static PyTypeObject *block_type = NULL, *record_type = NULL;
static PyObject *v_reset = NULL, *v_complete = NULL, *v_registered = NULL, *v_seed = NULL;
static PyObject *v_zero = NULL, *v_minus1 = NULL;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static inline void put(PyObject *o, Py_ssize_t off, PyObject *v) {
    PyObject *old = SLOT(o, off);
    Py_INCREF(v);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

static int read_offsets(PyObject *type, const char **names, int n, Py_ssize_t *out) {
    for (int i = 0; i < n; i++) {
        PyObject *d = PyObject_GetAttrString(type, names[i]);
        if (!d) return -1;
        if (!PyObject_TypeCheck(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            Py_DECREF(d);
            PyErr_Format(PyExc_TypeError, "%s is not a plain __slots__ slot", names[i]);
            return -1;
        }
        out[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
    }
    return 0;
}

static PyObject *py_setup(PyObject *self, PyObject *args) {
    PyObject *bt, *rt, *reset, *complete, *registered, *seed;
    if (!PyArg_ParseTuple(args, "O!O!OOOO", &PyType_Type, &bt, &PyType_Type, &rt, &reset,
                          &complete, &registered, &seed))
        return NULL;
    if (read_offsets(bt, block_slots, B_COUNT, boff) < 0) return NULL;
    if (read_offsets(rt, record_slots, R_COUNT, roff) < 0) return NULL;
    Py_XSETREF(block_type, (PyTypeObject *)Py_NewRef(bt));
    Py_XSETREF(record_type, (PyTypeObject *)Py_NewRef(rt));
    Py_XSETREF(v_reset, Py_NewRef(reset));
    Py_XSETREF(v_complete, Py_NewRef(complete));
    Py_XSETREF(v_registered, Py_NewRef(registered));
    Py_XSETREF(v_seed, Py_NewRef(seed));
    if (!v_zero) v_zero = PyLong_FromLong(0);
    if (!v_minus1) v_minus1 = PyLong_FromLong(-1);
    if (!v_zero || !v_minus1) return NULL;
    Py_RETURN_NONE;
}

static int check_blocks(PyObject *blocks) {
    if (!block_type) {
        PyErr_SetString(PyExc_RuntimeError, "_blockops.setup() was not called");
        return -1;
    }
    if (!PyList_CheckExact(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a list");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (!PyObject_TypeCheck(b, block_type)) {
            PyErr_Format(PyExc_TypeError, "not a Block: %R", b);
            return -1;
        }
        for (int k = 0; k < B_COUNT; k++)          /* every slot set (a Block's always are) */
            if (!SLOT(b, boff[k])) {
                PyErr_Format(PyExc_AttributeError, "Block slot %s is unset", block_slots[k]);
                return -1;
            }
    }
    return 0;
}

static PyObject *py_reset(PyObject *self, PyObject *args) {
    PyObject *blocks, *ref_count;
    int plain;
    if (!PyArg_ParseTuple(args, "OOp", &blocks, &ref_count, &plain)) return NULL;
    if (check_blocks(blocks) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        Py_INCREF(b);                              /* a decref below cannot free it */
        put(b, boff[B_REF_COUNT], ref_count);
        put(b, boff[B_STATE], v_reset);
        put(b, boff[B_TOKENS], Py_None);
        put(b, boff[B_SEED], v_seed);
        put(b, boff[B_PARENT_HASH], Py_None);
        put(b, boff[B_LOCAL_HASH], Py_None);
        put(b, boff[B_SEQUENCE_HASH], Py_None);
        put(b, boff[B_PRIORITY], v_zero);
        if (!plain) {
            put(b, boff[B_PARENT_ID], v_minus1);
            put(b, boff[B_CHILDREN], v_zero);
        }
        put(b, boff[B_CACHED_RECORD], Py_None);
        if (!plain) put(b, boff[B_POLICY_STATE], v_zero);
        Py_DECREF(b);
    }
    Py_RETURN_NONE;
}

static PyObject *py_apply(PyObject *self, PyObject *args) {
    PyObject *blocks, *records, *size;
    if (!PyArg_ParseTuple(args, "OOO", &blocks, &records, &size)) return NULL;
    if (check_blocks(blocks) < 0) return NULL;
    if (!PyList_Check(records) && !PyTuple_Check(records)) return PyLong_FromLong(0);
    PyObject *fast = PySequence_Fast(records, "records");
    if (!fast) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks), m = PySequence_Fast_GET_SIZE(fast);
    if (m < n) n = m;
    Py_ssize_t done = 0;
    for (; done < n; done++) {
        PyObject *b = PyList_GET_ITEM(blocks, done);
        PyObject *r = PySequence_Fast_GET_ITEM(fast, done);
        if (!PyObject_TypeCheck(r, record_type)) break;      /* the Python path decides */
        if (SLOT(b, boff[B_STATE]) != v_reset) break;
        PyObject *bs = SLOT(r, roff[R_BLOCK_SIZE]);
        if (!bs) break;
        int ne = PyObject_RichCompareBool(bs, size, Py_NE);
        if (ne < 0) goto error;
        if (ne) break;
        PyObject *tokens = SLOT(r, roff[R_TOKEN_IDS]);
        PyObject *seq = SLOT(r, roff[R_SEQUENCE_HASH]), *loc = SLOT(r, roff[R_LOCAL_HASH]);
        PyObject *par = SLOT(r, roff[R_PARENT_HASH]);
        if (!tokens || !seq || !loc || !par) break;
        Py_INCREF(b);
        Py_INCREF(r);
        if (tokens != Py_None) {
            Py_ssize_t len = PyObject_Size(tokens);
            if (len < 0) { Py_DECREF(b); Py_DECREF(r); goto error; }
            PyObject *lenobj = PyLong_FromSsize_t(len);
            if (!lenobj) { Py_DECREF(b); Py_DECREF(r); goto error; }
            int differs = PyObject_RichCompareBool(lenobj, size, Py_NE);
            Py_DECREF(lenobj);
            if (differs < 0) { Py_DECREF(b); Py_DECREF(r); goto error; }
            if (differs) { Py_DECREF(b); Py_DECREF(r); break; }
            PyObject *list = PySequence_List(tokens);
            if (!list) { Py_DECREF(b); Py_DECREF(r); goto error; }
            PyObject *old = SLOT(b, boff[B_TOKENS]);
            SLOT(b, boff[B_TOKENS]) = list;
            Py_XDECREF(old);
        }
        put(b, boff[B_STATE], v_complete);
        put(b, boff[B_SEQUENCE_HASH], seq);
        put(b, boff[B_LOCAL_HASH], loc);
        put(b, boff[B_PARENT_HASH], par);
        put(b, boff[B_CACHED_RECORD], r);
        Py_DECREF(r);
        Py_DECREF(b);
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(done);
error:
    Py_DECREF(fast);
    return NULL;
}

static PyObject *py_release(PyObject *self, PyObject *args) {
    PyObject *blocks;
    long long tick;
    if (!PyArg_ParseTuple(args, "OL", &blocks, &tick)) return NULL;
    if (check_blocks(blocks) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {     /* plain ints only; else the Python path */
        PyObject *refs = SLOT(PyList_GET_ITEM(blocks, i), boff[B_REF_COUNT]);
        if (!PyLong_CheckExact(refs)) Py_RETURN_NONE;
    }
    PyObject *idle = PyList_New(0);
    if (!idle) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        long long refs = PyLong_AsLongLong(SLOT(b, boff[B_REF_COUNT])) - 1;
        if (refs == -2 && PyErr_Occurred()) goto error;
        PyObject *r = PyLong_FromLongLong(refs);
        if (!r) goto error;
        PyObject *old = SLOT(b, boff[B_REF_COUNT]);
        SLOT(b, boff[B_REF_COUNT]) = r;
        Py_XDECREF(old);
        if (refs == 0) {
            PyObject *t = PyLong_FromLongLong(++tick);
            if (!t) goto error;
            old = SLOT(b, boff[B_RELEASE_TICK]);
            SLOT(b, boff[B_RELEASE_TICK]) = t;
            Py_XDECREF(old);
            if (PyList_Append(idle, b) < 0) goto error;
        } else if (refs < 0) {
            PyObject *id = PyObject_GetAttrString(b, "block_id");
            if (id) {
                PyErr_Format(PyExc_AssertionError, "block %S released more than acquired", id);
                Py_DECREF(id);
            }
            goto error;
        }
    }
    PyObject *out = Py_BuildValue("(LN)", tick, idle);
    return out;
error:
    Py_DECREF(idle);
    return NULL;
}

static PyObject *py_mark(PyObject *self, PyObject *args) {
    PyObject *blocks, *state;
    if (!PyArg_ParseTuple(args, "OO", &blocks, &state)) return NULL;
    if (check_blocks(blocks) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) put(PyList_GET_ITEM(blocks, i), boff[B_STATE], state);
    Py_RETURN_NONE;
}

/* register_new(blocks, by_hash, tiers, bit) -> (records, tiers_done) or None.
 * The bulk registration of blocks none of whose hashes is in by_hash, none twice, each
 * Complete with its record at hand: by_hash[h] = block and state = REGISTERED, in order;
 * if tiers is a dict holding none of the hashes, also tiers[h] = bit (tiers_done True).
 * Returns the records. Anything else returns None having changed nothing (the Python path
 * then does it, or raises). */
static PyObject *py_register_new(PyObject *self, PyObject *args) {
    PyObject *blocks, *by_hash, *tiers, *bit;
    if (!PyArg_ParseTuple(args, "OO!OO", &blocks, &PyDict_Type, &by_hash, &tiers, &bit)) return NULL;
    if (check_blocks(blocks) < 0) return NULL;
    int tiers_new = PyDict_Check(tiers);
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    PyObject *records = PyList_New(n);
    if (!records) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        PyObject *rec = SLOT(b, boff[B_CACHED_RECORD]);
        PyObject *h = SLOT(b, boff[B_SEQUENCE_HASH]);
        if (SLOT(b, boff[B_STATE]) != v_complete || rec == Py_None || !PyLong_CheckExact(h))
            goto fallback;
        int in = PyDict_Contains(by_hash, h);
        if (in < 0) goto error;
        if (in) goto fallback;
        if (tiers_new) {
            in = PyDict_Contains(tiers, h);
            if (in < 0) goto error;
            if (in) tiers_new = 0;
        }
        PyList_SET_ITEM(records, i, Py_NewRef(rec));
    }
    Py_ssize_t size = PyDict_GET_SIZE(by_hash);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (PyDict_SetItem(by_hash, SLOT(b, boff[B_SEQUENCE_HASH]), b) < 0) goto error;
    }
    if (PyDict_GET_SIZE(by_hash) != size + n) {        /* a hash twice in the batch: undo */
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyDict_DelItem(by_hash, SLOT(PyList_GET_ITEM(blocks, i), boff[B_SEQUENCE_HASH])) < 0)
                PyErr_Clear();                         /* the second time of a repeated hash */
        goto fallback;
    }
    if (tiers_new)
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyDict_SetItem(tiers, SLOT(PyList_GET_ITEM(blocks, i), boff[B_SEQUENCE_HASH]), bit) < 0)
                goto error;
    for (Py_ssize_t i = 0; i < n; i++) put(PyList_GET_ITEM(blocks, i), boff[B_STATE], v_registered);
    return Py_BuildValue("(NO)", records, tiers_new ? Py_True : Py_False);
fallback:
    Py_DECREF(records);
    Py_RETURN_NONE;
error:
    Py_DECREF(records);
    return NULL;
}

static PyMethodDef methods[] = {
    {"setup", py_setup, METH_VARARGS, "setup(Block, BlockRecord, RESET, COMPLETE, REGISTERED, seed)"},
    {"reset", py_reset, METH_VARARGS, "reset(blocks, ref_count, plain)"},
    {"apply", py_apply, METH_VARARGS, "apply(blocks, records, size) -> applied"},
    {"release", py_release, METH_VARARGS, "release(blocks, tick) -> (tick, idle) or None"},
    {"mark", py_mark, METH_VARARGS, "mark(blocks, state)"},
    {"register_new", py_register_new, METH_VARARGS, "register_new(blocks, by_hash, tiers, bit) -> (records, tiers_done) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockops",
    "Native loops over pool blocks; see kvstrata/logical/blockops.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockops(void) { return PyModule_Create(&module); }
