/* Native observer hooks of kvstrata's EventPublisher (src/kvstrata/events/publisher.py).
 *
 *   stored(publisher, tier, records) -> bool
 *       EventPublisher.on_tier_stored for its common case: ``records`` (BlockRecords, exactly
 *       that type) form one parent-linked run of one block size, all new to the tier and
 *       without repeats, no longer than one event holds (EventPublisher.event_blocks; the
 *       Python code cuts a longer run into several events). Does what the Python code does
 *       for that case (shadow set, event id, timestamp, the stored item, the tier's log, the
 *       send buffer, the counters, waking the batching thread) and returns True; returns
 *       False having changed nothing otherwise (the caller then runs the Python code).
 *   removed(publisher, tier, hashes) -> bool
 *       EventPublisher.on_tier_removed, whole; False (nothing done) for a publisher of a
 *       class configure() was not given (e.g. after a reload of the module) and for more
 *       hashes than one event holds (``max_event_blocks``: the Python code splits them).
 *
 * Why: per event the Python hooks were a dozen attribute reads and writes, a lock, a clock
 * and a bounded-buffer check, each a bytecode round trip (~1.5-2 us); here they are one call.
 *
 * The state is the publisher's own: its ``__slots__`` (and _TierShadow's) are read and written
 * by offset, learned once by configure(); the Python code reads and writes the same slots, so
 * either path may run at any time. Both hooks hold the publisher's lock (acquired through its
 * ``acquire`` method, which releases the GIL while it waits) for exactly what the Python code
 * does under it, and call back into Python only where the Python code would do rare work
 * (notifying the condition, compacting the log inline).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* BlockRecord slots */
static Py_ssize_t r_seq, r_local, r_parent, r_size, r_tokens;
/* EventPublisher slots */
static Py_ssize_t p_lock, p_cond, p_buffer, p_tiers, p_ts, p_ts_text, p_last_id, p_done_id,
    p_first_pending_at, p_closing, p_enqueued, p_dropped, p_buffer_events, p_max_batch, p_keep_tokens,
    p_max_event_blocks, p_max_event_tokens;
/* _TierShadow slots */
static Py_ssize_t s_held, s_log, s_logged, s_limit;

static PyTypeObject *record_type, *publisher_type, *shadow_type;
static PyObject *stored_kind, *removed_kind, *no_parent;
static double ts_resolution;
static int configured = 0;

static PyObject *str_acquire, *str_release, *str_append, *str_notify, *str_compact, *str_time, *str_monotonic;
static PyObject *time_module;

static int slot_offset(PyTypeObject *tp, const char *name, Py_ssize_t *off) {
    PyObject *d = PyObject_GetAttrString((PyObject *)tp, name);
    if (!d) return -1;
    if (Py_TYPE(d) != &PyMemberDescr_Type) {
        Py_DECREF(d);
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", tp->tp_name, name);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    int ok = (m->type == T_OBJECT_EX || m->type == T_OBJECT) && ((PyMemberDescrObject *)d)->d_common.d_type == tp;
    Py_DECREF(d);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot of that class", tp->tp_name, name);
        return -1;
    }
    *off = m->offset;
    return 0;
}

typedef struct { const char *name; Py_ssize_t *off; } SlotName;

static int learn(PyTypeObject *tp, const SlotName *names) {
    for (; names->name; names++)
        if (slot_offset(tp, names->name, names->off) < 0) return -1;
    return 0;
}

