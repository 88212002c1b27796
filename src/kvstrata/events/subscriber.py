"""Following event streams: ordering, de-duplication, gaps, restarts and late joins.

(About 750 lines on purpose: one concern, following streams in order; every transport feeds
:class:`StreamFollower`'s rules, and the NATS follower's snapshot requests are the other half of
its late-join protocol, so they read best together.)

:class:`StreamFollower` is transport-agnostic. It tracks, per engine (a worker's data-parallel
rank: each publishes its own stream, ids from 1), the publisher identity and the last applied
event id, and applies events to a *target* (anything with ``apply_event(worker_id, event)``
and ``reset_worker(worker_id)``, e.g. the indexer's
:class:`~kvstrata.events.indexer.PrefixIndex` or :class:`WorkerStates`; for an engine of rank
``k > 0`` both are called with ``k`` as a third argument, so a target written for one engine
per worker works unchanged until it meets data parallelism).

Late-join protocol (no gap, no duplicate): subscribe to the live stream first, buffering;
fetch the worker's snapshot (``last_event_id = N``); reset the worker, apply the snapshot,
drop buffered events ``<= N``, apply the rest. A gap in event ids (events dropped by the
publisher or missed) triggers the same re-sync; a new ``publisher_id`` for a known worker
(restart) drops that worker's state first.

:class:`NatsFollower` runs the protocol over NATS (request/reply on ``SUBJECT.snapshot.W``);
:func:`read_events_file` reads kvstrata or Dynamo JSON lines.
"""

from __future__ import annotations

import errno
import inspect
import io
import json
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol

from kvstrata.paths import (MAX_LINE_BYTES, InputTooLargeError, NotPrivateError, bounded_lines,
                            open_regular, writer_problem)
from kvstrata.events import formats
from kvstrata.events.model import (
    Event,
    EventBatch,
    EventFormatError,
    PublisherIdentity,
    Snapshot,
    StoredEvent,
    TierState,
)

log = logging.getLogger(__name__)


class EventTarget(Protocol):
    def apply_event(self, worker_id: int, event: Event, dp_rank: int = 0) -> None: ...

    def reset_worker(self, worker_id: int, dp_rank: int = 0) -> None: ...


def engine_key(worker_id: int, dp_rank: int = 0) -> int | tuple[int, int]:
    """How followers and the index name one engine: its worker id, or ``(worker_id,
    dp_rank)`` for a data-parallel rank above 0 (so a worker without data parallelism is named
    as it always was)."""
    return (worker_id, dp_rank) if dp_rank else worker_id


def split_engine(key: int | tuple[int, int]) -> tuple[int, int]:
    """``(worker_id, dp_rank)`` of an :func:`engine_key`."""
    return key if type(key) is tuple else (key, 0)


class WorkerStates:
    """A simple target: engine (:func:`engine_key`) -> :class:`TierState`."""

    def __init__(self) -> None:
        self.workers: dict[int | tuple[int, int], TierState] = {}

    def apply_event(self, worker_id: int, event: Event, dp_rank: int = 0) -> None:
        self.workers.setdefault(engine_key(worker_id, dp_rank), TierState()).apply(event)

    def reset_worker(self, worker_id: int, dp_rank: int = 0) -> None:
        self.workers[engine_key(worker_id, dp_rank)] = TierState()

    def hashes(self, worker_id: int, dp_rank: int = 0) -> dict[str, set[int]]:
        state = self.workers.get(engine_key(worker_id, dp_rank))
        return state.hashes() if state else TierState().hashes()


MAX_WORKER_ID = 1 << 64
"""Worker ids are unsigned 64-bit (:class:`~kvstrata.events.model.PublisherIdentity`); a
larger one is no worker."""
MAX_DP_RANK = formats.MAX_DP_RANK


