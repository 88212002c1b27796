/* The adaptive policy's shadow caches in C (optional; kvstrata/logical/adaptive.py has the
 * pure-Python versions, which are the reference and the fallback: same hits, same state).
 *
 * lru_shadow_serve(...), lfu_shadow_serve(...)  the duel's shadow caches serving a request
 * recent_held_then_add(...)  predicted-reuse admission's "seen lately" table
 * reuse_admit_many(...)      its decisions over a batch of offered blocks
 *                            (kvstrata/logical/reuse_prediction.py has the Python version)
 *
 * (A pool's own loops over its slots are in _slots.c.)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_popitem = NULL, *s_move_to_end = NULL;   /* interned method names */

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

/* recent_held_then_add(hashes, fingerprints, stamps, sets, window, now, sample)
 *     -> (known, now, sampled)
 * reuse_prediction.RecentHashes._held_then_add in C (see there): for each hash in order,
 * mixed = splitmix64's finaliser of (hash mod 2**64), as reuse_prediction._mixed; its pairs
 * are the four of set (mixed >> 40) % sets and the four of set ((mixed >> 16) & 0xFFFFFF)
 * % sets; it is held if one of them has its fingerprint (mixed & 0xFFFF | 1) with a stamp
 * under ``window`` additions old; the first pair with its fingerprint, else the oldest of
 * the eight (an empty one first), takes it with the next stamp. ``known``: how many hashes,
 * from the first, were held; ``sampled``: the positions whose (mixed >> 20) % sample is 0.
 * The tables are uint16 / uint32 arrays of 4 x sets. */
static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static int table_ok(Py_buffer *b, Py_ssize_t itemsize, const char *formats, Py_ssize_t slots) {
    return b->itemsize == itemsize && b->format && b->format[0] && !b->format[1] &&
           strchr(formats, b->format[0]) && b->len == slots * itemsize;
}

static PyObject *py_recent_held_then_add(PyObject *self, PyObject *args) {
    PyObject *hashes, *fp_obj, *st_obj;
    Py_ssize_t sets;
    unsigned long long window, now, sample;
    if (!PyArg_ParseTuple(args, "OOOnKKK", &hashes, &fp_obj, &st_obj, &sets, &window, &now,
                          &sample))
        return NULL;
    if (sets <= 0 || sets > PY_SSIZE_T_MAX / 16 || window == 0 || window > (1ULL << 32) ||
        sample == 0) {
        PyErr_SetString(PyExc_ValueError, "recent_held_then_add: sets and sample must be "
                        "positive and window in 1..2**32");
        return NULL;
    }
    Py_buffer fpb, stb;
    if (PyObject_GetBuffer(fp_obj, &fpb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(st_obj, &stb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&fpb);
        return NULL;
    }
    PyObject *items = NULL, *result = NULL, *sampled = NULL;
    if (!table_ok(&fpb, 2, "H", sets * 4) || !table_ok(&stb, 4, "IL", sets * 4)) {
        PyErr_SetString(PyExc_ValueError, "recent_held_then_add: tables of 4 x sets "
                        "uint16 fingerprints and uint32 stamps expected");
        goto done;
    }
    items = PySequence_Tuple(hashes);      /* our own copy: an __index__ cannot change it */
    if (!items) goto done;
    sampled = PyList_New(0);
    if (!sampled) goto done;
    uint16_t *fps = (uint16_t *)fpb.buf;
    uint32_t *stamps = (uint32_t *)stb.buf;
    uint32_t clock = (uint32_t)now;
    Py_ssize_t n = PyTuple_GET_SIZE(items), known = 0;
    int counting = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long h = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(items, i));
        if (h == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        uint64_t mixed = mix64((uint64_t)h);
        if ((mixed >> 20) % sample == 0) {
            PyObject *at = PyLong_FromSsize_t(i);
            int bad = !at || PyList_Append(sampled, at) < 0;
            Py_XDECREF(at);
            if (bad) goto done;
        }
        uint16_t fp = (uint16_t)((mixed & 0xFFFF) | 1);
        uint64_t starts[2] = {(mixed >> 40) % (uint64_t)sets * 4,
                              ((mixed >> 16) & 0xFFFFFF) % (uint64_t)sets * 4};
        long long first = -1, oldest = -1;
        uint64_t oldest_age = 0;
        int held = 0;
        for (int k = 0; k < 2; k++) {
            for (uint64_t slot = starts[k]; slot < starts[k] + 4; slot++) {
                uint64_t age = fps[slot] ? (uint32_t)(clock - stamps[slot]) : (1ULL << 32);
                if (fps[slot] == fp) {
                    if (first < 0) first = (long long)slot;
                    if (age < window) held = 1;
                }
                if (oldest < 0 || age > oldest_age) {
                    oldest = (long long)slot;
                    oldest_age = age;
                }
            }
        }
        if (counting) {
            if (held) known++;
            else counting = 0;
        }
        clock += 1;
        uint64_t slot = (uint64_t)(first >= 0 ? first : oldest);
        fps[slot] = fp;
        stamps[slot] = clock;
    }
    result = Py_BuildValue("nKO", known, (unsigned long long)clock, sampled);
done:
    Py_XDECREF(sampled);
    Py_XDECREF(items);
    PyBuffer_Release(&fpb);
    PyBuffer_Release(&stb);
    return result;
}