/* configure(EventPublisher, _TierShadow, BlockRecord, STORED, REMOVED, NO_PARENT, TS_RESOLUTION) */
static PyObject *configure(PyObject *mod, PyObject *args) {
    PyObject *pub, *sh, *rec, *st, *rm, *np;
    double res;
    if (!PyArg_ParseTuple(args, "O!O!O!OOUd", &PyType_Type, &pub, &PyType_Type, &sh, &PyType_Type, &rec,
                          &st, &rm, &np, &res))
        return NULL;
    static const SlotName rec_slots[] = {{"sequence_hash", &r_seq}, {"local_hash", &r_local},
        {"parent_hash", &r_parent}, {"block_size", &r_size}, {"token_ids", &r_tokens}, {NULL, NULL}};
    static const SlotName pub_slots[] = {{"_lock", &p_lock}, {"_cond", &p_cond}, {"_buffer", &p_buffer},
        {"_tiers", &p_tiers}, {"_ts", &p_ts}, {"_ts_text", &p_ts_text}, {"_last_id", &p_last_id},
        {"_done_id", &p_done_id}, {"_first_pending_at", &p_first_pending_at}, {"_closing", &p_closing},
        {"enqueued", &p_enqueued}, {"dropped", &p_dropped}, {"buffer_events", &p_buffer_events},
        {"max_batch", &p_max_batch}, {"keep_tokens", &p_keep_tokens},
        {"max_event_blocks", &p_max_event_blocks}, {"max_event_tokens", &p_max_event_tokens}, {NULL, NULL}};
    static const SlotName shadow_slots[] = {{"held", &s_held}, {"log", &s_log}, {"logged", &s_logged},
        {"limit", &s_limit}, {NULL, NULL}};
    configured = 0;
    if (learn((PyTypeObject *)rec, rec_slots) < 0 || learn((PyTypeObject *)pub, pub_slots) < 0
        || learn((PyTypeObject *)sh, shadow_slots) < 0)
        return NULL;
    Py_INCREF(pub); Py_XSETREF(publisher_type, (PyTypeObject *)pub);
    Py_INCREF(sh); Py_XSETREF(shadow_type, (PyTypeObject *)sh);
    Py_INCREF(rec); Py_XSETREF(record_type, (PyTypeObject *)rec);
    Py_INCREF(st); Py_XSETREF(stored_kind, st);
    Py_INCREF(rm); Py_XSETREF(removed_kind, rm);
    Py_INCREF(np); Py_XSETREF(no_parent, np);
    ts_resolution = res;
    configured = 1;
    Py_RETURN_NONE;
}

/* ---- small helpers ----------------------------------------------------------------------- */

static void set_slot(PyObject *obj, Py_ssize_t off, PyObject *value /* stolen */) {
    PyObject **p = (PyObject **)((char *)obj + off);
    PyObject *old = *p;
    *p = value;
    Py_XDECREF(old);
}

/* An int slot's value; -1 with an exception set if it is not an int. */
static long long int_slot(PyObject *obj, Py_ssize_t off) {
    PyObject *v = SLOT(obj, off);
    if (!v || !PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "publisher counter is not an int");
        return -1;
    }
    return PyLong_AsLongLong(v);
}

static int set_int_slot(PyObject *obj, Py_ssize_t off, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (!v) return -1;
    set_slot(obj, off, v);
    return 0;
}

static int add_to_int_slot(PyObject *obj, Py_ssize_t off, long long delta) {
    long long v = int_slot(obj, off);
    if (v == -1 && PyErr_Occurred()) return -1;
    return set_int_slot(obj, off, v + delta);
}

/* time.<name>() as a float, looked up on the time module at each call as the Python code
 * does (so a patched clock is seen by both paths); -1.0 with an exception set on error. */
static double clock_seconds(PyObject *name) {
    PyObject *fn = PyObject_GetAttr(time_module, name);
    if (!fn) return -1.0;
    PyObject *t = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (!t) return -1.0;
    double v = PyFloat_AsDouble(t);
    Py_DECREF(t);
    return v;
}

static int call_method0(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Release the lock whatever happened under it: -1 if an error is pending afterwards (the one
 * raised under the lock, kept, or the release's own), else 0. */
static int release_lock(PyObject *lock) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int rc = call_method0(lock, str_release);
    if (!type) return rc;
    if (rc == 0) PyErr_Restore(type, value, tb);
    else { Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb); }
    return -1;
}

/* The tier's shadow, under the lock; NULL with KeyError if the tier is unknown. */
static PyObject *shadow_of(PyObject *pub, PyObject *tier) {
    PyObject *tiers = SLOT(pub, p_tiers);
    if (!tiers || !PyDict_Check(tiers)) {
        PyErr_SetString(PyExc_TypeError, "publisher tiers is not a dict");
        return NULL;
    }
    PyObject *sh = PyDict_GetItemWithError(tiers, tier);
    if (!sh) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, tier);
        return NULL;
    }
    if (Py_TYPE(sh) != shadow_type || !SLOT(sh, s_held) || !PySet_CheckExact(SLOT(sh, s_held))) {
        PyErr_SetString(PyExc_TypeError, "publisher tier shadow is not a _TierShadow");
        return NULL;
    }
    return sh;
}

