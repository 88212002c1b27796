"""Event sinks: in-process callback, JSON-lines files, ZMQ PUB (vLLM format), NATS.

(Over 400 lines on purpose: one concern, handing the publisher's batches to a transport; over
half is the NATS sink, whose connections, JetStream acks and snapshot service share one
lifecycle.)

Events carry the prompts (block hashes, token ids): an event file and a bound ``ipc://``
socket are this user's alone (:func:`open_event_file`, :func:`_bind_ipc_privately`).

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
import secrets
import stat
import threading
import time
from typing import Callable

from kvstrata.events import formats
from kvstrata.events.model import EventBatch
from kvstrata.events.natswire import with_credentials
from kvstrata.paths import NotPrivateError, check_private_file, write_all, writer_problem
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


def _event_file_refusal(info: os.stat_result) -> str | None:
    """Why an event file of status ``info`` is not written (None: it may be). The events
    carry the prompts' block hashes and token ids, and readers (``kvstrata indexer --file``)
    apply what the file holds: a regular file or a FIFO must be this user's and writable by
    no one else; a character device (``/dev/null``, ``/dev/full``) this user's or root's
    (only root makes devices; another user's terminal is refused); nothing else is written."""
    mode = info.st_mode
    if stat.S_ISCHR(mode):
        if info.st_uid in (os.geteuid(), 0):
            return None
        return (f"event file is a device of uid {info.st_uid}, not of this user (uid "
                f"{os.geteuid()}) or root: events are not written to another user's device")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        return "event file is not a regular file, a FIFO or a character device"
    problem = writer_problem(info)
    if problem and info.st_uid != os.geteuid():
        return (f"event file {problem}: events carry prompts' token ids and are not written "
                f"into another user's file (who owns it reads them, and can add forged ones); "
                f"remove it or name another path")
    if problem:
        return (f"event file {problem}: others could add forged events; make it the owner's "
                f"alone (chmod go-rw) or name another path")
    return None


def event_file_problem(path: str) -> str | None:
    """What would make :class:`JsonlFileSink` refuse ``path`` as it is now, found without
    opening or creating anything (None: nothing, or no file there yet): a symbolic link,
    another user's file, one others can write (see :class:`JsonlFileSink`). For checking a
    sink spec at start, before the sink is opened."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return _LINK_REFUSED
    return _event_file_refusal(info)


_LINK_REFUSED = ("event file is a symbolic link: not followed (whoever made it chooses which "
                 "file the events go to); name the file itself")


def open_event_file(path: str) -> int:
    """A descriptor appending to the event file ``path``, created 0600 whatever the umask
    if there is none; :class:`~kvstrata.paths.NotPrivateError` naming ``path`` if it is a
    symbolic link (not followed), another user's file or one others can write (see
    :func:`_event_file_refusal`); an own file others may read is made 0600. A FIFO no
    process reads is ``OSError(ENXIO)`` at once rather than an open that waits for ever."""
    # not blocking while it opens: a FIFO nobody reads would hold the open for ever
    # (ENXIO instead); writes then block as to any file
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                     | os.O_NONBLOCK | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(exc.errno, "a FIFO no process reads", path) from None
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise NotPrivateError(errno.ELOOP, _LINK_REFUSED, path) from None
        raise
    try:
        info = os.fstat(fd)
        refusal = _event_file_refusal(info)
        if refusal:
            raise NotPrivateError(errno.EPERM, refusal, path)
        if stat.S_ISREG(info.st_mode):
            check_private_file(fd, path)         # read access of group and others taken back
        elif stat.S_ISFIFO(info.st_mode) and info.st_mode & 0o077:
            os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class JsonlFileSink(Sink):
    """Appends JSON lines to ``path``: kvstrata events (``format="kvstrata"``) or Dynamo
    RouterEvents (``format="dynamo"``), one ``write`` per batch. Only whole lines land: a
    batch that fails part-way (a full disk) is cut back off the file, so readers never meet a
    torn line that this sink wrote.

    The events carry the prompts (block hashes; token ids with ``keep_tokens``): the file is
    created 0600 whatever the umask, never through a symbolic link, and an existing file must
    be this user's and writable by no one else (:func:`open_event_file`), else opening the
    sink is a :class:`~kvstrata.paths.NotPrivateError` naming the path."""

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
        self._file = open_event_file(self.path)

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
        self._bound_inode: tuple[int, int] | None = None
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
            elif ipc is not None:
                self._bound_inode = _bind_ipc_privately(sock, ipc, self.endpoint)
            else:
                sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(f"cannot {'connect' if self.connect else 'bind'} ZMQ PUB to {self.endpoint}: {exc}") from None
        except BaseException:
            sock.close(0)
            raise
        self._sock = sock
        self._bound_ipc = ipc

    def _ipc_path(self) -> str | None:
        """The file an ``ipc://`` endpoint this sink binds is (None: another transport,
        connecting, an abstract ``@name`` or ZMQ's wildcard ``*``, which name no file)."""
        if self.connect or not self.endpoint.startswith("ipc://"):
            return None
        path = self.endpoint[len("ipc://"):]
        return None if path.startswith("@") or path == "*" else path

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
                    info = os.lstat(ipc)
                    if stat.S_ISSOCK(info.st_mode) and \
                            (info.st_dev, info.st_ino) == self._bound_inode:
                        os.unlink(ipc)
                except OSError:
                    pass

    def describe(self) -> str:
        return f"zmq:{self.endpoint}"


