"""``kvstrata indexer``: the storage-provider side of the event plane.

(Nearly 700 lines on purpose: one concern, the ``kvstrata indexer`` tool: the prefix tree (with
its pure-Python core, the native core's reference), its queries, and the HTTP server and
command line that serve them.)

It follows one or more workers' event streams (NATS, a JSON-lines file, or in-process) and keeps
a prefix tree of which blocks are live in which tier of which worker. Nodes are keyed by
sequence hash and linked to their parent; each node's children are keyed by local (tokens)
hash, so a prefix can be walked from the root either way. A node lists its holders, the
(worker, tier) pairs it is live in; it disappears when it has neither holders nor children.

Queries answer "for these hashes, how long a prefix is cached, and where":
``match(hashes)`` -> per engine, per tier, the number of leading hashes held there. An engine
is a worker's data-parallel rank; it is named by its worker id, or ``(worker id, dp rank)``
for a rank above 0 (:func:`~kvstrata.events.subscriber.engine_key`).

HTTP (stdlib ``http.server``, JSON), answered only to a request carrying
``Authorization: Bearer TOKEN``, the token derived from the deployment's secret
(:func:`http_token`; ``kvstrata indexer --print-token``), else 401: what a worker caches
tells what its users asked, so it is told to no one who cannot show the deployment's secret.

* ``POST /match`` ``{"hashes": [SEQ, ...]}`` or ``{"local_hashes": [LOCAL, ...]}`` ->
  ``{"length": N, "matches": [{"worker_id": W, "tier": "G2", "prefix": K}, ...], "best": {...}}``
  (an engine of data-parallel rank R > 0 also has ``"dp_rank": R``)
* ``GET /stats`` -> node, worker, tier counts and stream follower counters.
* ``GET /healthz`` -> ``{"ok": true}``, to anyone (it tells nothing else).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Iterable, Mapping, Sequence

from kvstrata.httpserve import (HEADER_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST,
                                READ_TIMEOUT, REQUEST_TIMEOUT, BoundedHTTPServer,
                                BoundedRequestHandler)
from kvstrata.secret import SECRET_ENV, SECRET_FILE_ENV, SecretError, derive_key, resolve_secret
from kvstrata.events.model import (
    ClearedEvent,
    Event,
    RemovedEvent,
    StoredEvent,
)
from kvstrata.events.subscriber import StreamFollower, engine_key, split_engine
from kvstrata.tiers import TIER_NAMES

log = logging.getLogger(__name__)

Holder = tuple[object, str]  # (engine_key(worker_id, dp_rank), tier)


class _Node:
    __slots__ = ("seq_hash", "local_hash", "parent", "children", "nkids", "holders", "up")

    def __init__(self, seq_hash: int | None, local_hash: int | None, parent: "_Node | None") -> None:
        self.seq_hash = seq_hash
        self.local_hash = local_hash
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.nkids = 0  # live nodes whose parent is this one (>= len(children))
        self.holders: set[int] = set()
        self.up: _Node | None = None  # an ancestor nearer the top: a shortcut of _top


class _PyCore:
    """The prefix tree in pure Python: the reference the native core (``_native.c``) is
    tested against, and the fallback when it is not built. Holders are small ints (the
    index interns (worker, tier) pairs). Same methods and answers as ``_native.Core``."""

    def __init__(self) -> None:
        self._root = _Node(None, None, None)
        self._nodes: dict[int, _Node] = {}
        self._held: dict[int, set[int]] = {}

    def store(self, holder: int, parent_hash: int | None, blocks) -> None:
        held = self._held.setdefault(holder, set())
        nodes = self._nodes
        for block in blocks:
            seq_hash = block[0]
            node = nodes.get(seq_hash)
            if node is None or node.parent is None:
                node = self._node_for(seq_hash, block[1], parent_hash)
            node.holders.add(holder)
            held.add(seq_hash)
            parent_hash = seq_hash

    def _node_for(self, seq_hash: int, local_hash: int, parent_hash: int | None) -> _Node:
        node = self._nodes.get(seq_hash)
        if node is None:
            node = self._nodes[seq_hash] = _Node(seq_hash, None, None)
        if node.parent is None:  # new, or a placeholder created for an orphan child
            if parent_hash is None:
                parent = self._root
            else:
                parent = self._nodes.get(parent_hash)
                if parent is None:  # child arrived before (or without) its parent: placeholder
                    parent = self._nodes[parent_hash] = _Node(parent_hash, None, None)
                elif parent is node or (node.nkids and _top(parent) is node):
                    # A link that closes a cycle (a block its own ancestor: no real chain
                    # does that) is not made: the nodes of a cycle would each keep the other
                    # alive, and nothing could ever remove them. Only a node with children
                    # can be an ancestor of the new parent (a new node has none, so storing
                    # a chain costs no look-up).
                    return node
            node.parent = parent
            node.local_hash = local_hash
            parent.children[local_hash] = node
            parent.nkids += 1
        return node

    def remove(self, holder: int, hashes) -> None:
        held = self._held.get(holder)
        for h in hashes:
            self._drop(holder, h)
            if held is not None:
                held.discard(h)

    def clear(self, holder: int) -> None:
        for h in self._held.pop(holder, set()):
            self._drop(holder, h)

    def _drop(self, holder: int, seq_hash: int) -> None:
        node = self._nodes.get(seq_hash)
        if node is None:
            return
        node.holders.discard(holder)
        while node is not None and node is not self._root and not node.holders and not node.nkids:
            del self._nodes[node.seq_hash]
            parent = node.parent
            if parent is not None:
                if parent.children.get(node.local_hash) is node:
                    del parent.children[node.local_hash]
                parent.nkids -= 1
            node = parent

    def match(self, hashes: Sequence[int], holders: list[Holder]) -> dict[int, dict[str, int]]:
        runs: dict[int, int] = {}
        nodes = self._nodes
        for i, h in enumerate(hashes):
            node = nodes.get(h)
            if node is None:
                break
            alive = False
            if i == 0:
                for key in node.holders:
                    runs[key] = 1
                    alive = True
            else:
                for key in node.holders:
                    if runs.get(key) == i:
                        runs[key] = i + 1
                        alive = True
            if not alive:
                break
        return _by_worker(runs, holders)

    def match_local(self, local_hashes: Sequence[int], holders: list[Holder]) -> dict[int, dict[str, int]]:
        runs: dict[int, int] = {}
        node = self._root
        for i, lh in enumerate(local_hashes):
            node = node.children.get(lh)
            if node is None:
                break
            alive = False
            for key in node.holders:
                if runs.get(key, 0) == i:
                    runs[key] = i + 1
                    alive = True
            if not alive:
                break
        return _by_worker(runs, holders)

    def hashes_in(self, holder: int) -> set[int]:
        return set(self._held.get(holder, ()))

    def count(self, holder: int) -> int:
        return len(self._held.get(holder, ()))

    def nodes(self) -> int:
        return len(self._nodes)


def _top(node: _Node) -> _Node:
    """The top of ``node``'s tree: the root, or the placeholder (not linked yet) its chain of
    parents ends at, ``node`` itself if it is one. Every node passed on the way keeps the top
    as its shortcut (path compression: a chain is walked once, not at every link). A shortcut
    stays true: a node's parent never changes, and its ancestors live as long as it does."""
    top = node
    while (above := top.up or top.parent) is not None:
        top = above
    while node is not top:
        above = node.up or node.parent
        node.up = top
        node = above
    return top