/* The event's timestamp text, as EventPublisher._now (under the lock); a new reference. */
static PyObject *now_text(PyObject *pub) {
    double now = clock_seconds(str_time);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *last = SLOT(pub, p_ts);
    double ts = last ? PyFloat_AsDouble(last) : 0.0;
    if (ts == -1.0 && PyErr_Occurred()) return NULL;
    if (now - ts >= ts_resolution || now < ts) {
        PyObject *f = PyFloat_FromDouble(now);
        if (!f) return NULL;
        PyObject *text = PyObject_Repr(f);
        if (!text) { Py_DECREF(f); return NULL; }
        set_slot(pub, p_ts, f);
        Py_INCREF(text);
        set_slot(pub, p_ts_text, text);
        return text;
    }
    PyObject *text = SLOT(pub, p_ts_text);
    if (!text) { PyErr_SetString(PyExc_TypeError, "publisher has no timestamp text"); return NULL; }
    Py_INCREF(text);
    return text;
}

/* A publisher setting (a slot), and its value as a C long long when it is an exact int that
 * fits: 1 (``*x`` set), 0 (the caller computes as Python does: int beyond 64 bits,
 * float('inf'), numpy ints), or -1 with an exception. */
static int setting(PyObject *pub, Py_ssize_t off, PyObject **v, long long *x) {
    *v = SLOT(pub, off);
    if (!*v) { PyErr_SetString(PyExc_AttributeError, "publisher setting is unset"); return -1; }
    if (!PyLong_CheckExact(*v)) return 0;
    int overflow;
    *x = PyLong_AsLongLongAndOverflow(*v, &overflow);
    if (*x == -1 && PyErr_Occurred()) return -1;
    return !overflow;
}

/* ``n >= buffer_events`` as the Python code compares them; 1, 0, or -1 with an exception. */
static int buffer_full(Py_ssize_t n, PyObject *pub) {
    PyObject *v;
    long long x;
    int exact = setting(pub, p_buffer_events, &v, &x);
    if (exact) return exact < 0 ? -1 : (long long)n >= x;
    PyObject *len = PyLong_FromSsize_t(n);
    if (!len) return -1;
    int r = PyObject_RichCompareBool(len, v, Py_GE);
    Py_DECREF(len);
    return r;
}

/* Whether a buffer of ``n`` items just reached a whole number of batches (``n % max_batch ==
 * 0``, as the Python code computes it); 1, 0, or -1 with an exception. */
static int at_batch_boundary(Py_ssize_t n, PyObject *pub) {
    PyObject *v;
    long long x;
    int exact = setting(pub, p_max_batch, &v, &x);
    if (exact < 0) return -1;
    if (exact && x > 0) return (long long)n % x == 0;
    PyObject *len = PyLong_FromSsize_t(n);
    PyObject *rem = len ? PyNumber_Remainder(len, v) : NULL;
    Py_XDECREF(len);
    if (!rem) return -1;
    int r = PyObject_Not(rem);
    Py_DECREF(rem);
    return r;
}

/* Whether ``n`` blocks (or hashes) fit in one event: ``n <= max_event_blocks`` and, when the
 * event carries tokens of ``block_size`` (an int, else NULL), ``n <= max(1, max_event_tokens //
 * block_size)``, as EventPublisher.event_blocks computes it. 1, 0 (also for a setting or size
 * that is not a plain int: the Python code decides), or -1 with an exception. */
static int fits_one_event(PyObject *pub, Py_ssize_t n, PyObject *block_size) {
    PyObject *v;
    long long blocks, tokens, size;
    int exact = setting(pub, p_max_event_blocks, &v, &blocks);
    if (exact <= 0) return exact;
    if ((long long)n > blocks) return 0;
    if (!block_size) return 1;
    if (!PyLong_CheckExact(block_size)) return 0;
    int overflow;
    size = PyLong_AsLongLongAndOverflow(block_size, &overflow);
    if (size == -1 && PyErr_Occurred()) return -1;
    if (overflow) return 0;
    if (size <= 0) return 1;
    exact = setting(pub, p_max_event_tokens, &v, &tokens);
    if (exact <= 0) return exact;
    long long limit = tokens / size;   /* Python's // where tokens > 0; 1 either way below it */
    return (long long)n <= (limit > 1 ? limit : 1);
}

