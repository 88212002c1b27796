/* Native fast paths of kvstrata's event plane (docs/events.md, "Native fast paths"). Each has
 * a pure-Python reference that gives the same results and is used when this is not built:
 *
 *   Core                  the indexer's prefix tree (indexer._PyCore)
 *   parse_router_event    a strict Dynamo RouterEvent parser (formats.decode_dynamo)
 *   encode_message        a batch's kvstrata JSON message (formats.encode_batch_messages)
 *
 * The prefix tree (Core):
 *
 * The same tree as the pure-Python core (_PyCore in indexer.py), with the same answers: nodes
 * keyed by 64-bit sequence hash, each linked to its parent and reachable from it by local
 * hash, each listing the holders ((worker, tier) pairs, interned to small ints by the Python
 * side) it is live in; a node disappears when it has neither holders nor children.
 *
 * Representation (about 40 bytes per node plus ~13 bytes of hash tables, against several
 * hundred for Python objects):
 *   nodes      fixed-size records in chunks of 64 Ki (no slack beyond one chunk), addressed by
 *              32-bit index; index 0 is the root; freed records are reused (a stack of them)
 *   by_seq     open-addressing table (linear probing, backward-shift deletion) of node
 *              indices, keyed by the node's sequence hash
 *   by_child   the same, keyed by (parent index, local hash): the parent's "children" map
 *   holders    up to two inline per node, more in a small heap array
 *   held       per holder, a log of the records it was given (with records since let go of,
 *              dropped in passes): clear and hashes_in cost what the holder holds
 *
 * Core(): store(holder, parent_or_None, blocks), remove(holder, hashes), clear(holder),
 * match(hashes, holders), match_local(local_hashes, holders) (holders[holder] is the
 * (worker, tier) pair a holder id stands for; the answer is {worker: {tier: prefix}}), hashes_in(holder), count(holder), nodes(),
 * memory(). Hashes are unsigned 64-bit ints; anything else is a ValueError raised before
 * the tree changes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NIL 0xFFFFFFFFu   /* no parent (a placeholder) */
#define FREED 0xFFFFFFFEu /* parent field of a freed record */
#define ROOT 0u
#define CHUNK_BITS 16
#define CHUNK (1u << CHUNK_BITS)
#define EMPTY 0u          /* table slot: the root is never in a table */

typedef struct {
    uint64_t seq, local;
    uint32_t parent;   /* NIL, FREED or a node index */
    uint32_t nkids;    /* live nodes whose parent is this one (next free index when freed) */
    uint32_t nhold;    /* up to two holders inline in h.in; more in h.heap, whose [0] is its capacity */
    uint32_t up;       /* NIL, or an ancestor nearer the top of the tree: a shortcut of top_of */
    union { uint32_t in[2]; uint32_t *heap; } h;
} Node;

typedef struct {
    uint32_t idx;      /* node index, EMPTY when free */
    uint32_t tag;      /* low 32 bits of the key's hash: most probes never touch a node */
} Slot;

typedef struct {
    Slot *slots;
    uint64_t mask;     /* capacity - 1 (at most 2^32 slots, so the tag holds the home) */
    uint64_t used;
} Table;

typedef struct {
    uint32_t *v;       /* record indices, in the order the holder was given them */
    uint64_t n, cap;
} Held;

typedef struct {
    PyObject_HEAD
    Node **chunks;
    uint32_t nchunks, nalloc;   /* chunks allocated, records handed out (high-water) */
    uint32_t *free_stack;       /* freed records, reused last-freed first */
    uint64_t nfree, free_cap;
    uint64_t live;              /* nodes in by_seq */
    uint64_t heap_bytes;        /* holder arrays */
    Table by_seq, by_child;
    uint64_t *counts;           /* per holder: nodes it holds */
    uint32_t *runs;             /* per holder, scratch of match() (kept zero between calls) */
    Held *held;                 /* per holder: every node it holds, and some it no longer does */
    uint64_t held_bytes;
    uint32_t nholders;
} Core;

static inline Node *N(Core *c, uint32_t i) { return &c->chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]; }

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    x ^= x >> 31; return x;
}
static inline uint64_t child_key(uint32_t parent, uint64_t local) {
    return mix64(local ^ ((uint64_t)parent * 0x9E3779B97F4A7C15ULL));
}
static inline uint32_t *holders_of(Node *n) { return n->nhold > 2 ? n->h.heap + 1 : n->h.in; }

/* ---- tables ------------------------------------------------------------------------------ */

static int table_init(Table *t, uint64_t cap) {
    t->slots = calloc(cap, sizeof(Slot));
    if (!t->slots) return -1;
    t->mask = cap - 1; t->used = 0;
    return 0;
}

static int table_grow(Core *c, Table *t, int is_child) {
    uint64_t cap = (t->mask + 1) * 2;
    Slot *old = t->slots; uint64_t oldcap = t->mask + 1;
    if (cap > ((uint64_t)1 << 32)) return -1;
    Slot *slots = calloc(cap, sizeof(Slot));
    if (!slots) return -1;
    for (uint64_t s = 0; s < oldcap; s++) {
        if (old[s].idx == EMPTY) continue;
        uint64_t k = old[s].tag & (cap - 1);
        while (slots[k].idx != EMPTY) k = (k + 1) & (cap - 1);
        slots[k] = old[s];
    }
    free(old);
    t->slots = slots; t->mask = cap - 1;
    return 0;
}

static inline uint64_t seq_find_slot(Core *c, uint64_t seq, int *found) {
    Table *t = &c->by_seq;
    uint32_t tag = (uint32_t)mix64(seq);
    uint64_t k = tag & t->mask;
    for (;;) {
        Slot sl = t->slots[k];
        if (sl.idx == EMPTY) { *found = 0; return k; }
        if (sl.tag == tag && N(c, sl.idx)->seq == seq) { *found = 1; return k; }
        k = (k + 1) & t->mask;
    }
}

static inline uint32_t seq_get(Core *c, uint64_t seq) {
    int found; uint64_t k = seq_find_slot(c, seq, &found);
    return found ? c->by_seq.slots[k].idx : NIL;
}

static inline uint64_t child_find_slot(Core *c, uint32_t parent, uint64_t local, int *found) {
    Table *t = &c->by_child;
    uint32_t tag = (uint32_t)child_key(parent, local);
    uint64_t k = tag & t->mask;
    for (;;) {
        Slot sl = t->slots[k];
        if (sl.idx == EMPTY) { *found = 0; return k; }
        if (sl.tag == tag) {
            Node *n = N(c, sl.idx);
            if (n->parent == parent && n->local == local) { *found = 1; return k; }
        }
        k = (k + 1) & t->mask;
    }
}

static inline uint32_t child_get(Core *c, uint32_t parent, uint64_t local) {
    int found; uint64_t k = child_find_slot(c, parent, local, &found);
    return found ? c->by_child.slots[k].idx : NIL;
}

/* Backward-shift deletion of slot k (linear probing: no tombstones). */
static void table_delete_slot(Table *t, uint64_t k) {
    uint64_t mask = t->mask, j = k;
    for (;;) {
        j = (j + 1) & mask;
        if (t->slots[j].idx == EMPTY) break;
        uint64_t home = t->slots[j].tag & mask;
        /* move slot j back to k unless its home lies cyclically in (k, j] */
        if ((j > k && (home <= k || home > j)) || (j < k && (home <= k && home > j))) {
            t->slots[k] = t->slots[j];
            k = j;
        }
    }
    t->slots[k].idx = EMPTY;
    t->used--;
}

static int reserve(Core *c, Table *t, int is_child) {
    if ((t->used + 1) * 4 > (t->mask + 1) * 3) return table_grow(c, t, is_child);
    return 0;
}