def _by_worker(runs: dict[int, int], holders: list[Holder]) -> dict:
    out: dict[int, dict[str, int]] = {}
    for hid, n in runs.items():
        if n:
            w, t = holders[hid]
            out.setdefault(w, {})[t] = n
    return out


def _native_core():
    """The native core's class, or None when the extension is not built (or disabled with
    ``KVSTRATA_NATIVE_EVENTS=0``)."""
    if os.environ.get("KVSTRATA_NATIVE_EVENTS", "1") == "0":
        return None
    try:
        from kvstrata.events._native import Core
    except ImportError:
        return None
    return Core


NATIVE_CORE = _native_core()
"""``kvstrata.events._native.Core`` when built (``pip install -e .``), else None."""


class PrefixIndex:
    """Which blocks each (worker, tier) holds, as a tree of chained block hashes.

    Thread-safe: updates (from a follower) and queries (from HTTP threads) take one lock.
    Implements the follower target interface (``apply_event``, ``reset_worker``).

    ``native``: None (default) uses the C core when it is built, else the pure-Python one;
    True requires the C core; False forces Python. Both give the same answers (the same
    tests run on both); the C core keeps a node in ~55 bytes instead of ~700 and requires
    hashes to be unsigned 64-bit integers (``ValueError`` otherwise, before any change).
    """

    def __init__(self, native: bool | None = None) -> None:
        if native and NATIVE_CORE is None:
            raise RuntimeError("the native indexer core (kvstrata.events._native) is not built")
        self.native = NATIVE_CORE is not None and native is not False
        self._core = NATIVE_CORE() if self.native else _PyCore()
        self._holder_ids: dict[Holder, int] = {}
        self._holders: list[Holder] = []
        self._engine_holders: dict[object, list[int]] = {}   # engine key -> its holder ids
        self._lock = threading.RLock()
        self.events_applied = 0

    def _holder(self, key: Holder) -> int:
        hid = self._holder_ids.get(key)
        if hid is None:
            hid = self._holder_ids[key] = len(self._holders)
            self._holders.append(key)
            self._engine_holders.setdefault(key[0], []).append(hid)
        return hid

    # -- updates -----------------------------------------------------------------------------
    def apply_event(self, worker_id: int, event: Event, dp_rank: int = 0) -> None:
        """Apply one event of worker ``worker_id``'s engine of data-parallel rank ``dp_rank``."""
        with self._lock:
            self.events_applied += 1
            key = ((worker_id, dp_rank) if dp_rank else worker_id, event.tier)  # engine_key
            hid = self._holder_ids.get(key)
            if hid is None:
                hid = self._holder(key)
            kind = type(event)
            if kind is StoredEvent:
                self._core.store(hid, event.parent_hash, event.blocks)
            elif kind is RemovedEvent:
                self._core.remove(hid, event.block_hashes)
            elif kind is ClearedEvent:
                self._core.clear(hid)
            elif isinstance(event, StoredEvent):
                self._core.store(hid, event.parent_hash, event.blocks)
            elif isinstance(event, RemovedEvent):
                self._core.remove(hid, event.block_hashes)
            elif isinstance(event, ClearedEvent):
                self._core.clear(hid)

    def reset_worker(self, worker_id: int, dp_rank: int = 0) -> None:
        """Drop everything engine ``dp_rank`` of ``worker_id`` holds (its other engines keep
        theirs)."""
        with self._lock:
            for hid in self._engine_holders.get(engine_key(worker_id, dp_rank), ()):
                self._core.clear(hid)

    def apply_events(self, worker_id: int, events: Iterable[Event], dp_rank: int = 0) -> "PrefixIndex":
        for event in events:
            self.apply_event(worker_id, event, dp_rank)
        return self

    # -- queries -----------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict:
        """engine -> tier -> number of leading ``hashes`` (sequence hashes) held there; an
        engine is its worker id, or ``(worker id, dp rank)`` for a data-parallel rank above 0."""
        with self._lock:
            return self._core.match(hashes, self._holders)

    def match_local(self, local_hashes: Sequence[int]) -> dict:
        """Like :meth:`match` but walking from the root by local (tokens) hashes."""
        with self._lock:
            return self._core.match_local(local_hashes, self._holders)

    def hashes_in(self, worker_id: int, tier: str, dp_rank: int = 0) -> set[int]:
        with self._lock:
            hid = self._holder_ids.get((engine_key(worker_id, dp_rank), tier))
            return set() if hid is None else self._core.hashes_in(hid)

    def _counts(self) -> list[tuple[int, int, str, int]]:
        """(worker, dp rank, tier, blocks held) of the holders holding any, sorted."""
        core = self._core
        return sorted((*split_engine(key), tier, n)
                      for hid, (key, tier) in enumerate(self._holders) if (n := core.count(hid)))

    def workers(self) -> list[int]:
        with self._lock:
            return sorted({w for w, _dp, _t, _n in self._counts()})

    def stats(self) -> dict:
        """Node count, and blocks held per worker and tier (``blocks``: a worker's engines
        summed; ``blocks_by_dp_rank``: per engine)."""
        with self._lock:
            blocks: dict[str, dict[str, int]] = {}
            by_rank: dict[str, dict[str, dict[str, int]]] = {}
            for w, dp, t, n in self._counts():
                tiers = blocks.setdefault(str(w), {})
                tiers[t] = tiers.get(t, 0) + n
                by_rank.setdefault(str(w), {}).setdefault(str(dp), {})[t] = n
            return {
                "nodes": self._core.nodes(),
                "workers": len(blocks),
                "blocks": blocks,
                "blocks_by_dp_rank": by_rank,
                "events_applied": self.events_applied,
            }

    def compare_with_registry(self, registry, worker_id: int, tiers: Sequence[str] = TIER_NAMES,
                              dp_rank: int = 0) -> dict[str, dict]:
        """Per tier, differences between this index (for ``worker_id``'s engine ``dp_rank``)
        and a :class:`~kvstrata.logical.registry.BlockRegistry`; empty dict means identical."""
        diffs = {}
        for tier in tiers:
            ours = self.hashes_in(worker_id, tier, dp_rank)
            theirs = registry.hashes_in(tier)
            if ours != theirs:
                diffs[tier] = {
                    "missing": len(theirs - ours),
                    "extra": len(ours - theirs),
                    "index": len(ours),
                    "registry": len(theirs),
                }
        return diffs