/* Set when a hook filled a batch and woke the batching thread: the hook lets go of the GIL
 * for a moment once it has released the lock (see hand_over). */
static int sender_woken = 0;

static int wake_sender(PyObject *pub) {
    sender_woken = 1;
    return call_method0(SLOT(pub, p_cond), str_notify);
}

/* After a full batch woke the batching thread: let it take the GIL now. Hooks called in a
 * tight loop (a burst of registrations) would otherwise keep the GIL until the interpreter's
 * switch interval (5 ms) forced it out, and events would reach the sink late and in bursts.
 * HAND_OVER_NS is long enough for the woken thread to take the GIL; it is paid once per whole
 * batch in the buffer, never by a hook that did not complete one. The batching thread then
 * encodes and writes the batch (the NATS sink's own connection: natswire.py) without letting
 * go of the GIL, so the hook gets it back when that thread waits for the next batch. */
#define HAND_OVER_NS 50000
static void hand_over(void) {
    if (!sender_woken) return;
    sender_woken = 0;
    struct timespec pause = {0, HAND_OVER_NS};
    Py_BEGIN_ALLOW_THREADS
    nanosleep(&pause, NULL);
    Py_END_ALLOW_THREADS
}

/* EventPublisher._enqueue1_locked(item), ``eid`` being the item's event id (== _last_id). */
static int enqueue1(PyObject *pub, PyObject *item, long long eid) {
    if (add_to_int_slot(pub, p_enqueued, 1) < 0) return -1;
    PyObject *buf = SLOT(pub, p_buffer);
    if (!buf) { PyErr_SetString(PyExc_AttributeError, "publisher has no buffer"); return -1; }
    Py_ssize_t n = PyObject_Size(buf);
    if (n < 0) return -1;
    int full = SLOT(pub, p_closing) ? PyObject_IsTrue(SLOT(pub, p_closing)) : 0;
    if (full == 0) full = buffer_full(n, pub);
    if (full < 0) return -1;
    if (full) {
        if (add_to_int_slot(pub, p_dropped, 1) < 0) return -1;
        if (n == 0 && set_int_slot(pub, p_done_id, eid) < 0) return -1;
        return 0;
    }
    PyObject *r = PyObject_CallMethodOneArg(buf, str_append, item);
    if (!r) return -1;
    Py_DECREF(r);
    n += 1;
    if (n == 1) {
        double at = clock_seconds(str_monotonic);
        PyObject *t = at == -1.0 && PyErr_Occurred() ? NULL : PyFloat_FromDouble(at);
        if (!t) return -1;
        set_slot(pub, p_first_pending_at, t);
        return call_method0(SLOT(pub, p_cond), str_notify);
    }
    int at_batch = at_batch_boundary(n, pub);
    if (at_batch < 0) return -1;
    return at_batch ? wake_sender(pub) : 0;
}

/* Whether ``records`` may take the fast path, judged on the records alone (no lock needed:
 * BlockRecords are immutable): one run, every field set, one block size, each parent the
 * previous hash. -1 on error. */
static int one_linked_run(PyObject **rs, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (Py_TYPE(rs[j]) != record_type) return 0;
        if (!SLOT(rs[j], r_seq) || !SLOT(rs[j], r_local) || !SLOT(rs[j], r_parent)
            || !SLOT(rs[j], r_size) || !SLOT(rs[j], r_tokens)) return 0;
    }
    PyObject *size = SLOT(rs[0], r_size);
    for (Py_ssize_t j = 1; j < n; j++) {
        int eq = PyObject_RichCompareBool(SLOT(rs[j], r_size), size, Py_EQ);
        if (eq <= 0) return eq;
        eq = PyObject_RichCompareBool(SLOT(rs[j], r_parent), SLOT(rs[j - 1], r_seq), Py_EQ);
        if (eq <= 0) return eq;
    }
    return 1;
}

/* Add every record's hash to ``held``: 1 if all were new and distinct, 0 (held unchanged) if
 * not, -1 on error (held unchanged). */