def _loops(event: StoredEvent) -> bool:
    """Whether a stored event chains a block to itself (its parent, or the block before it
    in the event, has its own hash): no prefix tree holds that."""
    previous = event.parent_hash
    for block in event.blocks:
        if block.block_hash == previous:
            return True
        previous = block.block_hash
    return False


MAX_JUMP = 1 << 20
"""A gap wider than this many ids is not taken at its word (see :class:`_Worker`)."""
MAX_AHEAD = 65_536
"""Event ids past such gaps a best-effort follower remembers applying."""
RECENT_EVENTS = 256
"""Applied events a follower keeps per worker (by id, modulo this) to tell a repeat from a
conflicting event."""


class SnapshotChunks:
    """Snapshot chunks (:func:`~kvstrata.events.formats.decode_snapshot_chunk`) as they
    arrive, gathered per publisher: a snapshot is whole when its chunks 0, 1, ... came in
    that order under one identity and one ``last_event_id``, and the latest said it was the
    last. A chunk out of order, repeated, or under another identity or event id (a lost
    message, a restarted publisher, a forgery) drops what was gathered for that publisher
    (counted in :attr:`dropped`); a chunk 0 starts again. So a snapshot missing a part is
    never applied as the publisher's whole state."""

    def __init__(self) -> None:
        self._parts: dict[int, list[Snapshot]] = {}
        self.dropped = 0

    def add(self, part: Snapshot, index: int, last: bool) -> Snapshot | None:
        """Take chunk ``index`` of a snapshot; the whole snapshot once ``last`` completes
        it, else None."""
        publisher = part.identity.publisher_id
        parts = self._parts.pop(publisher, [])
        if parts and (parts[0].identity != part.identity
                      or parts[0].last_event_id != part.last_event_id) \
                or index != len(parts):
            if parts or index:
                self.dropped += 1
            if index:
                return None
            parts = []
        parts.append(part)
        if not last:
            self._parts[publisher] = parts
            return None
        return Snapshot(part.identity, part.last_event_id, [e for p in parts for e in p.events])


@dataclass
class _Worker:
    """What a follower knows of one worker's stream. ``last_id`` is the id the stream has
    reached: a best-effort follower moves it past an ordinary gap (the publisher dropped
    those events), but an id more than :data:`MAX_JUMP` past it is kept apart in ``ahead``,
    so an event that jumped implausibly far (a forged id 2^64-1, say) never makes the real
    events below it count as duplicates. ``recent`` holds applied events in slots by id
    modulo :data:`RECENT_EVENTS`: an id seen again with other contents while its event is
    still there is a conflict, not a repeat."""

    publisher_id: int | None
    last_id: int = 0
    syncing: bool = False
    buffer: list[Event] = field(default_factory=list)
    ahead: set[int] = field(default_factory=set)
    recent: list = field(default_factory=lambda: [None] * RECENT_EVENTS)

    def applied_before(self, event_id: int) -> Event | None:
        """The event applied under ``event_id``, if it is among the recent ones."""
        before = self.recent[event_id % RECENT_EVENTS]
        return before if before is not None and before.event_id == event_id else None

    def seen(self, event_id: int) -> bool:
        return event_id <= self.last_id or event_id in self.ahead

    def applied(self, event: Event) -> None:
        """Record ``event`` as applied: the unbroken run grows over ids filled in behind it."""
        eid = event.event_id
        self.recent[eid % RECENT_EVENTS] = event
        if eid <= self.last_id + MAX_JUMP:
            self.last_id = eid
            while self.ahead and self.last_id + 1 in self.ahead:
                self.last_id += 1
                self.ahead.discard(self.last_id)
        else:
            self.ahead.add(eid)
            if len(self.ahead) > MAX_AHEAD:     # the hole never filled: give it up
                self.last_id = min(self.ahead)
                self.ahead.discard(self.last_id)
                while self.last_id + 1 in self.ahead:
                    self.last_id += 1
                    self.ahead.discard(self.last_id)


