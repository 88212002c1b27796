"""The batching event publisher: a registry observer that never blocks its caller.

(Over 600 lines on purpose: one concern, publishing without blocking the owner thread; the
shadow, the batching thread and the snapshot all share the one lock and must be read together.)

The registry calls the observer hooks on the pool owner's thread. Each hook, under one short
lock, filters no-op changes against a shadow of every tier, assigns strictly increasing event
ids, updates the shadow and appends one compact tuple per event to a bounded buffer (no event
objects; the common case, one parent-linked run of new blocks, is a few C-level list/set
operations whatever its length; a run longer than one event may hold, ``max_event_blocks``,
becomes several events, so that no message approaches a transport's size limit). A background
thread takes batches off the buffer (up to ``max_batch`` events, or whatever has waited
``max_delay`` seconds) and hands them to the sink, which encodes straight from the tuples
(``EventBatch.items``); event objects are only built for sinks that ask for
``EventBatch.events``.

The shadow of a tier is the set of hashes it holds plus a log of the stored items (which carry
each block's parent, local hash, size and tokens); snapshots read the log filtered by the set.
The log keeps stale entries until it is compacted (by the background thread, in short locked
steps, once it is twice the size of the set; by the hook itself only if that thread is stuck).

When the buffer is full new events are dropped and counted (their ids are still consumed, so a
consumer sees the gap and re-synchronises from a snapshot). A sink that fails with
:class:`SinkUnavailableError` is retried with back-off (the buffer absorbs new events meanwhile);
any other sink error drops that batch. Because the shadow is updated in event-id order under
the same lock, :meth:`EventPublisher.snapshot` is exactly the state after its ``last_event_id``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Iterable, Sequence

from kvstrata.events.formats import stored_part
from kvstrata.events.model import (
    CLEARED,
    ITEM_HEAD,
    NO_PARENT,
    REMOVED,
    STORED,
    EventBatch,
    PublisherIdentity,
    Snapshot,
    item_to_event,
)
from kvstrata.logical.registry import RegistryObserver
from kvstrata.tiers import TIER_NAMES
from kvstrata.types import BlockRecord

log = logging.getLogger(__name__)


DEFAULT_MAX_BATCH = 1024
DEFAULT_MAX_DELAY = 0.010
DEFAULT_BUFFER_EVENTS = 65536
TS_RESOLUTION = 0.001
"""Events within this many seconds of the previous distinct ``ts`` reuse it (cheaper to encode).
A constant: the native hooks take it once, at import."""
COMPACT_SLACK = 16384
"""The background thread compacts a tier's log past ``2 * held + COMPACT_SLACK`` blocks."""
HARD_SLACK = 262144
"""A hook compacts inline past ``4 * held + HARD_SLACK`` blocks (background thread stuck)."""
COMPACT_STEP = 256
"""Log items compacted per lock hold."""
DEFAULT_MAX_EVENT_BLOCKS = 512
"""Most blocks one stored or removed event holds: a longer run becomes several events, so no
event approaches a transport's message limit (NATS: 1 MiB by default; a block is ~42 bytes of
kvstrata JSON, ~72 of Dynamo's)."""
DEFAULT_MAX_EVENT_TOKENS = 16384
"""Most token ids one stored event carries (when tokens are kept): its blocks are capped at
this over the block size."""
UNAVAILABLE_WARN_AFTER = 5.0
"""Seconds a sink may stay unavailable (retried) before the publisher warns about it."""


class SinkUnavailableError(RuntimeError):
    """The sink cannot take the batch right now (server down, not connected); retry later."""


class Sink:
    """Where batches go. ``send`` runs on the publisher's thread only; ``flush``/``close`` may
    be called from any thread and must not hang longer than their timeout.

    ``send`` gets an :class:`EventBatch` built from the publisher's compact items: the
    encoders in :mod:`kvstrata.events.formats` read ``batch.items`` directly; reading
    ``batch.events`` builds the event objects (once per batch). It returns None (or 0) when
    the whole batch went out, or how many of its events it had to leave out (e.g. one message
    over the server's size limit) having sent the rest: the publisher counts those dropped."""

    kind = "sink"

    def open(self, publisher: "EventPublisher") -> None:
        """Called once by :meth:`EventPublisher.start`, before the first ``send``."""

    def send(self, batch: EventBatch) -> int | None:
        raise NotImplementedError

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> None:
        """Release resources (the publisher calls it after its thread stopped or gave up)."""

    def describe(self) -> str:
        return self.kind


