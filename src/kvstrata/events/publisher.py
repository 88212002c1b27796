"""The batching event publisher: a registry observer that never blocks its caller.

The registry calls the observer hooks on the pool owner's thread. Each hook, under one short
lock, filters no-op changes against a shadow copy of every tier, assigns strictly increasing
event ids, updates the shadow and appends the events to a bounded buffer; nothing else. A
background thread takes batches off the buffer (up to ``max_batch`` events, or whatever has
waited ``max_delay`` seconds) and hands them to the sink.

When the buffer is full new events are dropped and counted (their ids are still consumed, so a
consumer sees the gap and re-synchronises from a snapshot). A sink that fails with
:class:`SinkUnavailableError` is retried with back-off (the buffer absorbs new events meanwhile);
any other sink error drops that batch. Because the shadow is updated in event-id order under
the same lock, :meth:`EventPublisher.snapshot` is exactly the state after its ``last_event_id``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Sequence

from kvstrata.events.model import (
    ClearedEvent,
    Event,
    EventBatch,
    PublisherIdentity,
    RemovedEvent,
    Snapshot,
    TierState,
    stored_event,
)
from kvstrata.logical.registry import BlockRecord, RegistryObserver

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 1024
DEFAULT_MAX_DELAY = 0.010
DEFAULT_BUFFER_EVENTS = 65536


class SinkUnavailableError(RuntimeError):
    """The sink cannot take the batch right now (server down, not connected); retry later."""


class Sink:
    """Where batches go. ``send`` runs on the publisher's thread only; ``flush``/``close`` may
    be called from any thread and must not hang longer than their timeout."""

    kind = "sink"

    def open(self, publisher: "EventPublisher") -> None:
        """Called once by :meth:`EventPublisher.start`, before the first ``send``."""

    def send(self, batch: EventBatch) -> None:
        raise NotImplementedError

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> None:
        """Release resources (the publisher calls it after its thread stopped or gave up)."""

    def describe(self) -> str:
        return self.kind


class EventPublisher(RegistryObserver):
    """Registry observer that batches events off the caller's thread into one :class:`Sink`.

    Use ``registry.add_observer(publisher.start())``; ``flush()`` waits until everything
    produced so far reached the sink; ``close()`` flushes (bounded) and stops the thread.
    """

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
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
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
        self._backoff = retry_backoff

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._buffer: deque = deque()  # Event, or (id, tier, chain, ts) for stored
        self._shadow = TierState()
        self._last_id = 0  # last event id assigned
        self._done_id = 0  # every id <= this was delivered or dropped
        self._first_pending_at = 0.0
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
        self.sink.close(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> "EventPublisher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- observer hooks (pool owner thread; cheap) --------------------------------------------
    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        # Only the shadow update, chain split and id assignment happen here; the events are
        # materialised on the publisher thread (buffer items are (id, tier, chain, ts) tuples).
        now = time.time()
        strip = not self.keep_tokens
        with self._lock:
            held = self._shadow.tiers[tier]
            chains: list[list[BlockRecord]] = []
            chain: list[BlockRecord] = []
            prev_hash = prev_size = None
            for record in records:
                h = record.sequence_hash
                if h in held:
                    continue
                if strip and record.token_ids is not None:
                    record = BlockRecord(h, record.local_hash, record.parent_hash, record.block_size)
                held[h] = record
                if record.parent_hash == prev_hash and record.block_size == prev_size and chain:
                    chain.append(record)
                else:
                    chain = [record]
                    chains.append(chain)
                prev_hash, prev_size = h, record.block_size
            if not chains:
                return
            items = []
            for chain in chains:
                self._last_id += 1
                items.append((self._last_id, tier, chain, now))
            self._enqueue_locked(items)

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        with self._lock:
            held = self._shadow.tiers[tier]
            gone = []
            for h in sequence_hashes:
                if held.pop(h, None) is not None:
                    gone.append(h)
            if not gone:
                return
            self._last_id += 1
            self._enqueue_locked([RemovedEvent(self._last_id, tier, tuple(gone), time.time())])

    def on_tier_cleared(self, tier: str) -> None:
        with self._lock:
            held = self._shadow.tiers[tier]
            hashes = tuple(held)
            held.clear()
            self._last_id += 1
            self._enqueue_locked([ClearedEvent(self._last_id, tier, hashes, time.time())])

    def _enqueue_locked(self, events: list) -> None:
        n = len(events)
        self.enqueued += n
        buf = self._buffer
        if self._closing or len(buf) + n > self.buffer_events:
            self.dropped += n
            if not buf:
                self._done_id = self._last_id
            return
        was_empty = not buf
        buf.extend(events)
        if was_empty:
            self._first_pending_at = time.monotonic()
            self._cond.notify()
        elif len(buf) >= self.max_batch and len(buf) - n < self.max_batch:
            self._cond.notify()

    # -- state -------------------------------------------------------------------------------
    @property
    def last_event_id(self) -> int:
        return self._last_id

    def snapshot(self) -> Snapshot:
        """Every tier's content as stored events, consistent with ``last_event_id``."""
        with self._lock:
            last = self._last_id
            events = self._shadow.snapshot_events(last, time.time())
        return Snapshot(self.identity, last, events)

    def state(self) -> dict[str, set[int]]:
        """Tier -> hashes held, as the published stream describes it (the shadow)."""
        with self._lock:
            return self._shadow.hashes()

    def metrics(self) -> dict[str, float]:
        """Plain counters; names match the Prometheus metrics (see docs/events.md)."""
        with self._lock:
            pending = len(self._buffer)
            lag_s = time.monotonic() - self._first_pending_at if pending else 0.0
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
    def _next_batch(self) -> list[Event] | None:
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
            if n == len(buf):
                items = list(buf)
                buf.clear()
            else:
                items = [buf.popleft() for _ in range(n)]
                self._first_pending_at = time.monotonic()
        return [stored_event(*item) if type(item) is tuple else item for item in items]

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:
                continue
            delivered = self._deliver(batch)
            with self._cond:
                if delivered:
                    self.published += len(batch)
                    self.batches += 1
                else:
                    self.dropped += len(batch)
                self._done_id = max(self._done_id, batch[-1].event_id)
                if not self._buffer:
                    self._done_id = self._last_id
                self._cond.notify_all()

    def _deliver(self, events: list[Event]) -> bool:
        batch = EventBatch(self.identity, events)
        delay = self._backoff[0]
        while True:
            try:
                self.sink.send(batch)
                return True
            except SinkUnavailableError as exc:
                with self._cond:
                    self.sink_errors += 1
                    if self._closing:
                        return False
                    log.debug("event sink %s unavailable (%s); retrying in %.2fs", self.sink.describe(), exc, delay)
                    self._cond.wait(delay)
                    if self._closing:
                        return False
                delay = min(delay * 2, self._backoff[1])
            except Exception:
                log.exception("event sink %s failed; dropping %d events", self.sink.describe(), len(events))
                with self._cond:
                    self.sink_errors += 1
                return False