static int claim_new(PyObject *held, PyObject **rs, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        int in = PySet_Contains(held, SLOT(rs[j], r_seq));
        if (in != 0) return in < 0 ? -1 : 0;
    }
    Py_ssize_t before = PySet_GET_SIZE(held);
    for (Py_ssize_t j = 0; j < n; j++) {
        if (PySet_Add(held, SLOT(rs[j], r_seq)) < 0) {
            for (Py_ssize_t k = 0; k < j; k++) PySet_Discard(held, SLOT(rs[k], r_seq));
            return -1;
        }
    }
    if (PySet_GET_SIZE(held) != before + n) {   /* a repeated hash: not the fast path */
        for (Py_ssize_t j = 0; j < n; j++) PySet_Discard(held, SLOT(rs[j], r_seq));
        return 0;
    }
    return 1;
}

/* Items (and their token tuples) hold only ints, strs, None and tuples of token ids: they can
 * never be part of a reference cycle, so the cyclic GC need not traverse the publisher's log and
 * buffer of them (CPython would untrack them itself, but only after they survive a collection). */
static void untrack(PyObject *tuple) {
    if (PyTuple_CheckExact(tuple)) PyObject_GC_UnTrack(tuple);
}

/* (event_id, STORED, tier, ts_text, parent or NO_PARENT, block_size, tokens, h1..hn, l1..ln) */
static PyObject *stored_item(PyObject *eid, PyObject *tier, PyObject *ts_text, PyObject **rs, Py_ssize_t n,
                             int keep_tokens) {
    PyObject *tokens = Py_None;
    if (keep_tokens && SLOT(rs[0], r_tokens) != Py_None) {
        tokens = PyTuple_New(n);
        if (!tokens) return NULL;
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *t = SLOT(rs[j], r_tokens);
            Py_INCREF(t);
            PyTuple_SET_ITEM(tokens, j, t);
        }
    } else Py_INCREF(tokens);
    PyObject *item = PyTuple_New(7 + 2 * n);
    if (!item) { Py_DECREF(tokens); return NULL; }
    PyObject *parent = SLOT(rs[0], r_parent);
    if (parent == Py_None) parent = no_parent;
    PyObject *head[6] = {eid, stored_kind, tier, ts_text, parent, SLOT(rs[0], r_size)};
    for (int i = 0; i < 6; i++) { Py_INCREF(head[i]); PyTuple_SET_ITEM(item, i, head[i]); }
    PyTuple_SET_ITEM(item, 6, tokens);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *h = SLOT(rs[j], r_seq), *l = SLOT(rs[j], r_local);
        Py_INCREF(h); PyTuple_SET_ITEM(item, 7 + j, h);
        Py_INCREF(l); PyTuple_SET_ITEM(item, 7 + n + j, l);
    }
    untrack(tokens);
    untrack(item);
    return item;
}

static int usable(PyObject *pub) {
    return configured && PyObject_TypeCheck(pub, publisher_type) && SLOT(pub, p_lock) && SLOT(pub, p_cond);
}

/* ---- the hooks --------------------------------------------------------------------------- */

static int stored_in_shadow(PyObject *pub, PyObject *sh, PyObject *tier, PyObject **rs, Py_ssize_t n);

/* The stored event's work under the lock: 1 done, 0 not the fast path (nothing changed), -1
 * error. */
static int stored_locked(PyObject *pub, PyObject *tier, PyObject **rs, Py_ssize_t n) {
    PyObject *tiers = SLOT(pub, p_tiers);
    PyObject *sh = tiers && PyDict_CheckExact(tiers) ? PyDict_GetItemWithError(tiers, tier) : NULL;
    if (!sh || Py_TYPE(sh) != shadow_type || !SLOT(sh, s_held) || !PySet_CheckExact(SLOT(sh, s_held))
        || !SLOT(sh, s_log) || !PyList_CheckExact(SLOT(sh, s_log)))
        return PyErr_Occurred() ? -1 : 0;     /* unknown tier: the Python code raises */
    Py_INCREF(sh);             /* held across Python callbacks (a patched clock, compaction) */
    int rc = stored_in_shadow(pub, sh, tier, rs, n);
    Py_DECREF(sh);
    return rc;
}