/* ---- nodes ------------------------------------------------------------------------------- */

static uint32_t node_alloc(Core *c) {
    uint32_t i;
    if (c->nfree) {
        i = c->free_stack[--c->nfree];
    } else {
        if (c->nalloc == FREED - 1) { PyErr_SetString(PyExc_MemoryError, "index full (2^32 nodes)"); return NIL; }
        i = c->nalloc;
        if ((i >> CHUNK_BITS) >= c->nchunks) {
            Node **chunks = realloc(c->chunks, sizeof(Node *) * (c->nchunks + 1));
            if (!chunks) { PyErr_NoMemory(); return NIL; }
            c->chunks = chunks;
            chunks[c->nchunks] = malloc(sizeof(Node) * CHUNK);
            if (!chunks[c->nchunks]) { PyErr_NoMemory(); return NIL; }
            c->nchunks++;
        }
        c->nalloc++;
    }
    return i;
}

/* A new node (placeholder: no parent) for seq, inserted in by_seq at slot k (from seq_find_slot
 * before any growth). Returns NIL on memory error. */
static uint32_t node_new(Core *c, uint64_t seq) {
    if (reserve(c, &c->by_seq, 0) < 0) { PyErr_NoMemory(); return NIL; }
    uint32_t i = node_alloc(c);
    if (i == NIL) return NIL;
    Node *n = N(c, i);
    n->seq = seq; n->local = 0; n->parent = NIL; n->nkids = 0; n->nhold = 0; n->up = NIL;
    int found; uint64_t k = seq_find_slot(c, seq, &found);
    c->by_seq.slots[k].idx = i; c->by_seq.slots[k].tag = (uint32_t)mix64(seq); c->by_seq.used++;
    c->live++;
    return i;
}

static void node_free(Core *c, uint32_t i) {
    Node *n = N(c, i);
    if (n->nhold > 2) { c->heap_bytes -= (n->h.heap[0] + 1) * sizeof(uint32_t); free(n->h.heap); }
    n->nhold = 0;
    n->parent = FREED;
    n->nkids = 0;
    c->live--;
    if (c->nfree == c->free_cap) {
        uint64_t cap = c->free_cap ? c->free_cap * 2 : 1024;
        uint32_t *st = realloc(c->free_stack, cap * sizeof(uint32_t));
        if (!st) return;                   /* out of memory: the record is not reused */
        c->free_stack = st; c->free_cap = cap;
    }
    c->free_stack[c->nfree++] = i;
}

/* Where holder h is in node n's holders, or -1. */
static int holder_index(Node *n, uint32_t h) {
    uint32_t *hs = holders_of(n);
    for (uint32_t j = 0; j < n->nhold; j++) if (hs[j] == h) return (int)j;
    return -1;
}

#define MARK 0x80000000u   /* holder ids are below 2^28 (as_holder): a bit for held_compact */

/* A holder's log lists each node it holds at least once. It is compacted (records let go of
 * dropped, and repeats: a freed record reused for a node the holder takes again) when it fills
 * up at half again the holder's count or more, so it stays within a small multiple of that
 * count, and a pass is paid for by the additions since the last. */
static void held_compact(Core *c, uint32_t h) {
    Held *L = &c->held[h];
    uint64_t k = 0;
    for (uint64_t j = 0; j < L->n; j++) {          /* keep the first entry of each node held */
        if (j + 8 < L->n) __builtin_prefetch(N(c, L->v[j + 8]));
        Node *n = N(c, L->v[j]);
        int at = holder_index(n, h);
        if (at >= 0) { holders_of(n)[at] |= MARK; L->v[k++] = L->v[j]; }
    }
    for (uint64_t j = 0; j < k; j++) {
        Node *n = N(c, L->v[j]);
        holders_of(n)[holder_index(n, h | MARK)] = h;
    }
    L->n = k;
    uint64_t want = k + k / 2 + 64;
    if (L->cap > 2 * want) {
        uint32_t *v = realloc(L->v, want * sizeof(uint32_t));
        if (v) { c->held_bytes -= (L->cap - want) * sizeof(uint32_t); L->v = v; L->cap = want; }
    }
}

static int held_push(Core *c, uint32_t h, uint32_t i) {
    Held *L = &c->held[h];
    if (L->n == L->cap) {
        if (L->n >= c->counts[h] + c->counts[h] / 2 + 64) held_compact(c, h);
        if (L->n == L->cap) {
            uint64_t cap = L->cap + L->cap / 2 + 64;
            uint32_t *v = realloc(L->v, cap * sizeof(uint32_t));
            if (!v) { PyErr_NoMemory(); return -1; }
            c->held_bytes += (cap - L->cap) * sizeof(uint32_t);
            L->v = v; L->cap = cap;
        }
    }
    L->v[L->n++] = i;
    return 0;
}

static int holder_add(Core *c, uint32_t i, uint32_t h) {
    Node *n = N(c, i);
    if (holder_index(n, h) >= 0) return 0;
    if (held_push(c, h, i) < 0) return -1;     /* first: an entry for a node not held is harmless */
    uint32_t *hs = holders_of(n);
    uint32_t cap = n->nhold > 2 ? n->h.heap[0] : 2;
    if (n->nhold == cap) {
        uint32_t ncap = cap * 2;
        uint32_t *heap = malloc((ncap + 1) * sizeof(uint32_t));
        if (!heap) { PyErr_NoMemory(); return -1; }
        heap[0] = ncap;
        memcpy(heap + 1, hs, n->nhold * sizeof(uint32_t));
        if (n->nhold > 2) { c->heap_bytes -= (cap + 1) * sizeof(uint32_t); free(n->h.heap); }
        n->h.heap = heap;
        c->heap_bytes += (ncap + 1) * sizeof(uint32_t);
        hs = heap + 1;
    }
    hs[n->nhold++] = h;
    c->counts[h]++;
    return 0;
}

/* Drop holder h from node n: 1 if it held it, else 0. */
static int holder_discard(Core *c, Node *n, uint32_t h) {
    int j = holder_index(n, h);
    if (j < 0) return 0;
    uint32_t *hs = holders_of(n);
    memmove(hs + j, hs + j + 1, (n->nhold - j - 1) * sizeof(uint32_t));
    n->nhold--;
    c->counts[h]--;
    if (n->nhold == 2) {                       /* it had three, on the heap: back inline */
        uint32_t *heap = n->h.heap, a = heap[1], b = heap[2];
        c->heap_bytes -= (heap[0] + 1) * sizeof(uint32_t);
        free(heap);
        n->h.in[0] = a; n->h.in[1] = b;
    }
    return 1;
}

/* Remove nodes upwards from i while they have neither holders nor children. */
static void prune(Core *c, uint32_t i) {
    while (i != NIL && i != ROOT) {
        Node *n = N(c, i);
        if (n->parent == FREED || n->nhold || n->nkids) return;
        int found; uint64_t k = seq_find_slot(c, n->seq, &found);
        if (found && c->by_seq.slots[k].idx == i) table_delete_slot(&c->by_seq, k);
        uint32_t p = n->parent;
        if (p != NIL) {
            k = child_find_slot(c, p, n->local, &found);
            if (found && c->by_child.slots[k].idx == i) table_delete_slot(&c->by_child, k);
            N(c, p)->nkids--;
        }
        node_free(c, i);
        i = p;
    }
}