def build_index(events: Iterable[Event], worker_id: int = 0) -> PrefixIndex:
    """An index from one worker's events (applied in order, as given)."""
    return PrefixIndex().apply_events(worker_id, events)


def match_response(index: PrefixIndex, hashes: Sequence[int], local: bool = False) -> dict:
    """The JSON answer of ``/match`` and ``--query``. A match of a data-parallel engine of
    rank R > 0 carries ``"dp_rank": R`` after its ``worker_id`` (rank 0, and a worker
    without data parallelism, carries none: answers read as before); ``per_worker`` is a
    worker's longest prefix over all its engines and tiers."""
    result = index.match_local(hashes) if local else index.match(hashes)
    matches = []
    per_worker: dict[str, int] = {}
    for (w, dp), tiers in sorted((split_engine(key), tiers) for key, tiers in result.items()):
        engine = {"worker_id": w, "dp_rank": dp} if dp else {"worker_id": w}
        matches.extend({**engine, "tier": t, "prefix": n} for t, n in sorted(tiers.items()))
        per_worker[str(w)] = max(per_worker.get(str(w), 0), *tiers.values())
    best = max(matches, key=lambda m: (m["prefix"], -TIER_NAMES.index(m["tier"])), default=None)
    return {"length": len(hashes), "matches": matches, "best": best, "per_worker": per_worker}


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