MAX_IPC_PATH_BYTES = 107
"""Longest ``ipc://`` path a socket binds (``sun_path`` less its NUL)."""


def _bind_ipc_privately(sock, path: str, endpoint: str) -> tuple[int, int]:
    """Bind the ZMQ socket ``sock`` at the file ``path`` so that only this user (and root)
    can connect to it, whatever the umask; returns the (device, inode) of the socket file.

    ZMQ makes its socket file ``0777 & ~umask`` (0777 under umask 0: any local user could
    subscribe to the events, which carry the prompts), and a bind then chmod leaves a window.
    So the socket is bound inside a new directory beside ``path`` that is this user's alone
    (0700; checked and used through its descriptor, so a directory put in its place is
    noticed), made 0600 there where no one else can reach it, and then hard-linked as
    ``path``: a link never replaces what is there. (Not a tightened umask around the bind: the
    umask is the whole process's, and other threads create files meanwhile.) A socket already
    at ``path`` (a run that did not clean up) is replaced, as ZMQ's own bind does; anything
    else is refused before this is called. The private directory's path must fit a socket
    address too (:data:`MAX_IPC_PATH_BYTES`): a path 18 bytes longer than its directory at
    most."""
    def refused(why: str, code: int = errno.EPERM) -> OSError:
        return OSError(code, f"cannot bind ZMQ PUB to {endpoint}: {why}")

    private = os.path.join(os.path.dirname(path) or ".", f".kvs-{secrets.token_hex(5)}")
    bound = os.path.join(private, "s")
    for name in (path, bound):
        if len(os.fsencode(name)) > MAX_IPC_PATH_BYTES:
            raise refused(f"{name} is longer than {MAX_IPC_PATH_BYTES} bytes, the most a "
                          f"socket's path may be" + ("" if name == path else
                          " (the socket is bound there first, made private, then linked "
                          "as the path: choose a shorter directory)"), errno.ENAMETOOLONG)
    try:
        os.mkdir(private, 0o700)              # the umask can only take away
    except OSError as exc:
        raise refused(f"{exc.strerror} (making {private})", exc.errno) from None
    try:
        dfd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        _remove_quietly(os.rmdir, private)
        raise refused(f"the directory {private} made for it was replaced") from None
    try:
        info = os.fstat(dfd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise refused(f"the directory {private} made for it was replaced")
        sock.bind(f"ipc://{bound}")
        try:                                  # no one else can reach into the directory
            os.chmod("s", 0o600, dir_fd=dfd, follow_symlinks=True)
            socket_file = os.stat("s", dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise refused(f"the directory {private} made for it was replaced") from None
        if not stat.S_ISSOCK(socket_file.st_mode):
            raise refused(f"{bound} is not the socket bound")
        try:
            os.link("s", path, src_dir_fd=dfd)
        except FileExistsError:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise refused(f"{path} exists and is not a socket; not replaced",
                              errno.EEXIST) from None
            try:
                os.unlink(path)             # a stale socket, as ZMQ's bind replaces it
            except OSError as exc:
                raise refused(f"{path} is a socket that cannot be replaced "
                              f"({exc.strerror})", exc.errno) from None
            try:
                os.link("s", path, src_dir_fd=dfd)
            except FileExistsError:
                raise refused(f"{path} appeared while binding; not replaced",
                              errno.EEXIST) from None
        except OSError as exc:
            raise refused(f"cannot link the socket as {path} ({exc.strerror})",
                          exc.errno) from None
        return socket_file.st_dev, socket_file.st_ino
    finally:
        _remove_quietly(os.unlink, "s", dir_fd=dfd)
        os.close(dfd)
        _remove_quietly(os.rmdir, private)


def _remove_quietly(remove, *args, **kwargs) -> None:
    try:
        remove(*args, **kwargs)
    except OSError:
        pass


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