class _TierShadow:
    """One tier as the published stream describes it (see the module docstring)."""

    __slots__ = ("held", "log", "logged", "limit", "generation")

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.log: list[tuple] = []  # stored items, in event order (may hold stale entries)
        self.logged = 0  # blocks in ``log``
        self.limit = HARD_SLACK  # inline compaction is considered past this many blocks
        self.generation = 0  # bumped when the log is replaced (aborts a running compaction)


def live_items(items: Iterable[tuple], held: set[int], seen: set[int]) -> list[tuple]:
    """The blocks of stored ``items`` that are in ``held`` and not yet in ``seen`` (which is
    updated), as stored items of parent-linked runs (a run breaks where a block is skipped)."""
    out: list[tuple] = []
    append = out.append
    for item in items:
        n = (len(item) - ITEM_HEAD) >> 1
        hashes = item[ITEM_HEAD : ITEM_HEAD + n]
        if held.issuperset(hashes) and seen.isdisjoint(hashes):
            seen.update(hashes)
            append(item)
            continue
        start = -1
        for i, h in enumerate(hashes):
            if h in held and h not in seen:
                seen.add(h)
                if start < 0:
                    start = i
            elif start >= 0:
                append(stored_part(item, start, i))
                start = -1
        if start >= 0:
            append(stored_part(item, start, n))
    return out