MAX_MATCH_HASHES = 1 << 20
"""Most hashes one query may hold (a prompt of a million blocks is far past any context)."""

_HASH_TEXT = re.compile(r"[^,\s]+")


def _parse_hash_list(value, name: str) -> list[int]:
    """A list of hashes (unsigned 64-bit integers, or their decimal or hex strings), or one
    string of them separated by commas or spaces; at most :data:`MAX_MATCH_HASHES`, counted
    as they are read (a string is never split whole). ``ValueError`` naming what is wrong."""
    if isinstance(value, str):
        value = (m.group() for m in _HASH_TEXT.finditer(value))
    elif not isinstance(value, list):
        raise ValueError(f"{name!r} must be a list of integers")
    elif len(value) > MAX_MATCH_HASHES:
        raise ValueError(f"{name!r}: more than {MAX_MATCH_HASHES:,} hashes")
    out = []
    for v in value:
        if len(out) == MAX_MATCH_HASHES:
            raise ValueError(f"{name!r}: more than {MAX_MATCH_HASHES:,} hashes")
        try:
            h = int(v, 0) if isinstance(v, str) else v
        except ValueError:
            raise ValueError(f"{name!r}: {v!r} is not an integer") from None
        if type(h) is not int or not 0 <= h < 2**64:
            raise ValueError(f"{name!r}: {v!r} is not an unsigned 64-bit integer")
        out.append(h)
    return out


MAX_BODY_BYTES = 8 << 20
"""Largest /match body accepted: 8 MiB, some 380,000 hashes written in full (20 digits),
a prompt of 6 million tokens in blocks of 16, or a million short ones. (It was 16 MiB; the
bodies being read are held whole, one per connection.)"""