static int stored_in_shadow(PyObject *pub, PyObject *sh, PyObject *tier, PyObject **rs, Py_ssize_t n) {
    long long last = int_slot(pub, p_last_id), logged = int_slot(sh, s_logged), limit = int_slot(sh, s_limit);
    if (PyErr_Occurred()) return -1;
    int keep_tokens = SLOT(pub, p_keep_tokens) ? PyObject_IsTrue(SLOT(pub, p_keep_tokens)) : 0;
    if (keep_tokens < 0) return -1;
    PyObject *held = Py_NewRef(SLOT(sh, s_held));
    int fresh = claim_new(held, rs, n);
    if (fresh <= 0) { Py_DECREF(held); return fresh; }
    PyObject *eid = PyLong_FromLongLong(last + 1);
    PyObject *ts_text = eid ? now_text(pub) : NULL;
    PyObject *item = ts_text ? stored_item(eid, tier, ts_text, rs, n, keep_tokens) : NULL;
    Py_XDECREF(ts_text);
    if (!item) {
        Py_XDECREF(eid);
        for (Py_ssize_t j = 0; j < n; j++) PySet_Discard(held, SLOT(rs[j], r_seq));
        Py_DECREF(held);
        return -1;
    }
    Py_DECREF(held);
    set_slot(pub, p_last_id, eid);
    /* _log_and_enqueue_locked (the log read again: the clock above may have run Python) */
    PyObject *log = SLOT(sh, s_log);
    int rc = log && PyList_CheckExact(log) ? PyList_Append(log, item) : -1;
    if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tier shadow log is not a list");
    if (rc == 0) rc = set_int_slot(sh, s_logged, logged + n);
    if (rc == 0 && logged + n > limit) {
        PyObject *r = PyObject_CallMethodOneArg(pub, str_compact, sh);
        if (!r) rc = -1; else Py_DECREF(r);
    }
    if (rc == 0) rc = enqueue1(pub, item, last + 1);
    Py_DECREF(item);
    return rc < 0 ? -1 : 1;
}

static PyObject *hook_stored(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "stored(publisher, tier, records)"); return NULL; }
    PyObject *pub = args[0], *tier = args[1], *records = args[2];
    if (!usable(pub) || (!PyList_CheckExact(records) && !PyTuple_CheckExact(records))) Py_RETURN_FALSE;
    Py_ssize_t n0 = PySequence_Fast_GET_SIZE(records);
    if (n0 == 0 || n0 > 100000) Py_RETURN_FALSE;
    /* An immutable snapshot: a list may change while acquire() waits (the GIL is released) or
     * while a field's __eq__/__hash__ runs; its item array must not be read after that. */
    PyObject *recs = PyList_CheckExact(records) ? PyList_AsTuple(records) : Py_NewRef(records);
    if (!recs) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(recs);
    PyObject **rs = &PyTuple_GET_ITEM(recs, 0);
    int run = n ? one_linked_run(rs, n) : 0;
    if (run > 0) {   /* a run longer than one event holds: the Python code cuts it */
        int tokens = SLOT(pub, p_keep_tokens) ? PyObject_IsTrue(SLOT(pub, p_keep_tokens)) : 0;
        run = tokens < 0 ? -1 : fits_one_event(pub, n, tokens && SLOT(rs[0], r_tokens) != Py_None
                                                           ? SLOT(rs[0], r_size) : NULL);
    }
    if (run <= 0) {
        Py_DECREF(recs);
        if (run < 0) return NULL;
        Py_RETURN_FALSE;
    }
    PyObject *lock = Py_NewRef(SLOT(pub, p_lock));   /* the slot could be replaced while we wait */
    if (call_method0(lock, str_acquire) < 0) { Py_DECREF(lock); Py_DECREF(recs); return NULL; }
    int rc = stored_locked(pub, tier, rs, n);
    int released = release_lock(lock);
    Py_DECREF(lock);
    Py_DECREF(recs);
    if (released < 0) return NULL;
    hand_over();
    return PyBool_FromLong(rc);
}

static int removed_from(PyObject *pub, PyObject *held, PyObject *tier, PyObject **hs, Py_ssize_t n);

/* on_tier_removed's work under the lock: 0 done, -1 error. */
static int removed_locked(PyObject *pub, PyObject *tier, PyObject **hs, Py_ssize_t n) {
    PyObject *sh = shadow_of(pub, tier);
    if (!sh) return -1;
    PyObject *held = Py_NewRef(SLOT(sh, s_held));
    int rc = removed_from(pub, held, tier, hs, n);
    Py_DECREF(held);
    return rc;
}