class StreamFollower:
    """Applies per-engine event streams to ``target`` in order, exactly once.

    A stream is one engine's: a worker id and a data-parallel rank (0 without data
    parallelism), keyed by :func:`engine_key` in :attr:`workers`. The engines of one worker
    number their events each from 1; one's events never restart, reset or conflict with
    another's.

    ``snapshots=True``: when a worker is first seen mid-stream (first id > 1) or a gap appears,
    the worker goes into *syncing* (events buffered) and is listed by :meth:`pending_snapshots`
    until :meth:`apply_snapshot` (or :meth:`give_up_sync`) is called. A snapshot is a worker's
    (engine 0's): the streams of engines of rank > 0 are followed best effort.
    ``snapshots=False``: gaps are counted and events applied anyway (best effort, e.g. reading
    a file).
    """

    def __init__(self, target: EventTarget, *, snapshots: bool = True, max_buffer: int = 1_000_000,
                 trusted_workers: Iterable[int] | None = None) -> None:
        self.target = target
        self.snapshots = snapshots
        self.max_buffer = max_buffer
        self.trusted_workers = frozenset(trusted_workers) if trusted_workers is not None else None
        """Worker ids whose events are applied (None: every worker); others are dropped
        and counted in ``untrusted``: a bus others can publish on cannot forge a worker."""
        self.untrusted = 0
        self.invalid = 0
        """Events dropped as impossible: a worker id outside 0..2^64-1 or a data-parallel
        rank outside 0..2^32-1, a stored block that is its own parent or follows itself in its
        chain."""
        self.workers: dict[int | tuple[int, int], _Worker] = {}
        """Streams by :func:`engine_key`."""
        self.lock = threading.RLock()
        self.applied = 0
        self.duplicates = 0
        self.conflicts = 0
        """Events carrying an id already applied with other contents, or a restart whose
        first event is not id 1 where no snapshot can confirm it: a publisher that is not
        what it claims (forged, or two processes with one identity). With snapshots the
        worker is re-synced from its own snapshot; without, they are dropped."""
        self.gaps = 0
        self.restarts = 0
        self.snapshots_applied = 0
        self.ranked = _takes_rank(target)
        """Whether the target tells data-parallel engines apart (its ``apply_event`` takes a
        ``dp_rank``); the events of engines of rank > 0 are dropped for one that does not
        (counted in ``unranked``, a warning once), rather than merged into rank 0's."""
        self.unranked = 0

    # -- input -------------------------------------------------------------------------------
    def feed_batch(self, batch: EventBatch) -> None:
        self.feed(batch.identity.worker_id, batch.identity.publisher_id, batch.events)

    def feed(self, worker_id: int, publisher_id: int | None, events: Iterable[Event],
             dp_rank: int = 0) -> None:
        """Follow ``events`` of the engine of data-parallel rank ``dp_rank`` of worker
        ``worker_id`` (``publisher_id`` None where the format has none, as Dynamo's)."""
        events = list(events)
        if not events:
            return
        if self.trusted_workers is not None and worker_id not in self.trusted_workers:
            with self.lock:
                self.untrusted += len(events)
            return
        if not (type(worker_id) is int and 0 <= worker_id < MAX_WORKER_ID
                and type(dp_rank) is int and 0 <= dp_rank <= MAX_DP_RANK):
            with self.lock:
                self.invalid += len(events)
            return
        key = engine_key(worker_id, dp_rank)
        with self.lock:
            st = self.workers.get(key)
            restarted = st is not None and (
                (publisher_id is not None and st.publisher_id is not None and publisher_id != st.publisher_id)
                or (publisher_id is None and events[0].event_id == 1 and st.last_id > 0)
            )
            if st is None or restarted:
                if restarted:
                    self.restarts += 1
                    self._reset(worker_id, dp_rank)
                st = self.workers[key] = _Worker(publisher_id)
                if events[0].event_id != 1:
                    if self.snapshots and not dp_rank:
                        st.syncing = True
                    else:                          # joined late: earlier ids are
                        self.gaps += 1             # history, not a hole to fill
                        st.last_id = events[0].event_id - 1
            if st.publisher_id is None:
                st.publisher_id = publisher_id
            if st.syncing:
                self._buffer(st, events)
                return
            self._apply(worker_id, st, events, dp_rank=dp_rank)

    def _reset(self, worker_id: int, dp_rank: int) -> None:
        if not dp_rank:
            self.target.reset_worker(worker_id)
        elif self.ranked:
            self.target.reset_worker(worker_id, dp_rank)

    def _buffer(self, st: _Worker, events: list[Event]) -> None:
        st.buffer.extend(events)
        if len(st.buffer) > self.max_buffer:
            del st.buffer[: len(st.buffer) - self.max_buffer]

    def _apply(self, worker_id: int, st: _Worker, events: list[Event],
               after_snapshot: bool = False, dp_rank: int = 0) -> None:
        """Apply ``events`` in order. A gap starts a re-sync (snapshots, engine 0) or is
        applied past (best effort); ``after_snapshot``: the events were buffered while a
        snapshot was awaited, and one still past a gap after it is dropped (counted in
        ``gaps``) rather than asking for another snapshot: the next live event asks if one is
        needed, and an event with a made-up id cannot keep the worker re-syncing."""
        if dp_rank and not self.ranked:
            if not self.unranked:
                log.warning("worker %s: events of its data-parallel engine %d dropped: the "
                            "follower's target does not tell engines apart (its apply_event "
                            "takes no dp_rank)", worker_id, dp_rank)
            self.unranked += len(events)
            return
        recent = st.recent
        snapshots = self.snapshots and not dp_rank
        apply = self.target.apply_event
        if dp_rank:
            def apply(wid: int, event: Event, _apply=apply) -> None:
                _apply(wid, event, dp_rank)
        for i, event in enumerate(events):
            eid = event.event_id
            if eid == st.last_id + 1 and not st.ahead:      # the common case, inlined
                st.last_id = eid
                recent[eid % RECENT_EVENTS] = event
            elif st.seen(eid):
                before = st.applied_before(eid)
                if before is not None and before != event:
                    self.conflicts += 1
                    if snapshots:
                        log.warning("worker %s sent event %d twice with different contents: "
                                    "re-syncing it from its snapshot", worker_id, eid)
                        st.syncing = True
                        self._buffer(st, events[i + 1:])
                        return
                else:
                    self.duplicates += 1
                continue
            else:
                if eid != st.last_id + 1:
                    self.gaps += 1
                    if after_snapshot:
                        continue
                    if snapshots:
                        st.syncing = True
                        self._buffer(st, events[i:])
                        return
                st.applied(event)
            if isinstance(event, StoredEvent) and _loops(event):
                self.invalid += 1              # in order, but never applied
                continue
            apply(worker_id, event)
            self.applied += 1

    # -- snapshots ---------------------------------------------------------------------------
    def count_untrusted(self, events: int) -> None:
        """Count ``events`` dropped before they reached the follower, as untrusted."""
        with self.lock:
            self.untrusted += events

    def pending_snapshots(self) -> list[int]:
        """Workers waiting for a snapshot (only engine 0's stream ever waits for one)."""
        with self.lock:
            return [w for w, st in self.workers.items() if st.syncing]

    def expect_snapshot(self, worker_id: int) -> None:
        """Mark ``worker_id`` as syncing (buffer its live events until its snapshot arrives)."""
        with self.lock:
            st = self.workers.setdefault(worker_id, _Worker(None))
            st.syncing = True

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the worker's state by ``snapshot`` then apply buffered events after it."""
        wid = snapshot.identity.worker_id
        if not (type(wid) is int and 0 <= wid < MAX_WORKER_ID) or (
                self.trusted_workers is not None and wid not in self.trusted_workers):
            with self.lock:
                self.untrusted += 1
            return
        with self.lock:
            st = self.workers.get(wid) or _Worker(None)
            if (
                not st.syncing
                and st.publisher_id == snapshot.identity.publisher_id
                and st.last_id >= snapshot.last_event_id
            ):
                return  # already past this snapshot (e.g. a late reply to a broadcast request)
            buffered = [e for e in st.buffer] if st.publisher_id in (None, snapshot.identity.publisher_id) else []
            self.target.reset_worker(wid)
            for event in snapshot.events:
                self.target.apply_event(wid, event)
            st = self.workers[wid] = _Worker(snapshot.identity.publisher_id, snapshot.last_event_id)
            self.snapshots_applied += 1
            if buffered:
                buffered.sort(key=lambda e: e.event_id)
                self._apply(wid, st, buffered, after_snapshot=True)

    def give_up_sync(self, worker_id: int) -> None:
        """No snapshot available: apply what was buffered, best effort (gaps stay counted)."""
        with self.lock:
            st = self.workers.get(worker_id)
            if st is None or not st.syncing:
                return
            buffered, st.buffer, st.syncing = st.buffer, [], False
            if buffered and st.last_id == 0:
                st.last_id = buffered[0].event_id - 1     # joined late: history
            snapshots, self.snapshots = self.snapshots, False
            try:
                self._apply(worker_id, st, buffered)
            finally:
                self.snapshots = snapshots

    def last_event_id(self, worker_id: int, dp_rank: int = 0) -> int:
        """The last id of the engine's unbroken run of applied events (ids applied past a
        gap that has not filled are not counted)."""
        with self.lock:
            st = self.workers.get(engine_key(worker_id, dp_rank))
            return st.last_id if st else 0

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "workers": len({split_engine(key)[0] for key in self.workers}),
                "streams": len(self.workers),
                "applied": self.applied,
                "duplicates": self.duplicates,
                "conflicts": self.conflicts,
                "gaps": self.gaps,
                "restarts": self.restarts,
                "snapshots_applied": self.snapshots_applied,
                "untrusted": self.untrusted,
                "invalid": self.invalid,
                "unranked": self.unranked,
                "syncing": sum(1 for st in self.workers.values() if st.syncing),
            }


