"""Event sinks: in-process callback, JSON-lines files, ZMQ PUB (vLLM format), NATS.

(Over 400 lines on purpose: one concern, handing the publisher's batches to a transport; over
half is the NATS sink, whose connections, JetStream acks and snapshot service share one
lifecycle.)

Each sink's ``send`` runs on the publisher thread only. Transport trouble that is worth a
retry (server down, not yet connected, buffer full) raises
:class:`~kvstrata.events.publisher.SinkUnavailableError`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import stat
import threading
import time
from typing import Callable

from kvstrata.events import formats
from kvstrata.events.model import EventBatch
from kvstrata.events.natswire import with_credentials
from kvstrata.paths import write_all
from kvstrata.redact import redacted
from kvstrata.events.publisher import (EventPublisher, Sink, SinkUnavailableError, Warnings,
                                       _one_line)

log = logging.getLogger(__name__)

EVENT_FORMATS = ("kvstrata", "dynamo")


class NullSink(Sink):
    """Discards every batch (events are still numbered, counted and snapshot-able)."""

    kind = "none"

    def send(self, batch: EventBatch) -> None:
        return None


class CallbackSink(Sink):
    """Calls ``callback(batch)`` on the publisher thread (in-process consumers)."""

    kind = "callback"

    def __init__(self, callback: Callable[[EventBatch], None]) -> None:
        self.callback = callback

    def send(self, batch: EventBatch) -> None:
        self.callback(batch)


class MemorySink(Sink):
    """Keeps every batch in memory (``batches``/``events``); the default ``callback`` sink."""

    kind = "callback"

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self._lock = threading.Lock()

    def send(self, batch: EventBatch) -> None:
        with self._lock:
            self.batches.append(batch)

    @property
    def events(self) -> list:
        with self._lock:
            return [e for b in self.batches for e in b.events]


class JsonlFileSink(Sink):
    """Appends JSON lines to ``path``: kvstrata events (``format="kvstrata"``) or Dynamo
    RouterEvents (``format="dynamo"``), one ``write`` per batch. Only whole lines land: a
    batch that fails part-way (a full disk) is cut back off the file, so readers never meet a
    torn line that this sink wrote."""

    def __init__(self, path: str, format: str = "kvstrata", dp_rank: int = 0, fsync: bool = False) -> None:
        if format not in EVENT_FORMATS:
            raise ValueError(f"file format must be one of {EVENT_FORMATS}, got {format!r}")
        self.path = path
        self.format = format
        self.dp_rank = dp_rank
        self.fsync = fsync
        self.kind = "jsonl" if format == "kvstrata" else "dynamo-json"
        self._file = None
        self._lock = threading.Lock()

    def open(self, publisher: EventPublisher) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"event file directory does not exist: {parent}")
        # not blocking while it opens: a FIFO nobody reads would hold the open for ever
        # (ENXIO instead); writes then block as to any file
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise OSError(exc.errno, "a FIFO no process reads", self.path) from None
            raise
        os.set_blocking(fd, True)
        self._file = fd

    def send(self, batch: EventBatch) -> None:
        if self.format == "kvstrata":
            text = formats.encode_jsonl(batch, self.dp_rank)
        else:
            text = formats.encode_dynamo_jsonl(batch, self.dp_rank)
        data = text.encode("utf-8")
        with self._lock:
            assert self._file is not None, "sink not opened"
            start = os.fstat(self._file).st_size
            try:
                write_all(self._file, data)
            except OSError:
                try:
                    os.ftruncate(self._file, start)      # whole lines only
                except OSError:
                    pass
                raise

    def flush(self, timeout: float) -> bool:
        with self._lock:
            if self._file is not None and self.fsync:
                os.fsync(self._file)
        return True

    def close(self, timeout: float) -> None:
        with self._lock:
            if self._file is not None:
                os.close(self._file)
                self._file = None

    def describe(self) -> str:
        return f"{self.kind}:{self.path}"


class ZmqSink(Sink):
    """ZMQ PUB socket speaking vLLM's KV-event protocol: frames ``(topic, seq, payload)``,
    ``seq`` an 8-byte big-endian batch counter from 0, ``payload`` a msgpack KVEventBatch.

    Binds ``endpoint`` by default (like a vLLM engine); ``connect=True`` connects instead.
    Sends never block: a PUB socket drops messages for slow subscribers at its HWM.

    A ``BlockStored`` carries ``token_ids`` only when the records carry them (pools with
    ``keep_tokens``, and the publisher's ``keep_tokens``); without them it has ``token_ids:
    []``, and a consumer that recomputes block hashes from the tokens (Dynamo's router)
    learns nothing from it. The sink warns once when it first sends such an event (at open if
    the publisher strips tokens) and counts them in ``stored_without_tokens``.
    """

    kind = "zmq"

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        layout: str = "map",
        connect: bool = False,
        hwm: int = 100_000,
        dp_rank: int = 0,
    ) -> None:
        if layout not in formats.VLLM_LAYOUTS:
            raise ValueError(f"vLLM layout must be one of {formats.VLLM_LAYOUTS}, got {layout!r}")
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.layout = layout
        self.connect = connect
        self.hwm = hwm
        self.dp_rank = dp_rank
        self._seq = 0
        self._sock = None
        self._bound_ipc: str | None = None
        self.stored_without_tokens = 0
        """``BlockStored`` events sent with ``token_ids: []`` (see the class docstring)."""
        self._warned_tokens = False

    def open(self, publisher: EventPublisher) -> None:
        import zmq

        if not publisher.keep_tokens:
            self._warn_no_tokens("the publisher was made with keep_tokens=False")
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUB)
        sock.set_hwm(self.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        ipc = self._ipc_path()
        if ipc is not None and os.path.lexists(ipc) and not stat.S_ISSOCK(os.lstat(ipc).st_mode):
            sock.close(0)       # ZMQ would unlink whatever is there to bind its socket
            raise OSError(f"cannot bind ZMQ PUB to {self.endpoint}: {ipc} exists and is not a "
                          f"socket; not replaced")
        try:
            if self.connect:
                sock.connect(self.endpoint)
            else:
                sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(f"cannot {'connect' if self.connect else 'bind'} ZMQ PUB to {self.endpoint}: {exc}") from None
        self._sock = sock
        self._bound_ipc = ipc

    def _ipc_path(self) -> str | None:
        """The file an ``ipc://`` endpoint this sink binds is (None: another transport, or
        connecting)."""
        if self.connect or not self.endpoint.startswith("ipc://"):
            return None
        return self.endpoint[len("ipc://"):]

    def send(self, batch: EventBatch) -> None:
        import zmq

        payload = formats.encode_vllm_items(batch.items, time.time(), self.dp_rank, self.layout)
        without = sum(1 for item in batch.items if item[1] == 0 and (item[6] is None or None in item[6]))
        if without:
            self._warn_no_tokens("the pools do not keep token ids (kvstrata config keep_tokens: false)")
        try:
            self._sock.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise SinkUnavailableError("ZMQ PUB would block") from None
        self._seq += 1
        self.stored_without_tokens += without      # sent: a batch retried counts once

    def _warn_no_tokens(self, why: str) -> None:
        if self._warned_tokens:
            return
        self._warned_tokens = True
        log.warning("ZMQ event sink %s: BlockStored events go out with token_ids: [] because %s; "
                    "consumers that recompute block hashes from token ids (Dynamo's KV router) "
                    "cannot use them. Set keep_tokens: true in kvstrata's config to send them",
                    self.endpoint, why)

    def close(self, timeout: float) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            ipc, self._bound_ipc = self._bound_ipc, None
            if ipc is not None:      # the socket file this sink made goes with it
                try:
                    if stat.S_ISSOCK(os.lstat(ipc).st_mode):
                        os.unlink(ipc)
                except OSError:
                    pass

    def describe(self) -> str:
        return f"zmq:{self.endpoint}"


_SUBJECT_RE = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


def check_subject(subject: str) -> str:
    if not _SUBJECT_RE.match(subject):
        raise ValueError(
            f"invalid NATS subject {subject!r}: use dot-separated tokens of letters, digits, '_' or '-' (no wildcards)"
        )
    return subject


def stream_name_for(subject: str) -> str:
    """Default JetStream stream name for ``subject`` (stream names cannot contain dots)."""
    return "KVSTRATA_" + re.sub(r"[^A-Za-z0-9_\-]", "_", subject).upper()


def worker_subject(subject: str, worker_id: int) -> str:
    """Where a ``per_worker`` sink publishes the events of ``worker_id``:
    ``SUBJECT.worker.<worker_id>`` (a subject NATS permissions can give to that worker's
    user alone; a follower with ``per_worker`` applies only that worker's events from it)."""
    return f"{subject}.worker.{worker_id}"


def snapshot_subject(subject: str, worker_id: int | None = None) -> str:
    """Request subject of the snapshot service: ``SUBJECT.snapshot[.WORKER_ID]``."""
    base = f"{subject}.snapshot"
    return base if worker_id is None else f"{base}.{worker_id}"


async def nats_connect(url: str, name: str, *, max_reconnect_attempts: int = -1,
                       errors: list | None = None):
    """nats-py connect that retries forever (cancel the task to give up), quietly; the last
    three distinct errors are kept in ``errors`` when given (e.g. the server's
    "Authorization Violation", for the message of a caller that gives up)."""
    import nats

    async def _quiet(exc: Exception) -> None:
        log.debug("nats %s: %s", redacted(url), exc)
        if errors is not None and str(exc) not in map(str, errors):
            errors.append(exc)               # a few distinct ones: the server's reason and
            del errors[:-3]                  # the reset that follows it both show

    server, credentials = _split_credentials(url)
    return await nats.connect(
        servers=[server],
        **credentials,
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=0.1,
        connect_timeout=1.0,
        error_cb=_quiet,
        disconnected_cb=_noop,
        reconnected_cb=_noop,
    )


async def _noop() -> None:
    return None


def _split_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its ``user:password@`` or ``token@``, and them, percent-decoded, as
    nats-py's ``user``/``password`` or ``token`` (nats-py would send them still encoded)."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None:
        return url, {}
    host = parts.netloc.rpartition("@")[2]
    server = urlunsplit(parts._replace(netloc=host))
    if parts.password is None:
        return server, {"token": unquote(parts.username)}
    return server, {"user": unquote(parts.username), "password": unquote(parts.password)}


class NatsSink(Sink):
    """Publishes on a NATS subject; serves snapshots on ``SUBJECT.snapshot[.WORKER_ID]``.

    ``format="kvstrata"``: one JSON message per batch. ``format="dynamo"``: one Dynamo
    RouterEvent JSON per event. ``jetstream=True`` makes sure a file-backed stream holds the
    subject and waits for the server's ack of every message (with a ``Nats-Msg-Id`` so a retried
    batch is stored once). Connection happens in the background and never blocks the caller;
    until it succeeds ``send`` raises :class:`SinkUnavailableError` (the publisher retries).

    Core NATS messages (no JetStream) go out on a connection of the sink's own that the
    publisher's thread writes itself (:mod:`kvstrata.events.natswire`: no hand-over to nats-py's
    event-loop thread per batch); nats-py's connection serves snapshots. ``direct=False``
    publishes through nats-py instead, as JetStream always does and as the sink does when the
    server requires TLS. A message over the server's ``max_payload`` (an event larger than it,
    which the publisher's event size limits make rare) is never sent: the batch's other
    messages are, and ``send`` reports that message's events left out (the publisher counts
    them dropped; followers see the gap and re-sync from a snapshot). With JetStream, a stream
    that disappeared (deleted, or a server restarted without its store) is made again.
    """

    kind = "nats"

    def __init__(
        self,
        url: str,
        subject: str,
        *,
        format: str = "kvstrata",
        jetstream: bool = False,
        stream: str | None = None,
        serve_snapshots: bool = True,
        send_timeout: float = 2.0,
        dp_rank: int = 0,
        direct: bool = True,
        per_worker: bool = False,
    ) -> None:
        if format not in EVENT_FORMATS:
            raise ValueError(f"NATS event format must be one of {EVENT_FORMATS}, got {format!r}")
        self.url = with_credentials(url)
        self.subject = check_subject(subject)
        self.format = format
        self.jetstream = jetstream
        self.stream = stream or stream_name_for(subject)
        self.serve_snapshots = serve_snapshots
        self.send_timeout = send_timeout
        self.dp_rank = dp_rank
        if per_worker and jetstream:
            raise ValueError("per_worker publishes on core NATS only (not with jetstream)")
        self.per_worker = per_worker
        self.publish_subject = self.subject
        """Where events go: ``subject``, or with ``per_worker`` the worker's own subject
        (:func:`worker_subject`, known once the publisher opens the sink)."""
        self._subject_bytes = self.subject.encode()
        self.direct = direct and not jetstream
        self._publisher: EventPublisher | None = None
        self._aio = None
        self._wire = None
        self._nc = None
        self._js = None
        self._ready = threading.Event()
        self._connect_task = None
        self.connect_error: BaseException | None = None
        self._warnings = Warnings()
        self.too_large_events = 0
        """Events left out in messages over the server's ``max_payload``."""
        self.streams_recreated = 0
        self.snapshot_errors = 0
        """Snapshot requests whose reply failed (logged)."""

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self, publisher: EventPublisher) -> None:
        from kvstrata.events._aio import LoopThread

        self._publisher = publisher
        if self.per_worker:
            self.publish_subject = worker_subject(self.subject, publisher.identity.worker_id)
            self._subject_bytes = self.publish_subject.encode()
        self._aio = LoopThread(f"kvstrata-nats-{self.subject}")
        self._connect_task = self._aio.submit(self._connect())
        if self.direct:
            from kvstrata.events.natswire import NatsPublishConnection

            self._wire = NatsPublishConnection(
                self.url, f"kvstrata-publisher-{publisher.identity.worker_id}", self._aio,
                send_timeout=self.send_timeout)
            self._wire.start()

    async def _connect(self) -> None:
        try:
            nc = await nats_connect(self.url, f"kvstrata-publisher-{self._publisher.identity.worker_id}")
            if self.jetstream:
                js = nc.jetstream()
                await self._ensure_stream(js)
                self._js = js
            if self.serve_snapshots:
                wid = self._publisher.identity.worker_id
                await nc.subscribe(snapshot_subject(self.subject), cb=self._on_snapshot_request)
                await nc.subscribe(snapshot_subject(self.subject, wid), cb=self._on_snapshot_request)
                await nc.flush(timeout=2)
            self._nc = nc
            self._ready.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a config error (e.g. stream clash): report, stay unavailable
            self.connect_error = exc
            log.error("NATS sink %s: %s", self.describe(), exc)

    async def _ensure_stream(self, js) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        try:
            info = await js.stream_info(self.stream)
            if self.subject not in (info.config.subjects or []):
                raise ValueError(f"JetStream stream {self.stream!r} exists but does not hold subject {self.subject!r}")
        except NotFoundError:
            await js.add_stream(
                StreamConfig(name=self.stream, subjects=[self.subject], storage=StorageType.FILE)
            )

    def _direct_wire(self):
        """The sink's own publishing connection, or None when publishing through nats-py."""
        wire = self._wire
        return wire if wire is not None and not wire.unsupported else None

    def flush(self, timeout: float) -> bool:
        wire = self._direct_wire()
        if wire is not None:
            return wire.flush(timeout)
        if not self._ready.is_set() or self._nc is None or not self._nc.is_connected:
            return False
        try:
            self._aio.run(self._nc.flush(timeout=max(timeout, 0.01)), timeout + 0.5)
            return True
        except Exception:
            return False

    def close(self, timeout: float) -> None:
        if self._aio is None:
            return
        if self._connect_task is not None and not self._connect_task.done():
            self._connect_task.cancel()
        if self._wire is not None:
            self._wire.close(timeout)
        if self._nc is not None:
            try:
                self._aio.run(self._nc.close(), max(timeout, 0.2))
            except Exception:
                pass
        self._aio.stop()

    @property
    def connected(self) -> bool:
        """Both connections up (events can go out, snapshots are served)."""
        wire = self._direct_wire()
        return (wire is None or wire.connected) and self._ready.is_set() and self._nc is not None \
            and self._nc.is_connected

    def describe(self) -> str:
        return f"nats:{redacted(self.url)}/{self.publish_subject}"

    # -- data path ---------------------------------------------------------------------------
    def encode(self, batch: EventBatch, max_payload: int) -> tuple[list[bytes], list[int]]:
        """The batch's messages (at most ``max_payload`` bytes each where an event allows) and
        the first event id of each."""
        if self.format == "kvstrata":
            return formats.encode_batch_messages(batch, max_payload)
        return formats.encode_dynamo_messages(batch, self.dp_rank), [item[0] for item in batch.items]

    def send(self, batch: EventBatch) -> int:
        """Publish the batch; returns how many of its events were left out (in messages over
        the server's ``max_payload``)."""
        wire = self._direct_wire()
        if wire is not None:
            limit = wire.max_payload
            payloads, ids = self.encode(batch, limit)
            return self._left_out(batch, payloads, ids, wire.publish(self._subject_bytes, payloads), limit)
        if not self._ready.is_set():
            raise SinkUnavailableError(f"not connected to {redacted(self.url)}" + (f": {self.connect_error}" if self.connect_error else ""))
        limit = getattr(self._nc, "max_payload", 1 << 20) or (1 << 20)
        payloads, ids = self.encode(batch, limit)
        too_large = [k for k, p in enumerate(payloads) if len(p) > limit]  # nats-py refuses them
        skip = set(too_large)
        self._publish_now([p for k, p in enumerate(payloads) if k not in skip],
                          [i for k, i in enumerate(ids) if k not in skip], batch)
        return self._left_out(batch, payloads, ids, too_large, limit)

    def _left_out(self, batch: EventBatch, payloads: list[bytes], ids: list[int],
                  too_large: list[int], limit: int) -> int:
        """How many events the messages ``too_large`` (indices) held; counted and logged."""
        if not too_large:
            return 0
        position = {item[0]: k for k, item in enumerate(batch.items)}
        starts = [position[i] for i in ids] + [len(batch.items)]
        events = sum(starts[m + 1] - starts[m] for m in too_large)
        self.too_large_events += events
        if self._warnings.due("too_large"):
            m = too_large[0]
            log.warning("NATS sink %s: a %d-byte message (events from id %d) is over the "
                        "server's max_payload (%d) and was not sent; %d events left out so far "
                        "(followers re-sync from a snapshot)", self.describe(), len(payloads[m]),
                        ids[m], limit, self.too_large_events)
        return events

    def _publish_now(self, payloads: list[bytes], ids: list[int], batch: EventBatch) -> None:
        """Publish through nats-py (on its loop), waiting; transport trouble raises
        :class:`SinkUnavailableError`."""
        if not payloads:
            return
        try:
            self._aio.run(self._publish(payloads, ids, batch.identity.publisher_id), self.send_timeout + 1.0)
        except SinkUnavailableError:
            raise
        except Exception as exc:
            from nats import errors as nerr

            if isinstance(exc, (TimeoutError, asyncio.TimeoutError, nerr.Error, OSError)):
                raise SinkUnavailableError(f"NATS publish failed: {type(exc).__name__}: {exc}") from None
            raise

    async def _publish(self, payloads: list[bytes], ids: list[int], publisher_id: int) -> None:
        nc = self._nc
        if self._js is None:
            for p in payloads:
                await nc.publish(self.publish_subject, p)
            return
        if not nc.is_connected:
            raise SinkUnavailableError("JetStream publish while disconnected")
        from nats.js.errors import NoStreamResponseError, NotFoundError

        acks = [
            self._js.publish(
                self.subject, p, timeout=self.send_timeout, headers={"Nats-Msg-Id": f"{publisher_id:016x}-{i}"}
            )
            for p, i in zip(payloads, ids)
        ]
        try:
            await asyncio.gather(*acks)
        except (NoStreamResponseError, NotFoundError) as exc:  # no stream holds the subject
            await self._recreate_stream(exc)
            raise SinkUnavailableError(f"JetStream stream {self.stream} was missing ({exc}); "
                                       f"made again") from None

    async def _recreate_stream(self, why: BaseException) -> None:
        """Make the stream again (deleted, or the server restarted without its store); the
        batch is then retried. :class:`SinkUnavailableError` if that fails."""
        try:
            await self._ensure_stream(self._js)
        except Exception as exc:
            raise SinkUnavailableError(f"JetStream stream {self.stream} is missing ({why}) and "
                                       f"could not be made: {type(exc).__name__}: {exc}") from None
        self.streams_recreated += 1
        if self._warnings.due("stream"):
            log.warning("NATS sink %s: JetStream stream %s was missing (%s): made it again (%d "
                        "times so far); the events it held before are gone", self.describe(),
                        self.stream, why, self.streams_recreated)

    async def _on_snapshot_request(self, msg) -> None:
        if not msg.reply:
            return
        try:
            snap = self._publisher.snapshot()
            limit = min(formats.SNAPSHOT_CHUNK_BYTES, self._nc.max_payload or formats.SNAPSHOT_CHUNK_BYTES)
            for chunk in formats.encode_snapshot(snap, limit):
                await self._nc.publish(msg.reply, chunk)
        except Exception as exc:   # the requester gives up or asks again; say why here
            self.snapshot_errors += 1
            if self._warnings.due("snapshot"):
                log.warning("NATS sink %s: a snapshot reply failed: %s (%d failed so far)",
                            self.describe(), _one_line(exc), self.snapshot_errors)