static int removed_from(PyObject *pub, PyObject *held, PyObject *tier, PyObject **hs, Py_ssize_t n) {
    long long last = int_slot(pub, p_last_id);
    if (last == -1 && PyErr_Occurred()) return -1;
    PyObject *item = PyTuple_New(4 + n);
    if (!item) return -1;
    Py_ssize_t gone = 0;
    for (Py_ssize_t j = 0; j < n; j++) {     /* each hash removed as it is taken: repeats drop out */
        int was = PySet_Discard(held, hs[j]);
        if (was < 0) {
            for (Py_ssize_t k = 0; k < gone; k++) PySet_Add(held, PyTuple_GET_ITEM(item, 4 + k));
            Py_DECREF(item);
            return -1;
        }
        if (was) { Py_INCREF(hs[j]); PyTuple_SET_ITEM(item, 4 + gone, hs[j]); gone++; }
    }
    if (!gone) { Py_DECREF(item); return 0; }
    if (gone < n && _PyTuple_Resize(&item, 4 + gone) < 0) return -1;
    PyObject *eid = PyLong_FromLongLong(last + 1);
    PyObject *ts_text = eid ? now_text(pub) : NULL;
    if (!ts_text) { Py_XDECREF(eid); Py_DECREF(item); return -1; }
    Py_INCREF(eid); PyTuple_SET_ITEM(item, 0, eid);
    Py_INCREF(removed_kind); PyTuple_SET_ITEM(item, 1, removed_kind);
    Py_INCREF(tier); PyTuple_SET_ITEM(item, 2, tier);
    PyTuple_SET_ITEM(item, 3, ts_text);
    untrack(item);
    set_slot(pub, p_last_id, eid);
    int rc = enqueue1(pub, item, last + 1);
    Py_DECREF(item);
    return rc;
}

static PyObject *hook_removed(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "removed(publisher, tier, hashes)"); return NULL; }
    PyObject *pub = args[0], *tier = args[1];
    if (!usable(pub)) Py_RETURN_FALSE;       /* the Python code handles it */
    PyObject *seq = PySequence_Fast(args[2], "removed: hashes must be a sequence");
    if (!seq) return NULL;
    int fits = fits_one_event(pub, PySequence_Fast_GET_SIZE(seq), NULL);
    if (fits <= 0) {                         /* more than one event holds: the Python code */
        Py_DECREF(seq);
        if (fits < 0) return NULL;
        Py_RETURN_FALSE;
    }
    PyObject *lock = SLOT(pub, p_lock);
    Py_INCREF(lock);
    if (call_method0(lock, str_acquire) < 0) { Py_DECREF(lock); Py_DECREF(seq); return NULL; }
    removed_locked(pub, tier, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq));
    int released = release_lock(lock);
    Py_DECREF(lock);
    Py_DECREF(seq);
    if (released < 0) return NULL;
    hand_over();
    Py_RETURN_TRUE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(EventPublisher, _TierShadow, BlockRecord, STORED, REMOVED, NO_PARENT, TS_RESOLUTION): learn the slots"},
    {"stored", (PyCFunction)(void (*)(void))hook_stored, METH_FASTCALL,
     "stored(publisher, tier, records) -> True if handled (one linked run of new blocks), else False, nothing changed"},
    {"removed", (PyCFunction)(void (*)(void))hook_removed, METH_FASTCALL,
     "removed(publisher, tier, hashes): EventPublisher.on_tier_removed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hooks", "Native observer hooks of kvstrata's EventPublisher.", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__hooks(void) {
    str_acquire = PyUnicode_InternFromString("acquire");
    str_release = PyUnicode_InternFromString("release");
    str_append = PyUnicode_InternFromString("append");
    str_notify = PyUnicode_InternFromString("notify");
    str_compact = PyUnicode_InternFromString("_maybe_compact_inline");
    str_time = PyUnicode_InternFromString("time");
    str_monotonic = PyUnicode_InternFromString("monotonic");
    if (!str_acquire || !str_release || !str_append || !str_notify || !str_compact || !str_time
        || !str_monotonic) return NULL;
    time_module = PyImport_ImportModule("time");
    if (!time_module) return NULL;
    return PyModule_Create(&module);
}