/* d.pop(key, None): 1 and a new reference in *out if it was there, 0 if not, -1 on error. */
static int pop_item(PyObject *d, PyObject *key, PyObject **out) {
    *out = NULL;
    PyObject *value = PyDict_GetItemWithError(d, key);
    if (!value) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(value);
    if (PyDict_DelItem(d, key) < 0) {
        Py_DECREF(value);
        return -1;
    }
    *out = value;
    return 1;
}

/* reuse_admit_many(hashes, kinds, older, keep) -> (decisions, admitted, events)
 * reuse_prediction.PredictedReuseAdmission._admit_many's loop (see there): each hash's
 * packed kind is popped from ``kinds``, else ``older`` (dicts); none: admitted; else kind =
 * packed & 31, admitted if flagged returned (32), else if keep[kind] (a bytes of 0/1) and,
 * flagged after-new (64), keep[kind - 1]. ``decisions``: a list of bools; ``admitted``:
 * how many; ``events``: for each hash flagged sampled (128), (position, kind, returned,
 * admitted before it). */
static PyObject *py_reuse_admit_many(PyObject *self, PyObject *args) {
    PyObject *hashes, *kinds, *older;
    Py_buffer keep;
    if (!PyArg_ParseTuple(args, "OO!O!y*", &hashes, &PyDict_Type, &kinds, &PyDict_Type, &older,
                          &keep))
        return NULL;
    PyObject *items = PySequence_Tuple(hashes), *decisions = NULL, *events = NULL,
             *result = NULL;
    if (!items) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(items), admitted = 0;
    decisions = PyList_New(n);
    events = PyList_New(0);
    if (!decisions || !events) goto done;
    const unsigned char *keeps = (const unsigned char *)keep.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(items, i), *packed = NULL;
        if (pop_item(kinds, h, &packed) < 0) goto done;
        if (!packed && pop_item(older, h, &packed) < 0) goto done;
        int yes = 1;
        if (packed) {
            long bits = PyLong_AsLong(packed);
            Py_DECREF(packed);
            if (bits == -1 && PyErr_Occurred()) goto done;
            long kind = bits & 31;
            if (kind >= keep.len || (bits & 64 && kind < 1)) {
                PyErr_SetString(PyExc_ValueError, "reuse_admit_many: a kind out of range");
                goto done;
            }
            int returned = (bits & 32) != 0;
            if (!returned)
                yes = keeps[kind] && (!(bits & 64) || keeps[kind - 1]);
            if (bits & 128) {
                PyObject *ev = Py_BuildValue("nlin", i, kind, returned, admitted);
                int bad = !ev || PyList_Append(events, ev) < 0;
                Py_XDECREF(ev);
                if (bad) goto done;
            }
        }
        admitted += yes;
        PyList_SET_ITEM(decisions, i, Py_NewRef(yes ? Py_True : Py_False));
    }
    result = Py_BuildValue("OnO", decisions, admitted, events);
done:
    Py_XDECREF(items);
    Py_XDECREF(decisions);
    Py_XDECREF(events);
    PyBuffer_Release(&keep);
    return result;
}

static PyMethodDef methods[] = {
    {"lru_shadow_serve", py_lru_shadow_serve, METH_VARARGS, "lru_shadow_serve(hashes, stamp, queue, head, clock, capacity, admit) -> (hits, clock, head)"},
    {"lfu_shadow_serve", py_lfu_shadow_serve, METH_VARARGS, "lfu_shadow_serve(hashes, count, key_of, buckets, keys, age, ghost, ghost_size, capacity, admit, bucket_type, heappush, heappop) -> (hits, age)"},
    {"recent_held_then_add", py_recent_held_then_add, METH_VARARGS, "recent_held_then_add(hashes, fingerprints, stamps, sets, window, now, sample) -> (known, now, sampled)"},
    {"reuse_admit_many", py_reuse_admit_many, METH_VARARGS, "reuse_admit_many(hashes, kinds, older, keep) -> (decisions, admitted, events)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockops",
    "The adaptive policy's shadow caches in C; see kvstrata/logical/adaptive.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockops(void) {
    s_popitem = PyUnicode_InternFromString("popitem");
    s_move_to_end = PyUnicode_InternFromString("move_to_end");
    if (!s_popitem || !s_move_to_end) return NULL;
    return PyModule_Create(&module);
}