static int ensure_holder(Core *c, uint32_t h) {
    if (h < c->nholders) return 0;
    uint32_t n = h + 1 > c->nholders * 2 ? h + 1 : c->nholders * 2;
    uint64_t *counts = realloc(c->counts, n * sizeof(uint64_t));
    if (!counts) { PyErr_NoMemory(); return -1; }
    c->counts = counts;
    uint32_t *runs = realloc(c->runs, n * sizeof(uint32_t));
    if (!runs) { PyErr_NoMemory(); return -1; }
    c->runs = runs;
    Held *held = realloc(c->held, n * sizeof(Held));
    if (!held) { PyErr_NoMemory(); return -1; }
    c->held = held;
    memset(c->counts + c->nholders, 0, (n - c->nholders) * sizeof(uint64_t));
    memset(c->runs + c->nholders, 0, (n - c->nholders) * sizeof(uint32_t));
    memset(c->held + c->nholders, 0, (n - c->nholders) * sizeof(Held));
    c->nholders = n;
    return 0;
}

/* A non-negative exact int below 2**64 into ``*u``: 1, else 0 (no exception either way). On
 * CPython 3.11 with 30-bit digits it reads the digits (PyLong_AsUnsignedLongLong goes through
 * the generic byte-array conversion there: the larger part of printing a hash, and of reading
 * one into the tree). */
static inline int exact_u64(PyObject *v, unsigned long long *u) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    const digit *d = ((PyLongObject *)v)->ob_digit;
    switch (Py_SIZE(v)) {
    case 0: *u = 0; return 1;
    case 1: *u = d[0]; return 1;
    case 2: *u = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30); return 1;
    case 3:
        if (d[2] >> 4) return 0;
        *u = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30) | ((unsigned long long)d[2] << 60);
        return 1;
    default: return 0;
    }
#else
    *u = PyLong_AsUnsignedLongLong(v);
    if (*u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return 1;
#endif
}

/* ---- argument helpers -------------------------------------------------------------------- */

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long fast;
    if (PyLong_CheckExact(o) && exact_u64(o, &fast)) { *out = fast; return 0; }
    if (!PyLong_Check(o)) { PyErr_Format(PyExc_ValueError, "hash %R is not an integer", o); return -1; }
    uint64_t v = PyLong_AsUnsignedLongLong(o);
    if (v == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "hash %R is not an unsigned 64-bit integer", o);
        return -1;
    }
    *out = v;
    return 0;
}

static int as_holder(Core *c, PyObject *o, uint32_t *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > 0xFFFFFFF) { PyErr_SetString(PyExc_ValueError, "holder id out of range"); return -1; }
    if (ensure_holder(c, (uint32_t)v) < 0) return -1;
    *out = (uint32_t)v;
    return 0;
}

/* The top of node i's tree: the root, or a placeholder not linked yet. Every node passed on
 * the way keeps it as its shortcut (path compression: a chain is walked once, not at every
 * link). A shortcut stays true: a node's parent never changes, and its ancestors live as long
 * as it does. A placeholder i may be linked under p unless top_of(p) is i: that link would
 * close a cycle (no real chain has one), whose nodes would keep each other alive for ever (as
 * the Python core decides). */
static uint32_t top_of(Core *c, uint32_t i) {
    uint32_t t = i, next;
    for (;;) {
        Node *n = N(c, t);
        next = n->up != NIL ? n->up : n->parent;
        if (next == NIL) break;
        t = next;
    }
    while (i != t) {
        Node *n = N(c, i);
        next = n->up != NIL ? n->up : n->parent;
        n->up = t;
        i = next;
    }
    return t;
}

/* ---- methods ----------------------------------------------------------------------------- */

static PyObject *Core_store(Core *c, PyObject *args) {
    PyObject *holder_o, *parent_o, *blocks_o;
    if (!PyArg_ParseTuple(args, "OOO", &holder_o, &parent_o, &blocks_o)) return NULL;
    uint32_t h;
    if (as_holder(c, holder_o, &h) < 0) return NULL;
    PyObject *blocks = PySequence_Fast(blocks_o, "blocks must be a sequence");
    if (!blocks) return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(blocks);
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    uint64_t stack[2 * 256], *hl = stack;
    if (nb > 256 && !(hl = malloc(sizeof(uint64_t) * 2 * nb))) { Py_DECREF(blocks); return PyErr_NoMemory(); }
    int has_parent = parent_o != Py_None;
    uint64_t parent = 0;
    if (has_parent && as_u64(parent_o, &parent) < 0) goto fail;
    for (Py_ssize_t b = 0; b < nb; b++) {     /* validate everything before changing anything */
        PyObject *blk = items[b];
        if (PyTuple_Check(blk) && PyTuple_GET_SIZE(blk) >= 2) {
            if (as_u64(PyTuple_GET_ITEM(blk, 0), &hl[2 * b]) < 0) goto fail;
            if (as_u64(PyTuple_GET_ITEM(blk, 1), &hl[2 * b + 1]) < 0) goto fail;
        } else {
            PyErr_SetString(PyExc_TypeError, "each block must be a (block_hash, tokens_hash, ...) tuple");
            goto fail;
        }
    }
    /* Hint pass (changes nothing): look the blocks up, prefetching 8 ahead so the misses
     * overlap, and predict the index each new node will get (the free stack's top, then the
     * high-water mark) so the children-table slots the loop below will probe are fetched
     * together. A wrong prediction only wastes a prefetch; the loop below is exact. */
    {
        uint64_t nf = c->nfree;
        uint32_t hw = c->nalloc, prev = NIL;
        for (Py_ssize_t b = 0; b < nb && b < 8; b++) __builtin_prefetch(&c->by_seq.slots[mix64(hl[2 * b]) & c->by_seq.mask]);
        for (Py_ssize_t b = 0; b < nb; b++) {
            if (b + 8 < nb) __builtin_prefetch(&c->by_seq.slots[mix64(hl[2 * b + 16]) & c->by_seq.mask]);
            uint32_t i = seq_get(c, hl[2 * b]);
            if (i == NIL) {
                i = nf ? c->free_stack[--nf] : hw++;
                uint32_t p = b ? prev : !has_parent ? ROOT : seq_get(c, parent);
                if (p == NIL) p = nf ? c->free_stack[--nf] : hw++;   /* a placeholder parent */
                __builtin_prefetch(&c->by_child.slots[(uint32_t)child_key(p, hl[2 * b + 1]) & c->by_child.mask]);
            }
            prev = i;
        }
    }
    uint32_t pidx = NIL;                   /* node of the previous block (the parent) */
    for (Py_ssize_t b = 0; b < nb; b++) {
        uint64_t seq = hl[2 * b], local = hl[2 * b + 1];
        uint32_t i = seq_get(c, seq);
        if (i == NIL && (i = node_new(c, seq)) == NIL) goto fail;
        if (N(c, i)->parent == NIL) {      /* new, or a placeholder made for an orphan child */
            uint32_t p;
            if (!has_parent) p = ROOT;
            else if (pidx != NIL) p = pidx;
            else if ((p = seq_get(c, parent)) == NIL && (p = node_new(c, parent)) == NIL) goto fail;
            /* the link would close a cycle; only a node with children can be an ancestor
             * of p, so a new node (the common case) costs no walk */
            if (p == i || (N(c, i)->nkids && top_of(c, p) == i)) goto link_refused;
            if (reserve(c, &c->by_child, 1) < 0) { PyErr_NoMemory(); goto fail; }
            Node *n = N(c, i);
            n->parent = p; n->local = local;
            int found; uint64_t k = child_find_slot(c, p, local, &found);
            /* a different node with the same (parent, local) is replaced, as a dict would */
            if (!found) c->by_child.used++;
            c->by_child.slots[k].idx = i;
            c->by_child.slots[k].tag = (uint32_t)child_key(p, local);
            N(c, p)->nkids++;
        }
    link_refused:
        if (holder_add(c, i, h) < 0) goto fail;
        parent = seq; has_parent = 1; pidx = i;
    }
    if (hl != stack) free(hl);
    Py_DECREF(blocks);
    Py_RETURN_NONE;
fail:
    if (hl != stack) free(hl);
    Py_DECREF(blocks);
    return NULL;
}

