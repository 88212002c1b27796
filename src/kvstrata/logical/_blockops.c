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
 * register_new(blocks, by_hash, tiers, bit, remove) -> (records, tiers_done) or None: below
 * lfu_insert(...), lfu_victims(...)  the aged-LFU order's insert_many and victims, below
 * recent_victims(...), recent_prune(...)  the adaptive order's recency queue, below
 * lru_shadow_serve(...), lfu_shadow_serve(...)  the duel's shadow caches serving a request
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

enum { B_STATE, B_TOKENS, B_SEED, B_PARENT_HASH, B_LOCAL_HASH, B_SEQUENCE_HASH, B_PRIORITY,
       B_REF_COUNT, B_RELEASE_TICK, B_PARENT_ID, B_CHILDREN, B_CACHED_RECORD, B_POLICY_STATE,
       B_BLOCK_ID, B_COUNT };
static const char *block_slots[B_COUNT] = {
    "state", "tokens", "seed", "parent_hash", "local_hash", "sequence_hash", "priority",
    "ref_count", "release_tick", "parent_id", "children", "cached_record", "policy_state",
    "block_id"};
enum { R_SEQUENCE_HASH, R_LOCAL_HASH, R_PARENT_HASH, R_BLOCK_SIZE, R_TOKEN_IDS, R_COUNT };
static const char *record_slots[R_COUNT] = {
    "sequence_hash", "local_hash", "parent_hash", "block_size", "token_ids"};

static Py_ssize_t boff[B_COUNT], roff[R_COUNT];
static PyTypeObject *block_type = NULL, *record_type = NULL;
static PyObject *v_reset = NULL, *v_complete = NULL, *v_registered = NULL, *v_seed = NULL;
static PyObject *v_zero = NULL, *v_minus1 = NULL;
static PyObject *s_popitem = NULL, *s_move_to_end = NULL;   /* interned method names */

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
    if (!s_popitem) s_popitem = PyUnicode_InternFromString("popitem");
    if (!s_move_to_end) s_move_to_end = PyUnicode_InternFromString("move_to_end");
    if (!v_zero || !v_minus1 || !s_popitem || !s_move_to_end) return NULL;
    Py_RETURN_NONE;
}

#define BIT(k) (1u << (k))

/* blocks is a list of Blocks whose slots named in read (BIT(B_...) | ...) are set: those the
 * caller reads; the others it only overwrites (put() takes an unset slot). A Block's slots
 * are all set unless deleted. */
/* 0 once setup() has learned the Block class, else -1 with RuntimeError. */
static int require_setup(void) {
    if (block_type) return 0;
    PyErr_SetString(PyExc_RuntimeError, "_blockops.setup() was not called");
    return -1;
}

static int check_blocks(PyObject *blocks, unsigned read) {
    if (require_setup() < 0) return -1;
    if (!PyList_CheckExact(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a list");
        return -1;
    }
    int slots[B_COUNT], m = 0;
    for (int k = 0; k < B_COUNT; k++)
        if (read & BIT(k)) slots[m++] = k;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (!PyObject_TypeCheck(b, block_type)) {
            PyErr_Format(PyExc_TypeError, "not a Block: %R", b);
            return -1;
        }
        for (int j = 0; j < m; j++)
            if (!SLOT(b, boff[slots[j]])) {
                PyErr_Format(PyExc_AttributeError, "Block slot %s is unset", block_slots[slots[j]]);
                return -1;
            }
    }
    return 0;
}

static PyObject *py_reset(PyObject *self, PyObject *args) {
    PyObject *blocks, *ref_count;
    int plain;
    if (!PyArg_ParseTuple(args, "OOp", &blocks, &ref_count, &plain)) return NULL;
    if (check_blocks(blocks, 0) < 0) return NULL;
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
    if (check_blocks(blocks, 0) < 0) return NULL;
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
    if (check_blocks(blocks, BIT(B_REF_COUNT)) < 0) return NULL;
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
    if (check_blocks(blocks, 0) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) put(PyList_GET_ITEM(blocks, i), boff[B_STATE], state);
    Py_RETURN_NONE;
}