def follow_in_process(publisher, target: EventTarget) -> tuple[StreamFollower, Callable[[EventBatch], None]]:
    """Late-join an in-process publisher: returns the follower and the batch callback to feed.

    Register the callback with the publisher's :class:`~kvstrata.events.sinks.CallbackSink`
    *before* calling this, or call ``follower.feed_batch`` yourself; the snapshot is taken now.
    """
    follower = StreamFollower(target)
    follower.expect_snapshot(publisher.identity.worker_id)
    follower.apply_snapshot(publisher.snapshot())
    return follower, follower.feed_batch


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def decode_line(line: str, fmt: str = "auto", with_rank: bool = False) -> tuple:
    """One JSON line -> (worker_id, publisher_id or None, event); kvstrata or Dynamo format.
    ``with_rank``: (worker_id, publisher_id, event, dp_rank), the rank of the engine that
    wrote it (0 where the line names none)."""
    if fmt != "kvstrata" and formats.fast_decode_dynamo is not None:
        decoded = formats.fast_decode_dynamo(line, fmt == "auto", True)
        if decoded is not None:
            wid, event, dp_rank = decoded
            return (wid, None, event, dp_rank) if with_rank else (wid, None, event)
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise EventFormatError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EventFormatError("line must be a JSON object")
    if fmt == "dynamo" or (fmt == "auto" and "event" in obj and "storage_tier" in obj):
        wid, event, dp_rank = formats.decode_dynamo(obj, with_rank=True)
        return (wid, None, event, dp_rank) if with_rank else (wid, None, event)
    batch, dp_rank = formats.decode_kvstrata(obj, with_rank=True)
    if not isinstance(batch, EventBatch) or len(batch.events) != 1:
        raise EventFormatError("expected one event per line")
    decoded = batch.identity.worker_id, batch.identity.publisher_id, batch.events[0]
    return (*decoded, dp_rank) if with_rank else decoded