static PyObject *Core_remove(Core *c, PyObject *args) {
    PyObject *holder_o, *hashes_o;
    if (!PyArg_ParseTuple(args, "OO", &holder_o, &hashes_o)) return NULL;
    uint32_t h;
    if (as_holder(c, holder_o, &h) < 0) return NULL;
    PyObject *hashes = PySequence_Fast(hashes_o, "hashes must be a sequence");
    if (!hashes) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t seq;
        if (!PyLong_Check(items[j])) continue;
        seq = PyLong_AsUnsignedLongLong(items[j]);
        if (seq == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); continue; }  /* never stored */
        uint32_t i = seq_get(c, seq);
        if (i == NIL) continue;
        holder_discard(c, N(c, i), h);
        prune(c, i);
    }
    Py_DECREF(hashes);
    /* removals empty a holder without pushing: compact here too, or listing and clearing it
     * would cost its peak (a pass is paid for by the removals since the last) */
    if (c->held[h].n > 2 * c->counts[h] + 64) held_compact(c, h);
    Py_RETURN_NONE;
}

static PyObject *Core_clear(Core *c, PyObject *args) {
    PyObject *holder_o;
    if (!PyArg_ParseTuple(args, "O", &holder_o)) return NULL;
    uint32_t h;
    if (as_holder(c, holder_o, &h) < 0) return NULL;
    Held *L = &c->held[h];
    for (uint64_t j = 0; j < L->n; j++) {
        if (j + 8 < L->n) __builtin_prefetch(N(c, L->v[j + 8]));
        uint32_t i = L->v[j];
        if (holder_discard(c, N(c, i), h)) prune(c, i);   /* a freed record holds nobody */
    }
    c->held_bytes -= L->cap * sizeof(uint32_t);
    free(L->v);
    L->v = NULL; L->n = L->cap = 0;
    Py_RETURN_NONE;
}

/* match: walk by sequence hash (local=0) or from the root by local hash (local=1). */
static PyObject *do_match(Core *c, PyObject *hashes_o, PyObject *holders, int local) {
    PyObject *hashes = PySequence_Fast(hashes_o, "hashes must be a sequence");
    if (!hashes) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    uint64_t stack[256], *v = stack;
    if (n > 256 && !(v = malloc(sizeof(uint64_t) * n))) { Py_DECREF(hashes); return PyErr_NoMemory(); }
    Py_ssize_t valid = 0;                       /* the walk stops at a value that is no u64 */
    for (; valid < n; valid++) {
        PyObject *o = items[valid];
        if (!PyLong_Check(o)) break;
        v[valid] = PyLong_AsUnsignedLongLong(o);
        if (v[valid] == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); break; }
    }
    uint32_t first = NIL, cur = ROOT;
    Table *t = local ? &c->by_child : &c->by_seq;
    if (!local)                                 /* the memory misses of a walk overlap */
        for (Py_ssize_t j = 0; j < valid && j < 4; j++) __builtin_prefetch(&t->slots[mix64(v[j]) & t->mask]);
    for (Py_ssize_t j = 0; j < valid; j++) {
        uint32_t i = NIL;
        if (local) {
            uint32_t tag = (uint32_t)child_key(cur, v[j]);
            for (uint64_t k = tag & t->mask;; k = (k + 1) & t->mask) {
                Slot sl = t->slots[k];
                if (sl.idx == EMPTY) break;
                if (sl.tag != tag) continue;
                if (j + 1 < valid)              /* the next step's slot, while this node loads */
                    __builtin_prefetch(&t->slots[(uint32_t)child_key(sl.idx, v[j + 1]) & t->mask]);
                Node *cand = N(c, sl.idx);
                if (cand->parent == cur && cand->local == v[j]) { i = sl.idx; break; }
            }
        } else {
            if (j + 4 < valid) __builtin_prefetch(&t->slots[mix64(v[j + 4]) & t->mask]);
            i = seq_get(c, v[j]);
        }
        if (i == NIL) break;
        Node *nd = N(c, i);
        uint32_t *hs = holders_of(nd), alive = 0;
        if (j == 0) {
            for (uint32_t k = 0; k < nd->nhold; k++) c->runs[hs[k]] = 1;
            alive = nd->nhold;
            first = i;
        } else {
            for (uint32_t k = 0; k < nd->nhold; k++)
                if (c->runs[hs[k]] == (uint32_t)j) { c->runs[hs[k]] = (uint32_t)j + 1; alive = 1; }
        }
        cur = i;
        if (!alive) break;
    }
    if (v != stack) free(v);
    /* {worker: {tier: prefix}} from holders[hid] = (worker, tier); the first node's holders
     * are the only candidates (it cannot have been freed), and runs[] goes back to zero */
    PyObject *out = PyDict_New();
    if (first != NIL) {
        Node *nd = N(c, first);
        uint32_t *hs = holders_of(nd);
        for (uint32_t k = 0; k < nd->nhold; k++) {
            uint32_t hh = hs[k], run = c->runs[hh];
            c->runs[hh] = 0;
            if (!out || !run) continue;
            PyObject *key = (Py_ssize_t)hh < PyList_GET_SIZE(holders) ? PyList_GET_ITEM(holders, hh) : NULL;
            if (!key || !PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
                PyErr_SetString(PyExc_ValueError, "holders[holder] must be a (worker, tier) tuple");
                Py_CLEAR(out);
                continue;
            }
            PyObject *w = PyTuple_GET_ITEM(key, 0), *t = PyTuple_GET_ITEM(key, 1);
            PyObject *inner = PyDict_GetItemWithError(out, w);
            if (!inner) {
                if (PyErr_Occurred() || !(inner = PyDict_New())) { Py_CLEAR(out); continue; }
                int rc = PyDict_SetItem(out, w, inner);
                Py_DECREF(inner);               /* out holds it */
                if (rc < 0) { Py_CLEAR(out); continue; }
            }
            PyObject *n = PyLong_FromUnsignedLong(run);
            if (!n || PyDict_SetItem(inner, t, n) < 0) { Py_XDECREF(n); Py_CLEAR(out); continue; }
            Py_DECREF(n);
        }
    }
    Py_DECREF(hashes);
    return out;
}

static PyObject *Core_match(Core *c, PyObject *args) {
    PyObject *hashes, *holders;
    if (!PyArg_ParseTuple(args, "OO!", &hashes, &PyList_Type, &holders)) return NULL;
    return do_match(c, hashes, holders, 0);
}
static PyObject *Core_match_local(Core *c, PyObject *args) {
    PyObject *hashes, *holders;
    if (!PyArg_ParseTuple(args, "OO!", &hashes, &PyList_Type, &holders)) return NULL;
    return do_match(c, hashes, holders, 1);
}

static PyObject *Core_hashes_in(Core *c, PyObject *args) {
    PyObject *holder_o;
    if (!PyArg_ParseTuple(args, "O", &holder_o)) return NULL;
    uint32_t h;
    if (as_holder(c, holder_o, &h) < 0) return NULL;
    PyObject *out = PySet_New(NULL);
    if (!out) return NULL;
    Held *L = &c->held[h];
    for (uint64_t j = 0; j < L->n && (uint64_t)PySet_GET_SIZE(out) < c->counts[h]; j++) {
        Node *n = N(c, L->v[j]);
        if (holder_index(n, h) < 0) continue;
        PyObject *v = PyLong_FromUnsignedLongLong(n->seq);
        if (!v || PySet_Add(out, v) < 0) { Py_XDECREF(v); Py_DECREF(out); return NULL; }
        Py_DECREF(v);
    }
    return out;
}