/* register_new(blocks, by_hash, tiers, bit, remove) -> (records, tiers_done) or None.
 * The bulk registration of blocks none of whose hashes is in by_hash, none twice, each
 * Complete with its record at hand: by_hash[h] = block and state = REGISTERED, in order;
 * if remove is not None (a leaf-first pool), each block is also linked to its parent held
 * here (parent_id, the parent's children + 1, remove(parent) when that made an idle leaf a
 * parent), as Python's _link_parent. If tiers is a dict holding none of the hashes, also
 * tiers[h] = bit (tiers_done True). Returns the records. Anything else returns None having
 * changed nothing (the Python path then does it, or raises). */
static PyObject *py_register_new(PyObject *self, PyObject *args) {
    PyObject *blocks, *by_hash, *tiers, *bit, *remove;
    if (!PyArg_ParseTuple(args, "OO!OOO", &blocks, &PyDict_Type, &by_hash, &tiers, &bit, &remove))
        return NULL;
    if (check_blocks(blocks, BIT(B_STATE) | BIT(B_CACHED_RECORD) | BIT(B_SEQUENCE_HASH) |
                             BIT(B_PARENT_HASH)) < 0)
        return NULL;
    int tiers_new = PyDict_Check(tiers);
    int link = remove != Py_None;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    PyObject *records = PyList_New(n);
    if (!records) return NULL;
    PyObject *seen = NULL;
    if (link && !(seen = PySet_New(NULL))) goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        PyObject *rec = SLOT(b, boff[B_CACHED_RECORD]);
        PyObject *h = SLOT(b, boff[B_SEQUENCE_HASH]);
        if (SLOT(b, boff[B_STATE]) != v_complete || rec == Py_None || !PyLong_CheckExact(h))
            goto fallback;
        int in = PyDict_Contains(by_hash, h);
        if (in < 0) goto error;
        if (in) goto fallback;
        if (link) {                                /* links need the check before any change */
            in = PySet_Contains(seen, h);
            if (in < 0) goto error;
            if (in) goto fallback;
            if (PySet_Add(seen, h) < 0) goto error;
        }
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
        if (!link) continue;
        put(b, boff[B_STATE], v_registered);
        PyObject *ph = SLOT(b, boff[B_PARENT_HASH]);
        if (ph == Py_None) continue;
        PyObject *parent = PyDict_GetItemWithError(by_hash, ph);          /* borrowed */
        if (!parent) {
            if (PyErr_Occurred()) goto error;
            continue;
        }
        if (parent == b) continue;                 /* a block never is its own prefix */
        if (!PyObject_TypeCheck(parent, block_type)) {
            PyErr_SetString(PyExc_TypeError, "the index holds a non-Block");
            goto error;
        }
        Py_INCREF(parent);
        put(b, boff[B_PARENT_ID], SLOT(parent, boff[B_BLOCK_ID]));
        long children = PyLong_AsLong(SLOT(parent, boff[B_CHILDREN]));
        long refs = PyLong_AsLong(SLOT(parent, boff[B_REF_COUNT]));
        if ((children == -1 || refs == -1) && PyErr_Occurred()) { Py_DECREF(parent); goto error; }
        PyObject *c = PyLong_FromLong(children + 1);
        if (!c) { Py_DECREF(parent); goto error; }
        PyObject *old = SLOT(parent, boff[B_CHILDREN]);
        SLOT(parent, boff[B_CHILDREN]) = c;
        Py_XDECREF(old);
        if (children + 1 == 1 && refs == 0) {
            PyObject *r = PyObject_CallOneArg(remove, parent);
            if (!r) { Py_DECREF(parent); goto error; }
            Py_DECREF(r);
        }
        Py_DECREF(parent);
    }
    if (!link && PyDict_GET_SIZE(by_hash) != size + n) {   /* a hash twice in the batch: undo */
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyDict_DelItem(by_hash, SLOT(PyList_GET_ITEM(blocks, i), boff[B_SEQUENCE_HASH])) < 0)
                PyErr_Clear();                         /* the second time of a repeated hash */
        goto fallback;
    }
    if (tiers_new)
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyDict_SetItem(tiers, SLOT(PyList_GET_ITEM(blocks, i), boff[B_SEQUENCE_HASH]), bit) < 0)
                goto error;
    if (!link)
        for (Py_ssize_t i = 0; i < n; i++) put(PyList_GET_ITEM(blocks, i), boff[B_STATE], v_registered);
    Py_XDECREF(seen);
    return Py_BuildValue("(NO)", records, tiers_new ? Py_True : Py_False);