def read_events_file(path: str, fmt: str = "auto", torn: list[int] | None = None,
                     with_rank: bool = False) -> Iterator[tuple]:
    """Yield (worker_id, publisher_id, event) from a JSON-lines file (with ``with_rank``,
    (worker_id, publisher_id, event, dp_rank): see :func:`decode_line`); errors name the line.

    A last line without its newline that does not decode is a torn tail (a writer that
    stopped mid-line: a crash, a full disk): it is skipped, and its line number appended to
    ``torn`` when given. Any other bad line is an :class:`EventFormatError`.

    What the file says is applied as the workers' state, so it must be written by this user
    or root alone: a file another user owns, or one its group or others can write, is a
    :class:`~kvstrata.paths.NotPrivateError` (an ``OSError`` whose ``strerror`` says why)
    before anything is read (one that others may read is not refused: this only reads it).
    Links are followed: the file they lead to is checked."""
    raw = open_regular(path)
    try:            # /dev/null, the one device open_regular lets through, holds nothing
        info = os.fstat(raw.fileno())
        problem = writer_problem(info, root_ok=True) if stat.S_ISREG(info.st_mode) else None
        if problem:
            raise NotPrivateError(errno.EPERM, f"{problem}: events another user could have "
                                  f"written are not applied; make it the owner's alone "
                                  f"(chmod go-w)", path)
    except BaseException:
        raw.close()
        raise
    with io.TextIOWrapper(raw, encoding="utf-8") as f:
        lines = bounded_lines(f, MAX_LINE_BYTES)
        for n, line in enumerate(_named_lines(lines, path), 1):
            if not line.strip():
                continue
            try:
                yield decode_line(line, fmt, with_rank)
            except EventFormatError as exc:
                if not line.endswith("\n") and not f.read(1):
                    log.warning("%s:%d: torn last line skipped", path, n)
                    if torn is not None:
                        torn.append(n)
                    return
                raise EventFormatError(f"{path}:{n}: {exc}") from None