static PyObject *Core_count(Core *c, PyObject *args) {
    PyObject *holder_o;
    if (!PyArg_ParseTuple(args, "O", &holder_o)) return NULL;
    uint32_t h;
    if (as_holder(c, holder_o, &h) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(c->counts[h]);
}

static PyObject *Core_nodes(Core *c, PyObject *unused) { return PyLong_FromUnsignedLongLong(c->live); }

static PyObject *Core_memory(Core *c, PyObject *unused) {
    uint64_t b = (uint64_t)c->nchunks * CHUNK * sizeof(Node) + c->heap_bytes + c->held_bytes
        + (c->by_seq.mask + 1 + c->by_child.mask + 1) * sizeof(Slot)
        + c->nholders * (sizeof(uint64_t) + sizeof(uint32_t) + sizeof(Held));
    return PyLong_FromUnsignedLongLong(b);
}

/* ---- type -------------------------------------------------------------------------------- */

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return -1;
    if (c->chunks) return 0;
    if (table_init(&c->by_seq, 1024) < 0 || table_init(&c->by_child, 1024) < 0) { PyErr_NoMemory(); return -1; }
    if (node_alloc(c) != ROOT) return -1;   /* the root */
    Node *r = N(c, ROOT);
    memset(r, 0, sizeof(Node));
    r->parent = NIL; r->up = NIL;
    if (ensure_holder(c, 15) < 0) return -1;
    return 0;
}

static void Core_dealloc(Core *c) {
    for (uint32_t i = 0; i < c->nalloc; i++) {
        Node *n = N(c, i);
        if (n->parent != FREED && n->nhold > 2) free(n->h.heap);
    }
    for (uint32_t h = 0; h < c->nholders; h++) free(c->held[h].v);
    free(c->held);
    for (uint32_t k = 0; k < c->nchunks; k++) free(c->chunks[k]);
    free(c->free_stack);
    free(c->chunks); free(c->by_seq.slots); free(c->by_child.slots); free(c->counts); free(c->runs);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"store", (PyCFunction)Core_store, METH_VARARGS, "store(holder, parent_hash_or_None, blocks): blocks are (seq, local, ...) tuples in chain order"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(holder, hashes)"},
    {"clear", (PyCFunction)Core_clear, METH_VARARGS, "clear(holder): drop every block the holder holds"},
    {"match", (PyCFunction)Core_match, METH_VARARGS, "match(seq_hashes, holders) -> {worker: {tier: prefix}} (holders[holder] = (worker, tier))"},
    {"match_local", (PyCFunction)Core_match_local, METH_VARARGS, "match_local(local_hashes, holders) -> {worker: {tier: prefix}}"},
    {"hashes_in", (PyCFunction)Core_hashes_in, METH_VARARGS, "hashes_in(holder) -> set of sequence hashes"},
    {"count", (PyCFunction)Core_count, METH_VARARGS, "count(holder) -> blocks held"},
    {"nodes", (PyCFunction)Core_nodes, METH_NOARGS, "number of nodes (placeholders included, root excluded)"},
    {"memory", (PyCFunction)Core_memory, METH_NOARGS, "bytes allocated by the core"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.events._native.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_doc = "The prefix tree of kvstrata's indexer, in C (see indexer.py's _PyCore for the reference).",
};

/* ---- module functions -------------------------------------------------------------------- */

static PyObject *str_block_hash, *str_tokens_hash;

/* stored_blocks(structs, cls) -> tuple of cls(block_hash, tokens_hash, None), or None when a
 * hash is not an unsigned 64-bit int. ``structs`` is a list of objects with ``block_hash`` and
 * ``tokens_hash`` attributes (the fast Dynamo decoder's msgspec structs); ``cls`` a 3-field
 * tuple subclass (StoredBlock). The same as formats._stored_blocks_py, without a Python frame
 * per block. */
static PyObject *stored_blocks(PyObject *mod, PyObject *args) {
    PyObject *list, *cls;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &list, &PyType_Type, &cls)) return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (!PyType_IsSubtype(tp, &PyTuple_Type)) { PyErr_SetString(PyExc_TypeError, "cls must be a tuple subclass"); return NULL; }
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *item = PyList_GET_ITEM(list, j);
        PyObject *a = PyObject_GetAttr(item, str_block_hash);
        if (!a) goto fail;
        PyObject *b = PyObject_GetAttr(item, str_tokens_hash);
        if (!b) { Py_DECREF(a); goto fail; }
        int ok = PyLong_CheckExact(a) && PyLong_CheckExact(b);
        if (ok) {
            PyLong_AsUnsignedLongLong(a);
            if (PyErr_Occurred()) { PyErr_Clear(); ok = 0; }
            else { PyLong_AsUnsignedLongLong(b); if (PyErr_Occurred()) { PyErr_Clear(); ok = 0; } }
        }
        if (!ok) { Py_DECREF(a); Py_DECREF(b); Py_DECREF(out); Py_RETURN_NONE; }
        PyObject *t = tp->tp_alloc(tp, 3);
        if (!t) { Py_DECREF(a); Py_DECREF(b); goto fail; }
        PyTuple_SET_ITEM(t, 0, a);
        PyTuple_SET_ITEM(t, 1, b);
        Py_INCREF(Py_None);
        PyTuple_SET_ITEM(t, 2, Py_None);
        PyTuple_SET_ITEM(out, j, t);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}


/* ---- Dynamo RouterEvent parser ----------------------------------------------------------- */
/* parse_router_event(text_or_bytes, cls) ->
 *     (worker_id, storage_tier or None, event_id, kind, parent_hash or None, payload, dp_rank)
 *     or None (dp_rank: the inner event's, an unsigned 32-bit integer, 0 when absent)
 * kind 0 stored (payload: tuple of cls(block_hash, tokens_hash, None)), 1 removed (payload:
 * tuple of hashes), 2 cleared (payload: ()). None for anything this strict parser does not
 * take: invalid JSON, a duplicate key it reads, escapes in a key it reads, a number that is
 * not a plain unsigned 64-bit integer where one is read, bytes that are not ASCII, nesting
 * deeper than 64, a shape Dynamo does not send. The caller then uses the reference decoder,
 * which accepts or rejects with the documented error; what this parser accepts, the reference
 * decoder decodes to the same values. Unknown fields are skipped (after validating them). */

typedef struct { const unsigned char *p, *end; } Parser;

static inline void ws(Parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) ps->p++;
}
static inline int expect(Parser *ps, char ch) {
    ws(ps);
    if (ps->p < ps->end && *ps->p == (unsigned char)ch) { ps->p++; return 1; }
    return 0;
}
static inline int peek(Parser *ps) { ws(ps); return ps->p < ps->end ? *ps->p : -1; }

static int skip_string(Parser *ps) {            /* at the opening quote */
    ps->p++;
    while (ps->p < ps->end) {
        unsigned char ch = *ps->p++;
        if (ch == '"') return 1;
        if (ch < 0x20) return 0;
        if (ch == '\\') {
            if (ps->p >= ps->end) return 0;
            ch = *ps->p++;
            if (ch == 'u') {
                for (int k = 0; k < 4; k++) {
                    if (ps->p >= ps->end) return 0;
                    unsigned char h = *ps->p++;
                    if (!((h >= '0' && h <= '9') || (h >= 'a' && h <= 'f') || (h >= 'A' && h <= 'F'))) return 0;
                }
            } else if (!strchr("\"\\/bfnrt", ch) || ch == 0) return 0;
        }
    }
    return 0;
}