def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body, bounded: a ``Content-Length`` that is missing, negative, not a
    number or over :data:`MAX_BODY_BYTES`, a body shorter than it, or a ``Transfer-Encoding``
    (bodies are read by their length only) is a ``ValueError``; nothing past the length is
    read."""
    if handler.headers.get("Transfer-Encoding") is not None:
        raise ValueError("Transfer-Encoding is not accepted; send a Content-Length")
    text = handler.headers.get("Content-Length")
    if text is None:
        raise ValueError("Content-Length is required")
    try:
        length = int(text)
    except ValueError:
        raise ValueError(f"Content-Length {text!r} is not a number") from None
    if not 0 <= length <= MAX_BODY_BYTES:
        raise ValueError(f"Content-Length {length} is outside 0..{MAX_BODY_BYTES}")
    try:
        body = handler.rfile.read(length)
    except OSError:                                  # timeout: the client stalled
        raise ValueError(f"body shorter than its Content-Length {length}") from None
    if len(body) != length:
        raise ValueError(f"body of {len(body)} bytes, Content-Length says {length}")
    return body


MAX_BODY_COMMAS = MAX_MATCH_HASHES + 1024
"""Commas a /match body may hold, counted before it is parsed: a JSON list of n values has
n - 1, so this bounds how many values parsing builds (8 MiB of ``[],`` would be 2.8 million
lists, some 150 MiB)."""


def _parse_body(body: bytes) -> dict:
    if body.count(b",") > MAX_BODY_COMMAS:
        raise ValueError(f"body holds more than {MAX_BODY_COMMAS:,} commas: a query holds at "
                         f"most {MAX_MATCH_HASHES:,} hashes")
    try:
        doc = json.loads(body or b"{}")
    except RecursionError:
        raise ValueError("body nests too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("body must be a JSON object")
    return doc


MATCH_GATE_BYTES = 64 << 10
MATCH_CONCURRENCY = 2
"""A /match body over :data:`MATCH_GATE_BYTES` is parsed and matched by at most
:data:`MATCH_CONCURRENCY` requests at once (the others wait their turn; 503 a second before
their request's deadline): parsing a body takes about 6 times its size (a 16 MiB body peaked at
98 MiB, 8 of them at once at 515 MiB). Smaller bodies, a prompt of up to ~3,000 hashes,
never wait."""


class _Gate:
    """At most ``n`` holders at once; ``waiting`` and ``held`` say how many wait and hold."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self.limit = n
        self.held = 0
        self.waiting = 0

    def acquire(self, timeout: float) -> bool:
        with self._cond:
            self.waiting += 1
            try:
                if not self._cond.wait_for(lambda: self.held < self.limit, timeout):
                    return False
            finally:
                self.waiting -= 1
            self.held += 1
            return True

    def release(self) -> None:
        with self._cond:
            self.held -= 1
            self._cond.notify()


HTTP_TOKEN_PURPOSE = "kvstrata 2026-11-28 indexer http bearer token v1"
"""The context string of the indexer's HTTP token (:func:`~kvstrata.secret.derive_key`)."""


class IndexerSecretError(ValueError):
    """The indexer's HTTP was asked for without the deployment's secret (or with an
    unusable one)."""