class EventPublisher(RegistryObserver):
    """Registry observer that batches events off the caller's thread into one :class:`Sink`.

    Use ``registry.add_observer(publisher.start())``; ``flush()`` waits until everything
    produced so far reached the sink; ``close()`` flushes (bounded) and stops the thread.
    A publisher attached to a registry that already holds blocks can be told about them
    with :meth:`seed`.
    """

    # What the observer hooks touch, as slots: the native hooks (``_hooks.c``) read and write
    # them by offset, the Python code by name.
    __slots__ = ("_lock", "_cond", "_buffer", "_tiers", "_ts", "_ts_text", "_last_id", "_done_id",
                 "_first_pending_at", "_closing", "enqueued", "dropped", "buffer_events",
                 "max_batch", "keep_tokens", "max_event_blocks", "max_event_tokens")

    def __init__(
        self,
        sink: Sink,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_delay: float = DEFAULT_MAX_DELAY,
        buffer_events: int = DEFAULT_BUFFER_EVENTS,
        worker_id: int | None = None,
        keep_tokens: bool = True,
        retry_backoff: tuple[float, float] = (0.02, 1.0),
        max_event_blocks: int = DEFAULT_MAX_EVENT_BLOCKS,
        max_event_tokens: int = DEFAULT_MAX_EVENT_TOKENS,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_event_blocks < 1 or max_event_tokens < 1:
            raise ValueError(f"max_event_blocks ({max_event_blocks}) and max_event_tokens "
                             f"({max_event_tokens}) must be >= 1")
        if max_delay < 0:
            raise ValueError(f"max_delay must be >= 0, got {max_delay}")
        if buffer_events < max_batch:
            raise ValueError(f"buffer_events ({buffer_events}) must be >= max_batch ({max_batch})")
        self.sink = sink
        self.identity = PublisherIdentity.new(worker_id)
        self.max_batch = max_batch
        self.max_delay = max_delay
        self.buffer_events = buffer_events
        self.keep_tokens = keep_tokens
        self.max_event_blocks = int(max_event_blocks)
        self.max_event_tokens = int(max_event_tokens)
        self._backoff = retry_backoff

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._buffer: deque = deque()  # items, see kvstrata.events.model
        self._tiers = {t: _TierShadow() for t in TIER_NAMES}
        self._ts = 0.0  # last distinct event timestamp handed out
        self._ts_text = "0.0"  # repr(self._ts): items carry the JSON-ready text
        self._last_id = 0  # last event id assigned
        self._done_id = 0  # every id <= this was delivered or dropped
        self._first_pending_at = 0.0
        self._in_flight = 0  # events of the batch the sink is being handed (out of the buffer)
        self._in_flight_since = 0.0  # when its oldest event was buffered (monotonic)
        self._closing = False
        self._flush_waiters = 0
        self._thread: threading.Thread | None = None
        self._started = False
        # counters (plain ints, read under the lock)
        self.enqueued = 0
        self.published = 0
        self.dropped = 0
        self.batches = 0
        self.sink_errors = 0
        self.dropped_by_errors = 0
        self.compactions = 0
        self._warnings = Warnings()
        self._unavailable_warned_at = float("-inf")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EventPublisher":
        """Open the sink and start the background thread (idempotent); returns self."""
        if self._started:
            return self
        self._started = True
        self.sink.open(self)
        self._thread = threading.Thread(
            target=self._run, name=f"kvstrata-events-{self.sink.kind}", daemon=True
        )
        self._thread.start()
        return self

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event produced so far was handed to the sink (or dropped), then
        flush the sink. Returns False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._last_id
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                while self._done_id < target:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                        return False
                    self._cond.wait(remaining)
            finally:
                self._flush_waiters -= 1
        return self.sink.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 5.0) -> None:
        """Flush for at most ``timeout`` seconds, stop the thread, close the sink. Events still
        buffered after that are counted as dropped."""
        deadline = time.monotonic() + timeout
        if self._started and self._thread is not None and self._thread.is_alive():
            self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) + 0.05)
        with self._cond:
            if self._buffer:
                self.dropped += len(self._buffer)
                self._buffer.clear()
            self._done_id = self._last_id
            self._cond.notify_all()
        if self._thread is not None and self._thread.is_alive():
            # The sender is stuck inside sink.send: closing the sink under it is not safe for
            # the NATS / ZMQ / file sinks. Leave it to the daemon thread and say so.
            log.warning("event sink still sending after close timeout; not closing it under the sender")
            return
        self.sink.close(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> "EventPublisher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- observer hooks (pool owner thread; cheap) --------------------------------------------
    def _now(self) -> str:
        """Event timestamp text (under the lock): ``repr(time.time())``, but events within
        ``TS_RESOLUTION`` of the last distinct value share it (rendered once)."""
        now = time.time()
        if now - self._ts >= TS_RESOLUTION or now < self._ts:
            self._ts = now
            self._ts_text = repr(now)
        return self._ts_text

    def event_blocks(self, block_size: int, tokens: bool) -> int:
        """Most blocks of ``block_size`` tokens one stored event holds (``tokens``: it carries
        their token ids): ``max_event_blocks``, less where the tokens would pass
        ``max_event_tokens``. A longer run is cut into parts of this many blocks (each part's
        parent the previous part's last block), each an event of its own."""
        limit = self.max_event_blocks
        if tokens and block_size > 0:
            limit = min(limit, max(1, self.max_event_tokens // block_size))
        return limit

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        if _native_hooks is not None and _native_hooks.stored(self, tier, records):
            return   # the common case below, in C (it declines, changing nothing, otherwise,
                     # and for a run longer than one event holds)
        n = len(records)
        if not n:
            return
        first = records[0]
        hashes = [r.sequence_hash for r in records]
        size = first.block_size
        # parents of the records of the first one's block size: equal to hashes[:-1] exactly
        # when the records form one parent-linked run of one block size
        parents = [r.parent_hash for r in records if r.block_size == size]
        with self._lock:
            sh = self._tiers[tier]
            held = sh.held
            # Fast path: one linked run of hashes all new to the tier -> one stored event (or
            # parts of event_blocks() blocks); the per-record work is C-level (comprehensions,
            # set operations).
            if parents[1:] == hashes[:-1] and held.isdisjoint(hashes) and len(set(hashes)) == len(hashes):
                held.update(hashes)
                now = time.time()
                if now - self._ts >= TS_RESOLUTION or now < self._ts:
                    self._ts = now
                    self._ts_text = repr(now)
                parent = first.parent_hash
                tokens = first.token_ids is not None and self.keep_tokens
                limit = self.event_blocks(size, tokens)
                if n > limit:
                    self._stored_parts_locked(sh, tier, records, hashes, limit, tokens)
                    return
                self._last_id = eid = self._last_id + 1
                item = (
                    eid,
                    STORED,
                    tier,
                    self._ts_text,
                    NO_PARENT if parent is None else parent,
                    size,
                    tuple([r.token_ids for r in records]) if tokens else None,
                    *hashes,
                    *[r.local_hash for r in records],
                )
                self._log_and_enqueue_locked(sh, item, n)
                return
            self._stored_slow_locked(tier, records)

    def _stored_parts_locked(self, sh: _TierShadow, tier: str, records: Sequence[BlockRecord],
                             hashes: list[int], limit: int, tokens: bool) -> None:
        """The fast path's run (new to the tier, already in ``held``, timestamp taken) as
        stored events of at most ``limit`` blocks each."""
        locals_ = [r.local_hash for r in records]
        all_tokens = tuple([r.token_ids for r in records]) if tokens else None
        first_parent = records[0].parent_hash
        size = records[0].block_size
        n = len(hashes)
        for start in range(0, n, limit):
            stop = min(start + limit, n)
            parent = hashes[start - 1] if start else first_parent
            self._last_id += 1
            item = (
                self._last_id,
                STORED,
                tier,
                self._ts_text,
                NO_PARENT if parent is None else parent,
                size,
                # as the slow path: tokens only where the part's first block has them
                all_tokens[start:stop] if tokens and all_tokens[start] is not None else None,
                *hashes[start:stop],
                *locals_[start:stop],
            )
            self._log_and_enqueue_locked(sh, item, stop - start)

    def _stored_slow_locked(self, tier: str, records: Iterable[BlockRecord]) -> int:
        """General case: skip held hashes, split into parent-linked runs of one block size,
        of at most :meth:`event_blocks` blocks each."""
        sh = self._tiers[tier]
        held = sh.held
        keep_tokens = self.keep_tokens
        chains: list[list[BlockRecord]] = []
        chain: list[BlockRecord] = []
        prev_hash = prev_size = None
        limit = 0
        for record in records:
            h = record.sequence_hash
            if h in held:
                continue
            held.add(h)
            if chain and record.parent_hash == prev_hash and record.block_size == prev_size \
                    and len(chain) < limit:
                chain.append(record)
            else:
                chain = [record]
                chains.append(chain)
                limit = self.event_blocks(record.block_size, keep_tokens and record.token_ids is not None)
            prev_hash, prev_size = h, record.block_size
        if not chains:
            return 0
        now = self._now()
        items = []
        for chain in chains:
            self._last_id += 1
            first = chain[0]
            items.append(
                (
                    self._last_id,
                    STORED,
                    tier,
                    now,
                    NO_PARENT if first.parent_hash is None else first.parent_hash,
                    first.block_size,
                    tuple([r.token_ids for r in chain]) if first.token_ids is not None and keep_tokens else None,
                    *[r.sequence_hash for r in chain],
                    *[r.local_hash for r in chain],
                )
            )
            sh.logged += len(chain)
        sh.log.extend(items)
        if sh.logged > sh.limit:
            self._maybe_compact_inline(sh)
        self._enqueue_locked(items)
        return len(items)

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        if _native_hooks is not None and _native_hooks.removed(self, tier, sequence_hashes):
            return   # this method, in C (it declines, changing nothing, for a class it does not
                     # know and for more hashes than one event holds)
        with self._lock:
            held = self._tiers[tier].held
            if len(sequence_hashes) == 1:
                try:
                    held.remove(sequence_hashes[0])
                except KeyError:
                    return
                gone: Sequence[int] = sequence_hashes
            else:
                # ``discard`` returns None: each hash is removed as it is taken (repeats drop out)
                gone = [h for h in sequence_hashes if h in held and not held.discard(h)]
                if not gone:
                    return
                limit = self.max_event_blocks
                if len(gone) > limit:   # several events, at most ``limit`` hashes each
                    ts = self._now()
                    for start in range(0, len(gone), limit):
                        self._last_id += 1
                        self._enqueue1_locked((self._last_id, REMOVED, tier, ts, *gone[start : start + limit]))
                    return
            self._last_id = eid = self._last_id + 1
            now = time.time()
            if now - self._ts >= TS_RESOLUTION or now < self._ts:
                self._ts = now
                self._ts_text = repr(now)
            item = (eid, REMOVED, tier, self._ts_text, *gone)
            # inline _enqueue1_locked
            self.enqueued += 1
            buf = self._buffer
            if self._closing or len(buf) >= self.buffer_events:
                self.dropped += 1
                if not buf:
                    self._done_id = eid
                return
            buf.append(item)
            if len(buf) == 1:
                self._first_pending_at = time.monotonic()
                self._cond.notify()
            elif len(buf) % self.max_batch == 0:
                self._cond.notify()

    def on_tier_cleared(self, tier: str) -> None:
        with self._lock:
            sh = self._tiers[tier]
            if not sh.held and not sh.log:
                return  # nothing held: a no-op change makes no event
            self._last_id += 1
            item = (self._last_id, CLEARED, tier, self._now(), *sh.held)
            sh.held = set()
            sh.log = []
            sh.logged = 0
            sh.limit = HARD_SLACK
            sh.generation += 1
            self._enqueue1_locked(item)

    def seed(self, tier: str, records: Iterable[BlockRecord]) -> int:
        """Publish ``records`` that ``tier`` already holds, as stored events; returns how many
        events that made.

        For a publisher attached to a registry whose pools already hold blocks (it only sees
        changes from then on). Call it on the pool owner's thread right after
        ``registry.add_observer(publisher)`` with the pool's current records, so no change
        slips in between. Records in any order are grouped into parent-linked runs (parents
        first), so a pool of long chains becomes few events; hashes the publisher already
        shows in ``tier`` are skipped, so seeding twice (or seeding a record a hook already
        reported) emits nothing. Events follow the bounded buffer's rules like any other: if a
        large seed overflows it, the overflow is dropped and counted, the ids stay consumed
        and the shadow (so the snapshot) is complete.
        """
        if tier not in self._tiers:
            raise ValueError(f"unknown tier {tier!r} (expected one of {', '.join(TIER_NAMES)})")
        ordered = chain_order(records)
        if not ordered:
            return 0
        with self._lock:
            return self._stored_slow_locked(tier, ordered)

    def _log_and_enqueue_locked(self, sh, item: tuple, blocks: int) -> None:
        """A stored event of ``blocks`` blocks: into the tier's shadow log (for snapshots),
        then the send buffer."""
        sh.log.append(item)
        sh.logged += blocks
        if sh.logged > sh.limit:
            self._maybe_compact_inline(sh)
        self._enqueue1_locked(item)

    def _enqueue1_locked(self, item: tuple) -> None:
        """Append one item; ``_enqueue_locked`` for several."""
        self.enqueued += 1
        buf = self._buffer
        if self._closing or len(buf) >= self.buffer_events:
            self.dropped += 1
            if not buf:
                self._done_id = self._last_id
            return
        buf.append(item)
        n = len(buf)
        if n == 1:
            self._first_pending_at = time.monotonic()
            self._cond.notify()
        elif n % self.max_batch == 0:  # every whole batch, also behind a backlog
            self._cond.notify()

    def _enqueue_locked(self, items: list) -> None:
        n = len(items)
        self.enqueued += n
        buf = self._buffer
        if self._closing or len(buf) + n > self.buffer_events:
            self.dropped += n
            if not buf:
                self._done_id = self._last_id
            return
        was_empty = not buf
        buf.extend(items)
        if was_empty:
            self._first_pending_at = time.monotonic()
            self._cond.notify()
        elif (len(buf) - n) // self.max_batch < len(buf) // self.max_batch:
            self._cond.notify()

    # -- shadow log compaction ---------------------------------------------------------------
    def _maybe_compact_inline(self, sh: _TierShadow) -> None:
        """Under the lock, from a hook: compact only if the log is far past its soft limit
        (the background thread, which normally does it, is stuck in a sink)."""
        hard = 4 * len(sh.held) + HARD_SLACK
        if sh.logged > hard:
            sh.log = live_items(sh.log, sh.held, set())
            sh.logged = sum((len(i) - ITEM_HEAD) >> 1 for i in sh.log)
            sh.generation += 1  # a background compaction in progress must not write back
            self.compactions += 1
        sh.limit = max(hard, sh.logged + HARD_SLACK)

    def _compact_step(self) -> None:
        """Background thread: compact any tier whose log is past ``2 * held + COMPACT_SLACK``,
        ``COMPACT_STEP`` items per lock hold (hooks interleave; see ``live_items``)."""
        for sh in self._tiers.values():
            with self._lock:
                if sh.logged <= 2 * len(sh.held) + COMPACT_SLACK:
                    continue
                generation = sh.generation
                old = sh.log[:]  # items are immutable; later appends stay in sh.log's tail
                old_blocks = sh.logged
            new: list[tuple] = []
            seen: set[int] = set()
            aborted = False
            for start in range(0, len(old), COMPACT_STEP):
                with self._lock:
                    if sh.generation != generation:
                        aborted = True
                        break
                    new.extend(live_items(old[start : start + COMPACT_STEP], sh.held, seen))
            if aborted:
                continue
            with self._lock:
                if sh.generation != generation:
                    continue
                new_blocks = sum((len(i) - ITEM_HEAD) >> 1 for i in new)
                sh.log[: len(old)] = new
                sh.logged = sh.logged - old_blocks + new_blocks
                sh.limit = max(4 * len(sh.held) + HARD_SLACK, sh.logged + HARD_SLACK)
                self.compactions += 1

    # -- state -------------------------------------------------------------------------------
    @property
    def last_event_id(self) -> int:
        return self._last_id

    def snapshot(self) -> Snapshot:
        """Every tier's content as stored events, consistent with ``last_event_id``."""
        with self._lock:  # copy the shadow (C-level), build the events outside the lock
            last = self._last_id
            copies = [(t, set(sh.held), sh.log[:]) for t, sh in self._tiers.items() if sh.held]
        now = repr(time.time())
        events = []
        for tier, held, items in copies:
            for item in live_items(items, held, set()):
                events.append(item_to_event((last, STORED, tier, now) + item[4:]))
        return Snapshot(self.identity, last, events)  # type: ignore[arg-type]

    def state(self) -> dict[str, set[int]]:
        """Tier -> hashes held, as the published stream describes it (the shadow)."""
        with self._lock:
            return {t: set(sh.held) for t, sh in self._tiers.items()}

    def metrics(self) -> dict[str, float]:
        """Plain counters; names match the Prometheus metrics (see docs/events.md)."""
        with self._lock:
            # the batch being delivered (retried while the sink is unavailable) is no longer
            # in the buffer, but not delivered either (after close nothing is waited for)
            in_flight = 0 if self._closing else self._in_flight
            pending = len(self._buffer) + in_flight
            since = self._in_flight_since if in_flight else self._first_pending_at
            lag_s = time.monotonic() - since if pending else 0.0
            return {
                "enqueued": self.enqueued,
                "published": self.published,
                "dropped": self.dropped,
                "batches": self.batches,
                "sink_errors": self.sink_errors,
                "lag": pending,
                "lag_seconds": lag_s,
                "last_event_id": self._last_id,
            }

    # -- background thread -------------------------------------------------------------------
    def _next_batch(self) -> list[tuple] | None:
        """Block (on the condition, no polling) until a batch is due; None when closing."""
        with self._cond:
            buf = self._buffer
            while not buf:
                if self._closing:
                    return None
                self._cond.wait()
            deadline = self._first_pending_at + self.max_delay
            while len(buf) < self.max_batch and not self._closing and not self._flush_waiters:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if not buf:
                return [] if not self._closing else None
            n = min(len(buf), self.max_batch)
            self._in_flight, self._in_flight_since = n, self._first_pending_at
            if n == len(buf):
                items = list(buf)
                buf.clear()
            else:
                items = [buf.popleft() for _ in range(n)]
                self._first_pending_at = time.monotonic()
        return items

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:
                continue
            left_out = self._deliver(batch)
            with self._cond:
                if left_out < len(batch):
                    self.published += len(batch) - left_out
                    self.batches += 1
                self.dropped += left_out
                self._in_flight = 0
                self._done_id = max(self._done_id, batch[-1][0])
                if not self._buffer:
                    self._done_id = self._last_id
                self._cond.notify_all()
            self._compact_step()

    def _deliver(self, items: list[tuple]) -> int:
        """Hand ``items`` to the sink, retrying while it is unavailable; returns how many of
        them were not delivered (0: all were)."""
        batch = EventBatch(self.identity, items=items)
        delay = self._backoff[0]
        unavailable_since = None
        while True:
            try:
                left_out = self.sink.send(batch) or 0
            except SinkUnavailableError as exc:
                now = time.monotonic()
                if unavailable_since is None:
                    unavailable_since = now
                self._warn_unavailable(exc, now - unavailable_since)
                with self._cond:
                    self.sink_errors += 1
                    if self._closing:
                        return len(items)
                    log.debug("event sink %s unavailable (%s); retrying in %.2fs", self.sink.describe(), exc, delay)
                    self._cond.wait(delay)
                    if self._closing:
                        return len(items)
                delay = min(delay * 2, self._backoff[1])
                continue
            except Exception as exc:
                self._count_failed(len(items), exc)
                return len(items)
            if unavailable_since is not None and self._unavailable_warned_at >= unavailable_since:
                log.info("event sink %s available again after %.1fs", self.sink.describe(),
                         time.monotonic() - unavailable_since)
            if left_out:     # the sink sent the rest and said why (logged)
                with self._cond:
                    self.sink_errors += 1
                    self.dropped_by_errors += left_out
            return left_out

    def _count_failed(self, events: int, exc: BaseException) -> None:
        """A batch of ``events`` the sink failed (not worth a retry): counted, and said now and
        then."""
        with self._cond:
            self.sink_errors += 1
            self.dropped_by_errors += events
            errors, dropped = self.sink_errors, self.dropped_by_errors
        if self._warnings.due("failed"):   # one line now and then, not per batch
            log.warning("event sink %s failed: %s; %d events dropped in %d failed "
                        "batches so far", self.sink.describe(), _one_line(exc), dropped,
                        errors)

    def _warn_unavailable(self, exc: BaseException, for_s: float) -> None:
        """Say that the sink has been unavailable for ``for_s`` seconds, once it is past
        :data:`UNAVAILABLE_WARN_AFTER`, at most once every :data:`WARN_EVERY`."""
        if for_s < UNAVAILABLE_WARN_AFTER or not self._warnings.due("unavailable"):
            return
        self._unavailable_warned_at = time.monotonic()
        lag = self.metrics()
        log.warning("event sink %s unavailable for %.1fs: %s; %d events waiting (oldest %.1fs), "
                    "still retrying", self.sink.describe(), for_s, _one_line(exc), lag["lag"],
                    lag["lag_seconds"])


def delivery_report(sink: str, metrics: dict) -> dict:
    """A closed publisher's ``metrics`` with the sink's name and ``lost``: the events
    produced that no sink accepted (dropped from a full buffer, in failed batches, or left
    when it closed). The one place a driver learns what its events came to."""
    return {"sink": sink, **metrics,
            "lost": max(0, metrics["enqueued"] - metrics["published"])}

WARN_EVERY = 60.0
"""Seconds between two warnings of one kind about a sink (the counts say how many)."""


class Warnings:
    """Rate-limits warnings: one line per kind every :data:`WARN_EVERY` seconds."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def due(self, kind: str) -> bool:
        """Whether a warning of ``kind`` may be logged now (it then counts as logged)."""
        now = time.monotonic()
        if now - self._at.get(kind, float("-inf")) < WARN_EVERY:
            return False
        self._at[kind] = now
        return True


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _load_native_hooks():
    """The C versions of the observer hooks (``_hooks.stored``, ``_hooks.removed``), or None
    when the extension is not built or ``KVSTRATA_NATIVE_EVENTS=0``."""
    if os.environ.get("KVSTRATA_NATIVE_EVENTS", "1") == "0":
        return None
    try:
        from kvstrata.events import _hooks

        _hooks.configure(EventPublisher, _TierShadow, BlockRecord, STORED, REMOVED, NO_PARENT,
                         TS_RESOLUTION)
    except (ImportError, TypeError, AttributeError) as exc:   # not built, or a stale build
        log.debug("native publisher hooks unavailable: %s", exc)
        return None
    return _hooks


_native_hooks = _load_native_hooks()


def chain_order(records: Iterable[BlockRecord]) -> list[BlockRecord]:
    """``records`` reordered so each parent-linked run is contiguous, parents first (a depth-
    first walk of the forest they form); records on no walk (cycles) keep their order at the
    end, repeated hashes are dropped. Used by :meth:`EventPublisher.seed`."""
    records = list(records)
    present = {r.sequence_hash for r in records}
    children: dict[int, list[BlockRecord]] = {}
    roots: list[BlockRecord] = []
    for r in records:
        if r.parent_hash is not None and r.parent_hash in present and r.parent_hash != r.sequence_hash:
            children.setdefault(r.parent_hash, []).append(r)
        else:
            roots.append(r)
    out: list[BlockRecord] = []
    seen: set[int] = set()
    for root in roots:
        stack = [root]
        while stack:
            r = stack.pop()
            if r.sequence_hash in seen:
                continue
            seen.add(r.sequence_hash)
            out.append(r)
            kids = children.get(r.sequence_hash)
            if kids:
                stack.extend(reversed(kids))
    if len(out) < len(present):
        for r in records:
            if r.sequence_hash not in seen:
                seen.add(r.sequence_hash)
                out.append(r)
    return out