/* A string without escapes (a key or a value read as is): pointer and length. */
static int plain_string(Parser *ps, const unsigned char **s, size_t *n) {
    if (peek(ps) != '"') return 0;
    const unsigned char *start = ++ps->p;
    while (ps->p < ps->end) {
        unsigned char ch = *ps->p;
        if (ch == '"') { *s = start; *n = (size_t)(ps->p - start); ps->p++; return 1; }
        if (ch < 0x20 || ch == '\\') return 0;
        ps->p++;
    }
    return 0;
}

static int skip_number(Parser *ps) {
    const unsigned char *p = ps->p, *e = ps->end;
    if (p < e && *p == '-') p++;
    if (p >= e) return 0;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') { while (p < e && *p >= '0' && *p <= '9') p++; }
    else return 0;
    if (p < e && *p == '.') {
        p++;
        if (p >= e || !(*p >= '0' && *p <= '9')) return 0;
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e || !(*p >= '0' && *p <= '9')) return 0;
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    ps->p = p;
    return 1;
}

static int skip_value(Parser *ps, int depth) {
    int ch = peek(ps);
    if (depth > 64) return 0;
    switch (ch) {
    case '"': return skip_string(ps);
    case '{':
        ps->p++;
        if (peek(ps) == '}') { ps->p++; return 1; }
        for (;;) {
            if (peek(ps) != '"' || !skip_string(ps) || !expect(ps, ':') || !skip_value(ps, depth + 1)) return 0;
            if (expect(ps, ',')) continue;
            return expect(ps, '}');
        }
    case '[':
        ps->p++;
        if (peek(ps) == ']') { ps->p++; return 1; }
        for (;;) {
            if (!skip_value(ps, depth + 1)) return 0;
            if (expect(ps, ',')) continue;
            return expect(ps, ']');
        }
    case 't': if (ps->end - ps->p >= 4 && !memcmp(ps->p, "true", 4)) { ps->p += 4; return 1; } return 0;
    case 'f': if (ps->end - ps->p >= 5 && !memcmp(ps->p, "false", 5)) { ps->p += 5; return 1; } return 0;
    case 'n': if (ps->end - ps->p >= 4 && !memcmp(ps->p, "null", 4)) { ps->p += 4; return 1; } return 0;
    default:
        if (ch == '-' || (ch >= '0' && ch <= '9')) return skip_number(ps);
        return 0;
    }
}