def http_token(secret: bytes | str | None = None,
               env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token the indexer's ``/match`` and ``/stats`` require: 64 hex digits
    derived from the deployment's secret (``secret``, else ``$KVSTRATA_SHARING_SECRET``, else
    the file ``$KVSTRATA_SHARING_SECRET_FILE``); None when there is none.
    :class:`~kvstrata.secret.SecretError` when it is unusable."""
    found = resolve_secret(secret, env=env)
    return None if found is None else derive_key(found, HTTP_TOKEN_PURPOSE).hex()


def _bearer_matches(expected: bytes, given: list[str]) -> bool:
    """Whether the ``Authorization`` headers ``given`` are one, ``Bearer`` ``expected``
    (compared in constant time)."""
    if len(given) != 1:
        return False
    scheme, _, value = given[0].strip().partition(" ")
    offered = value.strip().encode("latin-1", "replace")
    return hmac.compare_digest(expected, offered) and scheme.lower() == "bearer"


class IndexServer:
    """A small HTTP server over a :class:`PrefixIndex` (POST /match, GET /stats, GET
    /healthz). /match and /stats answer only a request with ``Authorization: Bearer
    TOKEN``, :func:`http_token` of ``secret`` (default: the deployment's, from the
    environment), else 401; without a secret the server is not made
    (:class:`IndexerSecretError`). Reads are bounded in size and time: each read waits at
    most ``read_timeout``, a request's line and headers must come within
    ``header_timeout`` and the whole within ``request_timeout`` however slowly its bytes
    come, and at most ``max_connections`` are served at once (a thread each),
    ``max_connections_per_host`` from one client (see :mod:`kvstrata.httpserve`). Every
    malformed request is answered 400."""

    def __init__(self, index: PrefixIndex, host: str = "127.0.0.1", port: int = 0,
                 follower: StreamFollower | None = None,
                 read_timeout: float = READ_TIMEOUT,
                 request_timeout: float = REQUEST_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, *,
                 secret: bytes | str | None = None,
                 header_timeout: float = HEADER_TIMEOUT,
                 max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST) -> None:
        try:
            token = http_token(secret)
        except SecretError as exc:
            raise IndexerSecretError(f"the indexer's HTTP: {exc}") from None
        if token is None:
            raise IndexerSecretError(
                f"the indexer's HTTP needs the deployment's secret (${SECRET_ENV}, or a file "
                f"of the running user's named by ${SECRET_FILE_ENV}): /match and /stats "
                f"answer only a bearer token derived from it")
        self.token = token
        self.index = index
        self.follower = follower
        self.match_gate = _Gate(MATCH_CONCURRENCY)
        expected = token.encode()
        outer = self

        class Handler(BoundedRequestHandler):
            timeout = read_timeout               # for each read; the request has a deadline

            def log_message(self, fmt, *args):  # quiet
                log.debug("http: " + fmt, *args)

            def _reply(self, code: int, obj, headers: dict[str, str] | None = None) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                """Whether the request carries the token; if not, it is answered 401 (its
                body read only if small, never parsed) and its connection closed."""
                if _bearer_matches(expected, self.headers.get_all("Authorization") or []):
                    return True
                self.close_connection = True
                self._discard_small_body()
                self._reply(401, {"error": "send Authorization: Bearer TOKEN, the token "
                                           "`kvstrata indexer --print-token` prints"},
                            {"WWW-Authenticate": 'Bearer realm="kvstrata indexer"',
                             "Connection": "close"})
                return False

            def _discard_small_body(self) -> None:
                """Drop what has already arrived of a small body the request will not be
                answered for (so that closing the connection rarely resets it before the
                client reads the answer), never waiting for more: a client without the
                token must not hold a connection, which once its headers are in is no
                longer one the server closes to make room."""
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    return
                if 0 < length <= MATCH_GATE_BYTES and "Transfer-Encoding" not in self.headers:
                    timeout = self.connection.gettimeout()
                    try:
                        self.connection.settimeout(0.0)
                        self.rfile.read1(length)
                    except (OSError, ValueError):
                        pass
                    finally:
                        self.connection.settimeout(timeout)

            def do_GET(self):
                path = self.path.rstrip("/")
                if path in ("", "/healthz"):
                    self._reply(200, {"ok": True})
                elif path == "/stats":
                    if not self._authorized():
                        return
                    stats = outer.index.stats()
                    if outer.follower is not None:
                        stats["stream"] = outer.follower.stats()
                    self._reply(200, stats)
                else:
                    self._reply(404, {"error": "no such path; use POST /match or GET /stats"})

            def do_POST(self):
                if self.path.rstrip("/") != "/match":
                    self.close_connection = True
                    self._reply(404, {"error": "no such path; use POST /match"})
                    return
                if not self._authorized():
                    return
                try:
                    body = _read_body(self)
                except ValueError as exc:
                    self.close_connection = True
                    self._reply(400, {"error": str(exc)})
                    return
                gated = len(body) > MATCH_GATE_BYTES
                # wait no later than a second before the request's deadline, to say why
                if gated and not outer.match_gate.acquire(
                        timeout=max(self._request_due - time.monotonic() - 1.0, 0.0)):
                    self.close_connection = True
                    self._reply(503, {"error": "busy: too many large queries at once"})
                    return
                try:
                    answer = self._match(body)
                finally:
                    if gated:
                        outer.match_gate.release()
                self._reply(*answer)

            def _match(self, raw: bytes) -> tuple[int, dict]:
                try:
                    body = _parse_body(raw)
                    if "hashes" in body:
                        hashes, local = _parse_hash_list(body.pop("hashes"), "hashes"), False
                    elif "local_hashes" in body:
                        hashes, local = _parse_hash_list(body.pop("local_hashes"),
                                                         "local_hashes"), True
                    else:
                        raise ValueError('body needs "hashes" (sequence hashes) or "local_hashes"')
                except ValueError as exc:
                    self.close_connection = True
                    return 400, {"error": str(exc)}
                return 200, match_response(outer.index, hashes, local)

        self.httpd = BoundedHTTPServer((host, port), Handler, max_connections=max_connections,
                                       max_connections_per_host=max_connections_per_host,
                                       header_timeout=header_timeout,
                                       request_timeout=request_timeout)

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    def start(self) -> "IndexServer":
        self.httpd.start("kvstrata-indexer-http")
        return self

    def close(self) -> None:
        self.httpd.close()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    if not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0..65535")
    return host or "127.0.0.1", int(port)


def _worker_id(value: str) -> int:
    try:
        worker = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a worker id, got {value!r:.40}") from None
    if not 0 <= worker < 1 << 64:
        raise argparse.ArgumentTypeError(f"a worker id is in 0..2^64-1, got {value:.40}")
    return worker


def _worker_list(value: str) -> frozenset[int]:
    try:
        ids = frozenset(int(v) for v in value.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker ids like 1,2,3, got {value!r}") from None
    if not ids or min(ids) < 0 or max(ids) >= 1 << 64:
        raise argparse.ArgumentTypeError(f"expected worker ids in 0..2^64-1 (an event's worker "
                                         f"id is u64), got {value!r:.80}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    from kvstrata.cliparse import OneLineParser

    p = OneLineParser(
        prog="kvstrata indexer",
        description="Follow kvstrata/Dynamo KV event streams and answer prefix-cache queries.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--nats", metavar="URL", help="follow a NATS server, e.g. nats://127.0.0.1:4222")
    src.add_argument("--file", metavar="PATH", action="append", help="read a JSON-lines event file (repeatable)")
    src.add_argument("--print-token", action="store_true",
                     help="print the bearer token --http requires of /match and /stats "
                     f"(derived from the deployment's secret, ${SECRET_ENV}) and exit")
    p.add_argument("--subject", default="kvstrata.events", help="NATS subject (default: %(default)s)")
    p.add_argument("--format", choices=("auto", "kvstrata", "dynamo"), default="auto", help="event format (default: auto)")
    p.add_argument("--jetstream", action="store_true", help="replay the JetStream stream from its start")
    p.add_argument("--http", metavar="HOST:PORT", type=_host_port,
                   help="serve POST /match and GET /stats to requests bearing the token "
                   f"(--print-token); needs the deployment's secret (${SECRET_ENV} or "
                   f"${SECRET_FILE_ENV})")
    p.add_argument("--query", metavar="H1,H2,...", help="print the prefix match for these sequence hashes and exit")
    p.add_argument("--local", action="store_true", help="--query hashes are local (tokens) hashes")
    p.add_argument("--worker-id", type=_worker_id, default=None,
                   help="with --file: override the worker id of every event (0..2^64-1)")
    p.add_argument("--per-worker", action="store_true",
                   help="follow SUBJECT.worker.* and take worker W's events from "
                   "SUBJECT.worker.W only (sinks with per_worker=1; core NATS)")
    p.add_argument("--trust-workers", metavar="W1,W2,...", type=_worker_list, default=None,
                   help="apply events of these worker ids only; others are dropped and "
                   "counted (stats: stream.untrusted). --subject is followed exactly")
    return p


def _secret_for_http(flag: str) -> bytes | None:
    """The deployment's secret for the HTTP token, or None having said on stderr, in one
    line, why there is none to use."""
    try:
        secret = resolve_secret()
    except SecretError as exc:
        print(f"kvstrata indexer: {flag}: {exc}", file=sys.stderr)
        return None
    if secret is None:
        print(f"kvstrata indexer: {flag} needs the deployment's secret: set ${SECRET_ENV} "
              f"(e.g. `openssl rand -hex 32`) or ${SECRET_FILE_ENV}; /match and /stats "
              f"answer only a bearer token derived from it", file=sys.stderr)
    return secret


def _say_serving(server: IndexServer) -> None:
    """Say where the server is (the last line said at start: readiness), after a warning if
    other machines can reach it."""
    host, port = server.address[:2]
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host == "localhost"
    if not local:
        print(f"kvstrata indexer: warning: --http {host} is reachable from other machines "
              f"and HTTP is not encrypted: the bearer token crosses the network in clear "
              f"(bind 127.0.0.1, or put a TLS proxy in front)", file=sys.stderr, flush=True)
    print(f"kvstrata indexer: serving http://{host}:{port}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvstrata indexer``; returns the exit status."""
    args = build_parser().parse_args(argv)
    secret = None
    if args.print_token or args.http:
        secret = _secret_for_http("--print-token" if args.print_token else "--http")
        if secret is None:
            return 2
        if args.print_token:
            print(http_token(secret))
            return 0
    index = PrefixIndex()
    if args.query is not None:
        try:
            query = _parse_hash_list(args.query, "--query")
        except ValueError as exc:
            print(f"kvstrata indexer: {exc}", file=sys.stderr)
            return 2
    if args.file:
        from kvstrata.events.model import EventFormatError
        from kvstrata.events.subscriber import read_events_file

        follower = StreamFollower(index, snapshots=False, trusted_workers=args.trust_workers)
        path = None
        try:
            for path in args.file:
                for wid, pid, event, dp_rank in read_events_file(path, args.format, with_rank=True):
                    if args.worker_id is not None:
                        wid = args.worker_id
                    follower.feed(wid, pid, [event], dp_rank)
        except OSError as exc:
            print(f"kvstrata indexer: --file {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except UnicodeDecodeError:
            print(f"kvstrata indexer: --file {path}: not a text event file", file=sys.stderr)
            return 2
        except EventFormatError as exc:
            print(f"kvstrata indexer: --file {path}: {exc}", file=sys.stderr)
            return 2
        if args.query is not None:
            print(json.dumps(match_response(index, query, args.local)))
            if not args.http:
                return 0
        if not args.http:
            print(json.dumps({**index.stats(), "stream": follower.stats()}))
            return 0
        try:
            server = IndexServer(index, *args.http, follower=follower, secret=secret).start()
        except OSError as exc:           # busy port, an address not on this machine
            print(f"kvstrata indexer: --http {args.http[0]}:{args.http[1]}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 2
        _say_serving(server)
        try:
            threading.Event().wait()     # until a signal: the CLI says which (exit 143 / 130)
        finally:
            server.close()

    from kvstrata.redact import redacted
    from kvstrata.events.spec import SinkSpecError, nats_url_parts
    from kvstrata.events.subscriber import NatsFollower

    try:
        nats_url_parts(args.nats, f"--nats {redacted(args.nats)!r:.80}")
    except SinkSpecError as exc:
        print(f"kvstrata indexer: {exc}", file=sys.stderr)
        return 2
    fmt = "kvstrata" if args.format == "auto" else args.format
    if args.per_worker and args.jetstream:
        print("kvstrata indexer: --per-worker follows core NATS only (not --jetstream)",
              file=sys.stderr)
        return 2
    nf = NatsFollower(args.nats, args.subject, index, format=fmt, jetstream=args.jetstream,
                      trusted_workers=args.trust_workers, per_worker=args.per_worker)
    try:
        nf.start()
    except (TimeoutError, OSError) as exc:
        print(f"kvstrata indexer: cannot reach {redacted(args.nats)}: {exc}", file=sys.stderr)
        return 1
    if fmt == "kvstrata" and not args.jetstream:
        nf.discover(0.5)
    if args.query is not None:
        print(json.dumps(match_response(index, query, args.local)))
        nf.close()
        return 0
    server = None
    if args.http:
        try:
            server = IndexServer(index, *args.http, follower=nf.follower, secret=secret).start()
        except OSError as exc:
            nf.close()
            print(f"kvstrata indexer: --http {args.http[0]}:{args.http[1]}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 2
        _say_serving(server)
    try:
        threading.Event().wait()         # until a signal: the CLI says which (exit 143 / 130)
    finally:
        if server is not None:
            server.close()
        nf.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