fallback:
    Py_XDECREF(seen);
    Py_DECREF(records);
    Py_RETURN_NONE;
error:
    Py_XDECREF(seen);
    Py_DECREF(records);
    return NULL;
}

/* lfu_insert(blocks, key_of, buckets, keys, age, last_tick, bucket_type, heappush[, queue])
 *   -> the new last tick, or None having changed nothing.
 * AgedFrequencyEviction.insert_many when no block is in the order yet and their release
 * ticks are increasing and newer than last_tick (the common case): each block goes at the
 * end of the bucket of key age + policy_state (made, and its key pushed on the heap, if
 * new), key_of[block_id] = key. With queue (a list: adaptive.DuelingEviction's recency
 * queue), each block's release tick and the block are appended to it too. */
static PyObject *py_lfu_insert(PyObject *self, PyObject *args) {
    PyObject *blocks, *key_of, *buckets, *keys, *age, *last, *bucket_type, *heappush;
    PyObject *queue = Py_None;
    if (!PyArg_ParseTuple(args, "OO!O!O!OOOO|O", &blocks, &PyDict_Type, &key_of, &PyDict_Type,
                          &buckets, &PyList_Type, &keys, &age, &last, &bucket_type, &heappush,
                          &queue))
        return NULL;
    if (queue != Py_None && !PyList_Check(queue)) {
        PyErr_SetString(PyExc_TypeError, "queue must be a list or None");
        return NULL;
    }
    if (check_blocks(blocks, BIT(B_BLOCK_ID) | BIT(B_RELEASE_TICK) | BIT(B_POLICY_STATE)) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    PyObject *prev = last;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        int in = PyDict_Contains(key_of, SLOT(b, boff[B_BLOCK_ID]));
        if (in < 0) return NULL;
        if (in) Py_RETURN_NONE;
        PyObject *tick = SLOT(b, boff[B_RELEASE_TICK]);
        if (!PyLong_CheckExact(tick)) Py_RETURN_NONE;
        int gt = PyObject_RichCompareBool(tick, prev, Py_GT);
        if (gt < 0) return NULL;
        if (!gt) Py_RETURN_NONE;
        prev = tick;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        PyObject *key = PyNumber_Add(age, SLOT(b, boff[B_POLICY_STATE]));
        if (!key) return NULL;
        PyObject *bucket = PyDict_GetItemWithError(buckets, key);     /* borrowed */
        if (!bucket) {
            if (PyErr_Occurred()) { Py_DECREF(key); return NULL; }
            bucket = PyObject_CallNoArgs(bucket_type);
            if (!bucket) { Py_DECREF(key); return NULL; }
            int bad = PyDict_SetItem(buckets, key, bucket);
            Py_DECREF(bucket);
            if (bad < 0) { Py_DECREF(key); return NULL; }
            PyObject *r = PyObject_CallFunctionObjArgs(heappush, keys, key, NULL);
            if (!r) { Py_DECREF(key); return NULL; }
            Py_DECREF(r);
        }
        PyObject *id = SLOT(b, boff[B_BLOCK_ID]);
        if (PyObject_SetItem(bucket, id, b) < 0 || PyDict_SetItem(key_of, id, key) < 0) {
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(key);
        if (queue != Py_None && (PyList_Append(queue, SLOT(b, boff[B_RELEASE_TICK])) < 0 ||
                                 PyList_Append(queue, b) < 0))
            return NULL;
    }
    return Py_NewRef(prev);
}

/* ghost[h] = count, h moved last (an ordered dict: a new key goes last); the oldest entry
 * dropped beyond ghost_size. AgedFrequencyEviction.remember's stores. */
static int ghost_remember(PyObject *ghost, PyObject *h, PyObject *count, Py_ssize_t ghost_size) {
    if (!h || !count) {                        /* a Block slot deleted since it was checked */
        PyErr_SetString(PyExc_AttributeError, "Block slot sequence_hash or policy_state is unset");
        return -1;
    }
    int known = PyDict_Contains(ghost, h);
    if (known < 0 || PyObject_SetItem(ghost, h, count) < 0) return -1;
    PyObject *r;
    if (known) {
        if (!(r = PyObject_CallMethodOneArg(ghost, s_move_to_end, h))) return -1;
        Py_DECREF(r);
    }
    if (PyDict_GET_SIZE(ghost) > ghost_size) {
        if (!(r = PyObject_CallMethodOneArg(ghost, s_popitem, Py_False))) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* lfu_victims(count, keys, buckets, key_of, ghost, ghost_size, heappop) -> (victims, key)
 * AgedFrequencyEviction.victims: up to count blocks, lowest key first and oldest in its
 * bucket; each leaves key_of and its count goes to the ghost (newest last; the oldest
 * dropped beyond ghost_size). key is the last victim's (None if there was none). */
static PyObject *py_lfu_victims(PyObject *self, PyObject *args) {
    Py_ssize_t count, ghost_size;
    PyObject *keys, *buckets, *key_of, *ghost, *heappop;
    if (!PyArg_ParseTuple(args, "nO!O!O!O!nO", &count, &PyList_Type, &keys, &PyDict_Type, &buckets,
                          &PyDict_Type, &key_of, &PyDict_Type, &ghost, &ghost_size, &heappop))
        return NULL;
    if (require_setup() < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    PyObject *last_key = Py_NewRef(Py_None);
    while (PyList_GET_SIZE(out) < count && PyList_GET_SIZE(keys) > 0) {
        PyObject *key = PyList_GET_ITEM(keys, 0);
        PyObject *bucket = PyDict_GetItemWithError(buckets, key);
        if (!bucket) {
            if (PyErr_Occurred()) goto error;
            PyObject *r = PyObject_CallOneArg(heappop, keys);                   /* stale key */
            if (!r) goto error;
            Py_DECREF(r);
            continue;
        }
        Py_INCREF(key);
        Py_INCREF(bucket);
        PyObject *item = PyObject_CallMethodOneArg(bucket, s_popitem, Py_False);
        if (!item) { Py_DECREF(key); Py_DECREF(bucket); goto error; }
        Py_ssize_t left = PyObject_Length(bucket);
        Py_DECREF(bucket);
        if (left < 0) { Py_DECREF(item); Py_DECREF(key); goto error; }
        if (left == 0) {
            if (PyDict_DelItem(buckets, key) < 0) { Py_DECREF(item); Py_DECREF(key); goto error; }
            PyObject *r = PyObject_CallOneArg(heappop, keys);
            if (!r) { Py_DECREF(item); Py_DECREF(key); goto error; }
            Py_DECREF(r);
        }
        PyObject *id = PyTuple_GET_ITEM(item, 0), *b = PyTuple_GET_ITEM(item, 1);
        if (!PyObject_TypeCheck(b, block_type) || PyDict_DelItem(key_of, id) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "lfu bucket holds a non-Block");
            Py_DECREF(item); Py_DECREF(key); goto error;
        }
        Py_SETREF(last_key, key);
        if (ghost_remember(ghost, SLOT(b, boff[B_SEQUENCE_HASH]), SLOT(b, boff[B_POLICY_STATE]),
                           ghost_size) < 0 || PyList_Append(out, b) < 0) {
            Py_DECREF(item);
            goto error;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("(NN)", out, last_key);
error:
    Py_DECREF(out);
    Py_DECREF(last_key);
    return NULL;
}

/* The pair queue[i], queue[i + 1] (a tick, a block) of adaptive.DuelingEviction's recency
 * queue is live if the block is in the order (key_of) at that release tick: 1 live, 0 stale,
 * -1 error. *key gets the block's key (borrowed) when live. */
static int recent_live(PyObject *queue, Py_ssize_t i, PyObject *key_of, PyObject **key) {
    PyObject *tick = PyList_GET_ITEM(queue, i), *b = PyList_GET_ITEM(queue, i + 1);
    if (!PyObject_TypeCheck(b, block_type)) {
        PyErr_SetString(PyExc_TypeError, "the recency queue holds a non-Block");
        return -1;
    }
    PyObject *t = SLOT(b, boff[B_RELEASE_TICK]), *id = SLOT(b, boff[B_BLOCK_ID]);
    if (!t || !id) {
        PyErr_SetString(PyExc_AttributeError, "Block slot release_tick or block_id is unset");
        return -1;
    }
    if (t != tick) {
        int eq = PyObject_RichCompareBool(t, tick, Py_EQ);
        if (eq <= 0) return eq;
    }
    *key = PyDict_GetItemWithError(key_of, id);
    return *key ? 1 : (PyErr_Occurred() ? -1 : 0);
}

/* recent_victims(count, queue, head, key_of, buckets, ghost, ghost_size) -> (victims, head)
 * adaptive.DuelingEviction._recent_victims: up to count blocks of the live pairs of queue
 * from head on, oldest first; each leaves the aged-LFU order (key_of, its bucket, emptied
 * buckets deleted) and its count goes to the ghost, as remove and remember. head: the index
 * after the last pair consumed. */
static PyObject *py_recent_victims(PyObject *self, PyObject *args) {
    Py_ssize_t count, head, ghost_size;
    PyObject *queue, *key_of, *buckets, *ghost;
    if (!PyArg_ParseTuple(args, "nO!nO!O!O!n", &count, &PyList_Type, &queue, &head, &PyDict_Type,
                          &key_of, &PyDict_Type, &buckets, &PyDict_Type, &ghost, &ghost_size))
        return NULL;
    if (require_setup() < 0) return NULL;
    if (head < 0) head = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    while (PyList_GET_SIZE(out) < count && head + 1 < PyList_GET_SIZE(queue)) {
        PyObject *key = NULL;
        int live = recent_live(queue, head, key_of, &key);
        PyObject *b = PyList_GET_ITEM(queue, head + 1);
        head += 2;
        if (live < 0) goto error;
        if (!live) continue;
        PyObject *id = SLOT(b, boff[B_BLOCK_ID]);
        Py_INCREF(b);
        Py_INCREF(key);
        PyObject *bucket = PyDict_GetItemWithError(buckets, key);
        int bad = !bucket;
        if (bad && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        if (!bad) {
            Py_INCREF(bucket);
            Py_ssize_t left = -1;
            bad = PyObject_DelItem(bucket, id) < 0 || (left = PyObject_Length(bucket)) < 0 ||
                  (left == 0 && PyDict_DelItem(buckets, key) < 0);
            Py_DECREF(bucket);
        }
        bad = bad || PyDict_DelItem(key_of, id) < 0 ||
              ghost_remember(ghost, SLOT(b, boff[B_SEQUENCE_HASH]), SLOT(b, boff[B_POLICY_STATE]),
                             ghost_size) < 0 ||
              PyList_Append(out, b) < 0;
        Py_DECREF(key);
        Py_DECREF(b);
        if (bad) goto error;
    }
    return Py_BuildValue("(Nn)", out, head);
error:
    Py_DECREF(out);
    return NULL;
}

/* recent_prune(queue, head, key_of) -> list: the live pairs of queue from head on, in order
 * (adaptive.DuelingEviction._live_pairs). */
static PyObject *py_recent_prune(PyObject *self, PyObject *args) {
    Py_ssize_t head;
    PyObject *queue, *key_of;
    if (!PyArg_ParseTuple(args, "O!nO!", &PyList_Type, &queue, &head, &PyDict_Type, &key_of))
        return NULL;
    if (require_setup() < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = head < 0 ? 0 : head; i + 1 < PyList_GET_SIZE(queue); i += 2) {
        PyObject *key;
        int live = recent_live(queue, i, key_of, &key);
        if (live < 0 || (live && (PyList_Append(out, PyList_GET_ITEM(queue, i)) < 0 ||
                                  PyList_Append(out, PyList_GET_ITEM(queue, i + 1)) < 0))) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* lru_shadow_serve(hashes, stamp, queue, head, clock, capacity, admit) -> (hits, clock, head)
 * adaptive._LruShadow._serve (see there) over its dict and queue: hits of the longest held
 * prefix, then each hash held or admitted (admit None: everything) stamped with the next
 * clock value, stamp[h] = clock, and "clock, h" appended to the queue, the least recently
 * used hash (the first pair still carrying its hash's stamp) evicted when full. Then, if the
 * queue holds over twice the cache, it is cut to its live pairs in place (head 0). */
static PyObject *py_lru_shadow_serve(PyObject *self, PyObject *args) {
    PyObject *hashes, *stamp, *queue, *admit;
    Py_ssize_t head, capacity;
    long long clock;
    if (!PyArg_ParseTuple(args, "O!O!O!nLnO", &PyList_Type, &hashes, &PyDict_Type, &stamp,
                          &PyList_Type, &queue, &head, &clock, &capacity, &admit))
        return NULL;
    if (head < 0) head = 0;
    Py_ssize_t hits = 0;
    for (; hits < PyList_GET_SIZE(hashes); hits++) {
        int in = PyDict_Contains(stamp, PyList_GET_ITEM(hashes, hits));
        if (in < 0) return NULL;
        if (!in) break;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++) {
        PyObject *h = Py_NewRef(PyList_GET_ITEM(hashes, i));
        int in = PyDict_Contains(stamp, h);
        if (in < 0) goto fail;
        if (!in && admit != Py_None) {
            PyObject *r = PyObject_CallOneArg(admit, h);
            int yes = r ? PyObject_IsTrue(r) : -1;
            Py_XDECREF(r);
            if (yes < 0) goto fail;
            if (!yes) { Py_DECREF(h); continue; }
        }
        if (!in && PyDict_GET_SIZE(stamp) >= capacity) {          /* evict */
            for (;;) {
                if (head + 1 >= PyList_GET_SIZE(queue)) {
                    PyErr_SetString(PyExc_RuntimeError, "LRU shadow queue ran dry");
                    goto fail;
                }
                PyObject *s = PyList_GET_ITEM(queue, head), *old = PyList_GET_ITEM(queue, head + 1);
                head += 2;
                PyObject *cur = PyDict_GetItemWithError(stamp, old);
                if (!cur) {
                    if (PyErr_Occurred()) goto fail;
                    continue;
                }
                int eq = cur == s ? 1 : PyObject_RichCompareBool(cur, s, Py_EQ);
                if (eq < 0) goto fail;
                if (eq) {
                    if (PyDict_DelItem(stamp, old) < 0) goto fail;      /* the queue holds old */
                    break;
                }
            }
        }
        PyObject *t = PyLong_FromLongLong(++clock);
        int bad = !t || PyDict_SetItem(stamp, h, t) < 0 || PyList_Append(queue, t) < 0 ||
                  PyList_Append(queue, h) < 0;
        Py_XDECREF(t);
        Py_DECREF(h);
        if (bad) return NULL;
        continue;
    fail:
        Py_DECREF(h);
        return NULL;
    }
    if (PyList_GET_SIZE(queue) > 4 * PyDict_GET_SIZE(stamp) + 128) {
        PyObject *live = PyList_New(0);
        if (!live) return NULL;
        for (Py_ssize_t i = head; i + 1 < PyList_GET_SIZE(queue); i += 2) {
            PyObject *s = PyList_GET_ITEM(queue, i), *h = PyList_GET_ITEM(queue, i + 1);
            PyObject *cur = PyDict_GetItemWithError(stamp, h);
            int eq = cur ? (cur == s ? 1 : PyObject_RichCompareBool(cur, s, Py_EQ))
                         : (PyErr_Occurred() ? -1 : 0);
            if (eq < 0 || (eq && (PyList_Append(live, s) < 0 || PyList_Append(live, h) < 0))) {
                Py_DECREF(live);
                return NULL;
            }
        }
        int bad = PyList_SetSlice(queue, 0, PyList_GET_SIZE(queue), live);
        Py_DECREF(live);
        if (bad < 0) return NULL;
        head = 0;
    }
    return Py_BuildValue("(nLn)", hits, clock, head);
}

/* lfu_shadow_serve(hashes, count, key_of, buckets, keys, age, ghost, ghost_size, capacity,
 *                  admit, bucket_type, heappush, heappop) -> (hits, age)
 * adaptive._LfuShadow.serve (see there) over its own dicts: hits of the longest held prefix,
 * then each hash touched or, if admitted (admit None: everything), inserted, evicting the
 * lowest key (oldest in its bucket) when full. */
static PyObject *py_lfu_shadow_serve(PyObject *self, PyObject *args) {
    PyObject *hashes, *count, *key_of, *buckets, *keys, *age, *ghost, *admit, *bucket_type;
    PyObject *heappush, *heappop;
    Py_ssize_t ghost_size, capacity;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OO!nnOOOO", &PyList_Type, &hashes, &PyDict_Type, &count,
                          &PyDict_Type, &key_of, &PyDict_Type, &buckets, &PyList_Type, &keys, &age,
                          &PyDict_Type, &ghost, &ghost_size, &capacity, &admit, &bucket_type,
                          &heappush, &heappop))
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    if (!one) return NULL;
    Py_INCREF(age);
    Py_ssize_t n = PyList_GET_SIZE(hashes), hits = 0;
    for (; hits < n; hits++) {
        int in = PyDict_Contains(count, PyList_GET_ITEM(hashes, hits));
        if (in < 0) goto error;
        if (!in) break;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        Py_INCREF(h);
        PyObject *f = NULL;
        PyObject *cur = PyDict_GetItemWithError(count, h);
        if (cur) {                                          /* touch */
            f = PyNumber_Add(cur, one);
            if (!f || PyDict_SetItem(count, h, f) < 0) goto fail;
            PyObject *old = PyDict_GetItemWithError(key_of, h);
            if (!old) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, h); goto fail; }
            Py_INCREF(old);
            PyObject *bucket = PyDict_GetItemWithError(buckets, old);
            if (!bucket) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, old); Py_DECREF(old); goto fail; }
            if (PyObject_DelItem(bucket, h) < 0) { Py_DECREF(old); goto fail; }
            if (PyObject_Length(bucket) == 0 && PyDict_DelItem(buckets, old) < 0) { Py_DECREF(old); goto fail; }
            Py_DECREF(old);
        } else {
            if (PyErr_Occurred()) goto fail;
            if (admit != Py_None) {
                PyObject *r = PyObject_CallOneArg(admit, h);
                if (!r) goto fail;
                int yes = PyObject_IsTrue(r);
                Py_DECREF(r);
                if (yes < 0) goto fail;
                if (!yes) { Py_DECREF(h); continue; }
            }
            if (PyDict_GET_SIZE(count) >= capacity) {       /* evict */
                PyObject *low = NULL, *bucket = NULL;
                for (;;) {
                    if (PyList_GET_SIZE(keys) == 0) { PyErr_SetString(PyExc_IndexError, "empty key heap"); goto fail; }
                    low = PyList_GET_ITEM(keys, 0);
                    bucket = PyDict_GetItemWithError(buckets, low);
                    if (bucket && PyObject_Length(bucket) > 0) break;
                    if (PyErr_Occurred()) goto fail;
                    PyObject *r = PyObject_CallOneArg(heappop, keys);
                    if (!r) goto fail;
                    Py_DECREF(r);
                }
                Py_INCREF(low);
                Py_INCREF(bucket);
                PyObject *item = PyObject_CallMethodOneArg(bucket, s_popitem, Py_False);
                Py_ssize_t left = item ? PyObject_Length(bucket) : -1;
                Py_DECREF(bucket);
                if (!item || left < 0) { Py_XDECREF(item); Py_DECREF(low); goto fail; }
                if (left == 0) {
                    PyObject *r = NULL;
                    if (PyDict_DelItem(buckets, low) < 0 || !(r = PyObject_CallOneArg(heappop, keys))) {
                        Py_DECREF(item); Py_DECREF(low); goto fail;
                    }
                    Py_DECREF(r);
                }
                PyObject *victim = PyTuple_GET_ITEM(item, 0);
                Py_INCREF(victim);
                Py_DECREF(item);
                Py_SETREF(age, low);
                PyObject *vc = PyDict_GetItemWithError(count, victim);
                if (!vc) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, victim); Py_DECREF(victim); goto fail; }
                Py_INCREF(vc);
                int known = PyDict_Contains(ghost, victim);
                int bad = known < 0 || PyDict_DelItem(key_of, victim) < 0 || PyDict_DelItem(count, victim) < 0
                          || PyObject_SetItem(ghost, victim, vc) < 0;
                Py_DECREF(vc);
                if (!bad && known) {
                    PyObject *r = PyObject_CallMethodOneArg(ghost, s_move_to_end, victim);
                    if (!r) bad = 1; else Py_DECREF(r);
                }
                if (!bad && PyDict_GET_SIZE(ghost) > ghost_size) {
                    PyObject *r = PyObject_CallMethodOneArg(ghost, s_popitem, Py_False);
                    if (!r) bad = 1; else Py_DECREF(r);
                }
                Py_DECREF(victim);
                if (bad) goto fail;
            }
            PyObject *g = PyDict_GetItemWithError(ghost, h);      /* ghost.pop(h, 0) + 1 */
            if (g) {
                f = PyNumber_Add(g, one);
                if (!f || PyObject_DelItem(ghost, h) < 0) goto fail;
            } else {
                if (PyErr_Occurred()) goto fail;
                f = Py_NewRef(one);
            }
            if (PyDict_SetItem(count, h, f) < 0) goto fail;
        }
        {
            PyObject *key = PyNumber_Add(age, f);
            if (!key) goto fail;
            PyObject *bucket = PyDict_GetItemWithError(buckets, key);
            if (!bucket) {
                if (PyErr_Occurred()) { Py_DECREF(key); goto fail; }
                bucket = PyObject_CallNoArgs(bucket_type);
                if (!bucket) { Py_DECREF(key); goto fail; }
                int bad = PyDict_SetItem(buckets, key, bucket);
                Py_DECREF(bucket);
                PyObject *r = bad < 0 ? NULL : PyObject_CallFunctionObjArgs(heappush, keys, key, NULL);
                if (!r) { Py_DECREF(key); goto fail; }
                Py_DECREF(r);
            }
            if (PyObject_SetItem(bucket, h, Py_None) < 0 || PyDict_SetItem(key_of, h, key) < 0) {
                Py_DECREF(key);
                goto fail;
            }
            Py_DECREF(key);
        }
        Py_DECREF(f);
        Py_DECREF(h);
        continue;
    fail:
        Py_XDECREF(f);
        Py_DECREF(h);
        goto error;
    }
    Py_DECREF(one);
    return Py_BuildValue("(nN)", hits, age);
error:
    Py_DECREF(one);
    Py_DECREF(age);
    return NULL;
}

static PyMethodDef methods[] = {
    {"setup", py_setup, METH_VARARGS, "setup(Block, BlockRecord, RESET, COMPLETE, REGISTERED, seed)"},
    {"reset", py_reset, METH_VARARGS, "reset(blocks, ref_count, plain)"},
    {"apply", py_apply, METH_VARARGS, "apply(blocks, records, size) -> applied"},
    {"release", py_release, METH_VARARGS, "release(blocks, tick) -> (tick, idle) or None"},
    {"mark", py_mark, METH_VARARGS, "mark(blocks, state)"},
    {"lfu_insert", py_lfu_insert, METH_VARARGS, "lfu_insert(blocks, key_of, buckets, keys, age, last_tick, bucket_type, heappush[, queue])"},
    {"lfu_victims", py_lfu_victims, METH_VARARGS, "lfu_victims(count, keys, buckets, key_of, ghost, ghost_size, heappop)"},
    {"recent_victims", py_recent_victims, METH_VARARGS, "recent_victims(count, queue, head, key_of, buckets, ghost, ghost_size) -> (victims, head)"},
    {"recent_prune", py_recent_prune, METH_VARARGS, "recent_prune(queue, head, key_of) -> live pairs"},
    {"lru_shadow_serve", py_lru_shadow_serve, METH_VARARGS, "lru_shadow_serve(hashes, stamp, queue, head, clock, capacity, admit) -> (hits, clock, head)"},
    {"lfu_shadow_serve", py_lfu_shadow_serve, METH_VARARGS, "lfu_shadow_serve(hashes, count, key_of, buckets, keys, age, ghost, ghost_size, capacity, admit, bucket_type, heappush, heappop) -> (hits, age)"},
    {"register_new", py_register_new, METH_VARARGS, "register_new(blocks, by_hash, tiers, bit, remove) -> (records, tiers_done) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockops",
    "Native loops over pool blocks; see kvstrata/logical/blockops.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockops(void) { return PyModule_Create(&module); }