/* Eight ASCII digits at once (little-endian load), for the long hashes Dynamo sends. */
static inline int eight_digits(uint64_t v) {
    return (((v & 0xF0F0F0F0F0F0F0F0ULL) | (((v + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) >> 4))
            == 0x3333333333333333ULL);
}
static inline uint64_t parse_eight(uint64_t v) {
    v = ((v & 0x0F0F0F0F0F0F0F0FULL) * 2561) >> 8;
    v = ((v & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
    return ((v & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
}

/* A plain unsigned integer that fits 64 bits (no sign, fraction or exponent). */
static int read_u64(Parser *ps, uint64_t *out) {
    ws(ps);
    const unsigned char *p = ps->p, *e = ps->end;
    if (p >= e || !(*p >= '0' && *p <= '9')) return 0;
    uint64_t v = 0;
    if (*p == '0') { p++; }
    else {
        int n = 0;                                   /* digits so far; 19 always fit */
        while (e - p >= 8 && n <= 11) {
            uint64_t w;
            memcpy(&w, p, 8);
            if (!eight_digits(w)) break;
            v = v * 100000000ULL + parse_eight(w);
            p += 8; n += 8;
        }
        while (p < e && *p >= '0' && *p <= '9') {
            uint64_t d = *p - '0';
            if (n >= 19 && (n > 19 || v > 1844674407370955161ULL || (v == 1844674407370955161ULL && d > 5))) return 0;
            v = v * 10 + d;
            p++; n++;
        }
    }
    if (p < e && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9'))) return 0;
    ps->p = p;
    *out = v;
    return 1;
}

static inline int key_is(const unsigned char *k, size_t n, const char *name) {
    return n == strlen(name) && !memcmp(k, name, n);
}

typedef struct {
    uint64_t *v; size_t n, cap; int heap;   /* starts on the caller's stack */
} U64s;

static int push(U64s *a, uint64_t x) {
    if (a->n == a->cap) {
        size_t cap = a->cap * 2;
        uint64_t *v = a->heap ? realloc(a->v, cap * sizeof(uint64_t)) : malloc(cap * sizeof(uint64_t));
        if (!v) return 0;
        if (!a->heap) memcpy(v, a->v, a->n * sizeof(uint64_t));
        a->v = v; a->cap = cap; a->heap = 1;
    }
    a->v[a->n++] = x;
    return 1;
}

/* Members of an object whose keys we read: calls member(key) for each; member returns 0 to fail. */
#define FOR_MEMBERS(ps, KEY, LEN, BODY)                                                    \
    do {                                                                                   \
        if (!expect(ps, '{')) return 0;                                                    \
        if (peek(ps) == '}') { (ps)->p++; break; }                                         \
        for (;;) {                                                                         \
            const unsigned char *KEY; size_t LEN;                                          \
            if (!plain_string(ps, &KEY, &LEN) || !expect(ps, ':')) return 0;               \
            BODY                                                                           \
            if (expect(ps, ',')) continue;                                                 \
            if (!expect(ps, '}')) return 0;                                                \
            break;                                                                         \
        }                                                                                  \
    } while (0)

typedef struct {
    uint64_t worker_id, event_id, parent, dp_rank;
    const unsigned char *tier; size_t tier_len;
    int have_worker, have_tier, have_event, have_event_id, have_data, have_parent_key, has_parent, have_dp_rank;
    int kind;            /* -1 unknown, 0 stored, 1 removed, 2 cleared */
    U64s hashes;         /* stored: seq, local pairs; removed: hashes */
} RouterEvent;

static int parse_block(Parser *ps, RouterEvent *ev) {
    uint64_t bh = 0, th = 0; int hb = 0, ht = 0;
    FOR_MEMBERS(ps, k, n, {
        if (key_is(k, n, "block_hash")) { if (hb++ || !read_u64(ps, &bh)) return 0; }
        else if (key_is(k, n, "tokens_hash")) { if (ht++ || !read_u64(ps, &th)) return 0; }
        else if (!skip_value(ps, 4)) return 0;
    });
    return hb && ht && push(&ev->hashes, bh) && push(&ev->hashes, th);
}

static int parse_stored(Parser *ps, RouterEvent *ev) {
    int have_blocks = 0;
    FOR_MEMBERS(ps, k, n, {
        if (key_is(k, n, "parent_hash")) {
            if (ev->have_parent_key++) return 0;
            if (peek(ps) == 'n') { if (!skip_value(ps, 3)) return 0; }
            else { if (!read_u64(ps, &ev->parent)) return 0; ev->has_parent = 1; }
        } else if (key_is(k, n, "blocks")) {
            if (have_blocks++ || !expect(ps, '[') || peek(ps) == ']') return 0;   /* non-empty */
            for (;;) {
                if (!parse_block(ps, ev)) return 0;
                if (expect(ps, ',')) continue;
                if (!expect(ps, ']')) return 0;
                break;
            }
        } else if (!skip_value(ps, 3)) return 0;
    });
    return have_blocks;
}

static int parse_removed(Parser *ps, RouterEvent *ev) {
    int have = 0;
    FOR_MEMBERS(ps, k, n, {
        if (key_is(k, n, "block_hashes")) {
            if (have++ || !expect(ps, '[')) return 0;
            if (peek(ps) == ']') { ps->p++; }
            else for (;;) {
                uint64_t h;
                if (!read_u64(ps, &h) || !push(&ev->hashes, h)) return 0;
                if (expect(ps, ',')) continue;
                if (!expect(ps, ']')) return 0;
                break;
            }
        } else if (!skip_value(ps, 3)) return 0;
    });
    return have;
}

static int parse_data(Parser *ps, RouterEvent *ev) {
    if (peek(ps) == '"') {
        const unsigned char *s; size_t n;
        if (!plain_string(ps, &s, &n) || !key_is(s, n, "cleared")) return 0;
        ev->kind = 2;
        return 1;
    }
    FOR_MEMBERS(ps, k, n, {
        if (key_is(k, n, "stored")) { if (ev->kind != -1 || !parse_stored(ps, ev)) return 0; ev->kind = 0; }
        else if (key_is(k, n, "removed")) { if (ev->kind != -1 || !parse_removed(ps, ev)) return 0; ev->kind = 1; }
        else if (!skip_value(ps, 2)) return 0;
    });
    return ev->kind != -1;
}

static int parse_inner(Parser *ps, RouterEvent *ev) {
    FOR_MEMBERS(ps, k, n, {
        if (key_is(k, n, "event_id")) { if (ev->have_event_id++ || !read_u64(ps, &ev->event_id)) return 0; }
        else if (key_is(k, n, "data")) { if (ev->have_data++ || !parse_data(ps, ev)) return 0; }
        else if (key_is(k, n, "dp_rank")) {
            if (ev->have_dp_rank++ || !read_u64(ps, &ev->dp_rank) || ev->dp_rank > 0xFFFFFFFFu) return 0;
        }
        else if (!skip_value(ps, 1)) return 0;
    });
    return ev->have_event_id && ev->have_data;
}

static int parse_top(Parser *ps, RouterEvent *ev) {
    FOR_MEMBERS(ps, k, n, {
        if (key_is(k, n, "worker_id")) { if (ev->have_worker++ || !read_u64(ps, &ev->worker_id)) return 0; }
        else if (key_is(k, n, "storage_tier")) { if (ev->have_tier++ || !plain_string(ps, &ev->tier, &ev->tier_len)) return 0; }
        else if (key_is(k, n, "event")) { if (ev->have_event++ || !parse_inner(ps, ev)) return 0; }
        else if (!skip_value(ps, 0)) return 0;
    });
    ws(ps);
    return ps->p == ps->end && ev->have_worker && ev->have_event;
}

static PyObject *parse_router_event(PyObject *mod, PyObject *args) {
    PyObject *data, *cls;
    if (!PyArg_ParseTuple(args, "OO!", &data, &PyType_Type, &cls)) return NULL;
    const unsigned char *buf; Py_ssize_t len;
    if (PyUnicode_Check(data)) {
        buf = (const unsigned char *)PyUnicode_AsUTF8AndSize(data, &len);
        if (!buf) { PyErr_Clear(); Py_RETURN_NONE; }
    } else if (PyBytes_Check(data)) {
        buf = (const unsigned char *)PyBytes_AS_STRING(data); len = PyBytes_GET_SIZE(data);
        for (Py_ssize_t j = 0; j < len; j++) if (buf[j] >= 0x80) Py_RETURN_NONE;
    } else Py_RETURN_NONE;
    uint64_t stackbuf[256];
    RouterEvent ev; memset(&ev, 0, sizeof ev);
    ev.kind = -1;
    ev.hashes.v = stackbuf; ev.hashes.cap = 256;
    Parser ps = {buf, buf + len};
    PyObject *out = NULL;
    int ok = parse_top(&ps, &ev);
    if (!ok) goto none;
    PyObject *payload;
    if (ev.kind == 0) {
        PyTypeObject *tp = (PyTypeObject *)cls;
        size_t nb = ev.hashes.n / 2;
        payload = PyTuple_New((Py_ssize_t)nb);
        if (!payload) goto done;
        for (size_t b = 0; b < nb; b++) {
            PyObject *t = tp->tp_alloc(tp, 3);
            PyObject *x = PyLong_FromUnsignedLongLong(ev.hashes.v[2 * b]);
            PyObject *y = PyLong_FromUnsignedLongLong(ev.hashes.v[2 * b + 1]);
            if (!t || !x || !y) { Py_XDECREF(t); Py_XDECREF(x); Py_XDECREF(y); Py_DECREF(payload); goto done; }
            PyTuple_SET_ITEM(t, 0, x);
            PyTuple_SET_ITEM(t, 1, y);
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(t, 2, Py_None);
            PyTuple_SET_ITEM(payload, (Py_ssize_t)b, t);
        }
    } else if (ev.kind == 1) {
        payload = PyTuple_New((Py_ssize_t)ev.hashes.n);
        if (!payload) goto done;
        for (size_t b = 0; b < ev.hashes.n; b++) {
            PyObject *x = PyLong_FromUnsignedLongLong(ev.hashes.v[b]);
            if (!x) { Py_DECREF(payload); goto done; }
            PyTuple_SET_ITEM(payload, (Py_ssize_t)b, x);
        }
    } else {
        payload = PyTuple_New(0);
        if (!payload) goto done;
    }
    PyObject *tier;
    if (ev.have_tier) tier = PyUnicode_DecodeUTF8((const char *)ev.tier, (Py_ssize_t)ev.tier_len, NULL);
    else { tier = Py_None; Py_INCREF(tier); }
    PyObject *parent;
    if (ev.has_parent) parent = PyLong_FromUnsignedLongLong(ev.parent);
    else { parent = Py_None; Py_INCREF(parent); }
    if (!tier || !parent) { Py_XDECREF(tier); Py_XDECREF(parent); Py_DECREF(payload); goto done; }
    out = Py_BuildValue("(KNKiNNK)", (unsigned long long)ev.worker_id, tier, (unsigned long long)ev.event_id,
                        ev.kind, parent, payload, (unsigned long long)ev.dp_rank);
    goto done;
none:
    out = Py_None; Py_INCREF(out);
done:
    if (ev.hashes.heap) free(ev.hashes.v);
    return out;
}

/* ---- publisher: kvstrata JSON text of items ---------------------------------------------- */
/* encode_message(head, items) -> bytes or None
 *
 * A batch's kvstrata JSON message, head + ",".join(formats.json_event_texts(items)) + "]}", for
 * stored items without tokens and removed items whose fields are exact ints and strs; None for
 * anything else (tokens, cleared, odd types), and the caller uses the Python encoder. */

typedef struct { char *buf; size_t n, cap; } Out;

static int out_grow(Out *o, size_t more) {
    if (o->n + more <= o->cap) return 1;
    size_t cap = o->cap ? o->cap : 4096;
    while (cap < o->n + more) cap *= 2;
    char *b = realloc(o->buf, cap);
    if (!b) return 0;
    o->buf = b; o->cap = cap;
    return 1;
}
static inline int out_raw(Out *o, const char *s, size_t len) {
    if (!out_grow(o, len)) return 0;
    memcpy(o->buf + o->n, s, len); o->n += len;
    return 1;
}
#define OUT_LIT(o, s) out_raw(o, s, sizeof(s) - 1)

static const char digit_pairs[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* Decimal digits of ``x`` written backwards ending at ``end`` (exactly 8, zero-padded, if
 * ``pad8``); returns the first digit's address. 32-bit arithmetic, two digits per step. */
static inline char *u32_digits(uint32_t x, char *end, int pad8) {
    char *p = end;
    if (pad8) {
        for (int i = 0; i < 4; i++) { uint32_t r = x % 100; x /= 100; p -= 2; memcpy(p, digit_pairs + 2 * r, 2); }
        return p;
    }
    while (x >= 100) { uint32_t r = x % 100; x /= 100; p -= 2; memcpy(p, digit_pairs + 2 * r, 2); }
    if (x >= 10) { p -= 2; memcpy(p, digit_pairs + 2 * x, 2); }
    else *--p = (char)('0' + x);
    return p;
}

/* Decimal digits of ``u`` written backwards ending at ``end``, in chunks of 8 digits. */
static char *u64_digits(unsigned long long u, char *end) {
    if (u < 100000000ULL) return u32_digits((uint32_t)u, end, 0);
    char *p = u32_digits((uint32_t)(u % 100000000ULL), end, 1);
    u /= 100000000ULL;
    if (u < 100000000ULL) return u32_digits((uint32_t)u, p, 0);
    p = u32_digits((uint32_t)(u % 100000000ULL), p, 1);
    return u32_digits((uint32_t)(u / 100000000ULL), p, 0);
}

/* An exact int as %d writes it (any size: big ones through PyObject_Str). Block hashes are
 * unsigned 64-bit, so that conversion is tried first; negative ints take the slower path. */
static int out_int(Out *o, PyObject *v) {
    if (!PyLong_CheckExact(v)) return 0;
    char tmp[24]; char *e = tmp + sizeof tmp, *p;
    unsigned long long u;
    if (exact_u64(v, &u)) {            /* straight into the output: no copy of the digits */
        static const unsigned long long pow10[20] = {1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL,
            100000ULL, 1000000ULL, 10000000ULL, 100000000ULL, 1000000000ULL, 10000000000ULL,
            100000000000ULL, 1000000000000ULL, 10000000000000ULL, 100000000000000ULL,
            1000000000000000ULL, 10000000000000000ULL, 100000000000000000ULL,
            1000000000000000000ULL, 10000000000000000000ULL};
        size_t len = 1;
        while (len < 20 && u >= pow10[len]) len++;
        if (!out_grow(o, len)) return 0;
        u64_digits(u, o->buf + o->n + len);
        o->n += len;
        return 1;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (!overflow && !(x == -1 && PyErr_Occurred())) {      /* negative, fits in 64 bits */
        p = u64_digits(0ULL - (unsigned long long)x, e);
        *--p = '-';
        return out_raw(o, p, (size_t)(e - p));
    }
    PyErr_Clear();
    PyObject *s = PyObject_Str(v);
    if (!s) { PyErr_Clear(); return 0; }
    Py_ssize_t len; const char *c = PyUnicode_AsUTF8AndSize(s, &len);
    int ok = c && out_raw(o, c, (size_t)len);
    Py_DECREF(s);
    return ok;
}

/* A str as %s writes it (ASCII only here: anything else goes to the Python encoder). */
static int out_str(Out *o, PyObject *v) {
    if (!PyUnicode_CheckExact(v) || !PyUnicode_IS_ASCII(v)) return 0;
    return out_raw(o, (const char *)PyUnicode_1BYTE_DATA(v), (size_t)PyUnicode_GET_LENGTH(v));
}

/* %s of an int or a str (a stored item's parent: a hash or "null") */
static int out_int_or_str(Out *o, PyObject *v) {
    return PyLong_CheckExact(v) ? out_int(o, v) : out_str(o, v);
}

static int out_hashes(Out *o, PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j && !OUT_LIT(o, ",")) return 0;
        if (!out_int(o, items[j])) return 0;
    }
    return 1;
}

/* The events of ``items`` as comma-separated kvstrata JSON appended to ``o``: 1, or 0 for
 * anything left to the Python encoder. */
static int write_events(Out *o, PyObject *items) {
    if (!PyList_Check(items)) return 0;
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *it = PyList_GET_ITEM(items, j);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) < 4) return 0;
        PyObject **f = &PyTuple_GET_ITEM(it, 0);
        Py_ssize_t len = PyTuple_GET_SIZE(it);
        if (!PyLong_CheckExact(f[1])) return 0;
        long kind = PyLong_AsLong(f[1]);
        if (j && !OUT_LIT(o, ",")) return 0;
        if (kind == 0) {
            if (len < 9 || (len - 7) % 2 || f[6] != Py_None) return 0;
            Py_ssize_t nb = (len - 7) / 2;
            if (!OUT_LIT(o, "{\"type\":\"stored\",\"event_id\":") || !out_int(o, f[0])
                || !OUT_LIT(o, ",\"tier\":\"") || !out_str(o, f[2])
                || !OUT_LIT(o, "\",\"ts\":") || !out_str(o, f[3])
                || !OUT_LIT(o, ",\"parent_hash\":") || !out_int_or_str(o, f[4])
                || !OUT_LIT(o, ",\"block_size\":") || !out_int(o, f[5])
                || !OUT_LIT(o, ",\"block_hashes\":[") || !out_hashes(o, f + 7, nb)
                || !OUT_LIT(o, "],\"tokens_hashes\":[") || !out_hashes(o, f + 7 + nb, nb)
                || !OUT_LIT(o, "]}")) return 0;
        } else if (kind == 1) {
            if (!OUT_LIT(o, "{\"type\":\"removed\",\"event_id\":") || !out_int(o, f[0])
                || !OUT_LIT(o, ",\"tier\":\"") || !out_str(o, f[2])
                || !OUT_LIT(o, "\",\"ts\":") || !out_str(o, f[3])
                || !OUT_LIT(o, ",\"block_hashes\":[") || !out_hashes(o, f + 4, len - 4)
                || !OUT_LIT(o, "]}")) return 0;
        } else return 0;
    }
    return 1;
}

/* One output buffer reused from call to call (these calls never let go of the GIL): fresh
 * pages for every batch were an eighth of the encoding time. Kept up to KEPT_OUT bytes. */
static Out shared_out = {NULL, 0, 0};
#define KEPT_OUT ((size_t)8 << 20)

static void give_back(Out *o) {
    if (o->cap > KEPT_OUT) { free(o->buf); o->buf = NULL; o->cap = 0; }
    o->n = 0;
    shared_out = *o;
}

/* encode_message(head, items) -> bytes or None: (head + ",".join(json_event_texts(items)) +
 * "]}").encode(), ``head`` an ASCII str (the batch's head, formats._batch_head) */
static PyObject *encode_message(PyObject *mod, PyObject *args) {
    PyObject *head, *items;
    if (!PyArg_ParseTuple(args, "UO", &head, &items)) return NULL;
    Out o = shared_out;
    o.n = 0;
    PyObject *res = NULL;
    if (out_str(&o, head) && write_events(&o, items) && OUT_LIT(&o, "]}"))
        res = PyBytes_FromStringAndSize(o.buf, (Py_ssize_t)o.n);
    else if (PyErr_Occurred()) PyErr_Clear();
    give_back(&o);
    if (res || PyErr_Occurred()) return res;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"encode_message", encode_message, METH_VARARGS, "encode_message(head, items) -> (head + the items' kvstrata JSON events, comma-separated, + ']}').encode(), or None"},
    {"parse_router_event", parse_router_event, METH_VARARGS, "parse_router_event(data, cls) -> (worker_id, storage_tier, event_id, kind, parent, payload) or None"},
    {"stored_blocks", stored_blocks, METH_VARARGS, "stored_blocks(structs, cls) -> tuple of cls(block_hash, tokens_hash, None) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Native prefix-tree core of kvstrata's indexer.", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_tokens_hash = PyUnicode_InternFromString("tokens_hash");
    if (!str_block_hash || !str_tokens_hash) return NULL;
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) { Py_DECREF(&CoreType); Py_DECREF(m); return NULL; }
    return m;
}