def _named_lines(lines: Iterator[str], path: str) -> Iterator[str]:
    """``lines``, a line over the bound being an :class:`EventFormatError` naming ``path``."""
    try:
        yield from lines
    except InputTooLargeError as exc:
        raise EventFormatError(f"{path}: {exc}") from None


def follow_file(path: str, follower: StreamFollower, fmt: str = "auto") -> int:
    """Feed every event of a file into ``follower``; returns the number of lines read."""
    n = 0
    for wid, pid, event, dp_rank in read_events_file(path, fmt, with_rank=True):
        follower.feed(wid, pid, [event], dp_rank)
        n += 1
    return n


# --------------------------------------------------------------------------------------------
# NATS
# --------------------------------------------------------------------------------------------


class NatsFollower:
    """Subscribes to a NATS subject and feeds a :class:`StreamFollower`.

    ``jetstream=True`` reads the stream from its first message (an ordered consumer), so a
    late subscriber replays history; otherwise core NATS plus snapshots (late join protocol).
    """

    def __init__(
        self,
        url: str,
        subject: str,
        target: EventTarget,
        *,
        format: str = "kvstrata",
        jetstream: bool = False,
        snapshots: bool = True,
        snapshot_timeout: float = 2.0,
        on_batch: Callable[[int], None] | None = None,
        trusted_workers: Iterable[int] | None = None,
        per_worker: bool = False,
    ) -> None:
        from kvstrata.events.natswire import with_credentials
        from kvstrata.events.sinks import EVENT_FORMATS, check_subject

        if format not in EVENT_FORMATS:
            raise ValueError(f"format must be one of {EVENT_FORMATS}, got {format!r}")
        if per_worker and jetstream:
            raise ValueError("per_worker follows core NATS only (not with jetstream)")
        self.per_worker = per_worker
        """Follow ``SUBJECT.worker.*`` and apply from ``SUBJECT.worker.<id>`` only the events
        of worker ``<id>`` (:func:`~kvstrata.events.sinks.worker_subject`): with NATS
        permissions giving each subject to one worker's user, no user speaks for another."""
        self.url = with_credentials(url)
        self.subject = check_subject(subject)
        self.format = format
        self.jetstream = jetstream
        self.snapshot_timeout = snapshot_timeout
        self.follower = StreamFollower(target, snapshots=snapshots and format == "kvstrata",
                                       trusted_workers=trusted_workers)
        self.on_batch = on_batch
        self.decode_errors = 0
        self.messages = 0
        self._aio = None
        self._nc = None
        self._sync_wakeup = None
        self._tasks: list = []
        self._connect_errors: list[BaseException] = []

    def start(self, timeout: float = 5.0) -> "NatsFollower":
        """Connect and subscribe (raises TimeoutError if the server cannot be reached)."""
        from kvstrata.events._aio import LoopThread

        self._aio = LoopThread(f"kvstrata-follow-{self.subject}")
        try:
            self._aio.run(self._start(), timeout)
        except TimeoutError:
            self._aio.stop()
            last = (f" (last errors: {'; '.join(map(str, self._connect_errors))})"
                    if self._connect_errors else "")
            raise TimeoutError(f"no connection to the NATS server within {timeout:g} s"
                               f"{last}") from None
        except BaseException:
            self._aio.stop()
            raise
        return self

    async def _start(self) -> None:
        import asyncio

        from kvstrata.events.sinks import nats_connect

        self._nc = await nats_connect(self.url, "kvstrata-follower",
                                      errors=self._connect_errors)
        self._sync_wakeup = asyncio.Event()
        if self.jetstream:
            from nats.js.api import DeliverPolicy

            js = self._nc.jetstream()
            await js.subscribe(self.subject, cb=self._on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        elif self.per_worker:
            await self._nc.subscribe(f"{self.subject}.worker.*", cb=self._on_msg)
        else:
            await self._nc.subscribe(self.subject, cb=self._on_msg)
        await self._nc.flush(timeout=2)
        self._tasks.append(asyncio.get_running_loop().create_task(self._sync_loop()))

    async def _on_msg(self, msg) -> None:
        self.messages += 1
        try:
            if self.format == "kvstrata":
                batch, dp_rank = formats.decode_kvstrata(msg.data, with_rank=True)
                if not isinstance(batch, EventBatch):
                    return
                if not self._from_its_subject(msg.subject, batch.identity.worker_id,
                                              len(batch.events)):
                    return
                self.follower.feed(batch.identity.worker_id, batch.identity.publisher_id,
                                   batch.events, dp_rank)
                n = len(batch.events)
            else:
                wid, event, dp_rank = formats.decode_dynamo(msg.data, with_rank=True)
                if not self._from_its_subject(msg.subject, wid, 1):
                    return
                self.follower.feed(wid, None, [event], dp_rank)
                n = 1
        except EventFormatError as exc:
            self.decode_errors += 1
            log.warning("bad event message on %s: %s", msg.subject, exc)
            return
        except Exception:  # backstop: one bad message must never stop the follower
            self.decode_errors += 1
            log.exception("could not apply event message on %s", msg.subject)
            return
        if self.on_batch is not None:
            self.on_batch(n)
        if self.follower.pending_snapshots():
            self._sync_wakeup.set()

    def _from_its_subject(self, subject: str, worker_id: int, events: int) -> bool:
        """Whether events of ``worker_id`` may come from ``subject`` (always, unless
        ``per_worker``); refused ones are counted as untrusted."""
        if not self.per_worker or subject == f"{self.subject}.worker.{worker_id}":
            return True
        self.follower.count_untrusted(events)
        return False

    async def _sync_loop(self) -> None:
        while True:
            await self._sync_wakeup.wait()
            self._sync_wakeup.clear()
            for wid in self.follower.pending_snapshots():
                try:
                    snap = await self._request_snapshot(wid)
                except Exception:  # the loop must survive a bad reply: it serves every worker
                    log.exception("snapshot request for worker %s failed", wid)
                    snap = None
                if snap is None:
                    log.warning("no snapshot from worker %s; following best effort", wid)
                    self.follower.give_up_sync(wid)
                else:
                    self.follower.apply_snapshot(snap)

    async def _request_snapshot(self, worker_id: int) -> Snapshot | None:
        import asyncio

        from kvstrata.events.sinks import snapshot_subject

        nc = self._nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(snapshot_subject(self.subject, worker_id), b"", reply=inbox)
            chunks = SnapshotChunks()
            deadline = time.monotonic() + self.snapshot_timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                try:
                    msg = await sub.next_msg(timeout=remaining)
                except (asyncio.TimeoutError, Exception):
                    return None
                try:
                    part, index, last = formats.decode_snapshot_chunk(msg.data)
                except EventFormatError as exc:
                    log.warning("bad snapshot reply from worker %s: %s", worker_id, exc)
                    return None
                if part.identity.worker_id != worker_id:
                    return None
                whole = chunks.add(part, index, last)
                if chunks.dropped:
                    log.warning("snapshot reply from worker %s: chunks missing, repeated or "
                                "of another publisher", worker_id)
                    return None
                if whole is not None:
                    return whole
        finally:
            await sub.unsubscribe()

    async def _discover(self, window: float) -> int:
        from kvstrata.events.sinks import snapshot_subject

        nc = self._nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        chunks = SnapshotChunks()
        done = 0
        try:
            await nc.publish(snapshot_subject(self.subject), b"", reply=inbox)
            deadline = time.monotonic() + window
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=remaining)
                except Exception:
                    break
                try:
                    whole = chunks.add(*formats.decode_snapshot_chunk(msg.data))
                except EventFormatError:
                    continue
                if whole is not None:
                    self.follower.apply_snapshot(whole)
                    done += 1
        finally:
            await sub.unsubscribe()
        return done

    def discover(self, window: float = 0.5) -> int:
        """Ask every publisher on the subject for its snapshot (``SUBJECT.snapshot``), apply
        the replies that arrive within ``window`` seconds; returns how many were applied.

        With ``per_worker`` a broadcast is not asked (every worker's user may hear it, so any
        could answer for another): each trusted worker is asked on its own subject, or,
        with no ``trusted_workers``, nobody, and each worker joins on its first event."""
        if self.per_worker:
            wanted = sorted(self.follower.trusted_workers or ())
            for wid in wanted:
                self.follower.expect_snapshot(wid)
            if wanted:
                self._aio.loop.call_soon_threadsafe(self._sync_wakeup.set)
            return 0
        return self._aio.run(self._discover(window), window + 5.0)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (sleeping, not spinning hot) until ``predicate()`` is true."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    def close(self) -> None:
        if self._aio is None:
            return
        for t in self._tasks:
            self._aio.loop.call_soon_threadsafe(t.cancel)
        if self._nc is not None:
            try:
                self._aio.run(self._nc.close(), 2.0)
            except Exception:
                pass
        self._aio.stop()
        self._aio = None

    def __enter__(self) -> "NatsFollower":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "EventTarget",
    "NatsFollower",
    "PublisherIdentity",
    "StreamFollower",
    "WorkerStates",
    "decode_line",
    "engine_key",
    "split_engine",
    "follow_file",
    "follow_in_process",
    "read_events_file",
]


def _takes_rank(target: object) -> bool:
    """Whether ``target.apply_event`` takes a third argument (a data-parallel rank)."""
    try:
        parameters = inspect.signature(target.apply_event).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
