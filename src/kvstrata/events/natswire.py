"""A publish-only core-NATS connection that the publisher's batching thread writes itself.

nats-py's connection belongs to its asyncio event loop, on a thread of its own: a batch handed
to it passes the GIL to that thread and back, and a thread woken while the engine's thread runs
Python waits up to the interpreter's switch interval (5 ms) for the GIL. Here the batching
thread writes a batch's ``PUB`` frames into the socket itself, in one non-blocking send that
keeps the GIL (``_wire.send_nowait``; :func:`py_send_nowait` is the fallback). Only what has to
wait runs on the sink's event loop: (re)connecting, with the protocol's handshake (``INFO``,
``CONNECT``, ``PING``/``PONG``), and reading what the server sends on this connection (a
``PING``, answered with a ``PONG``; the ``PONG`` a flush waits for; ``-ERR``, logged; the end
of the stream, after which it reconnects).

A write either takes the whole batch or fails: the kernel takes what fits without waiting, the
rest is written before anything else (waiting at most ``send_timeout``). A failed write drops
the connection (a torn frame must not be followed by more bytes) and raises
:class:`~kvstrata.events.publisher.SinkUnavailableError`, so the publisher retries the batch
on the next connection; while none is up, every publish raises it at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import select
import socket
import threading
import time
from urllib.parse import quote, unquote, urlparse

from kvstrata.events.publisher import SinkUnavailableError

log = logging.getLogger(__name__)

CRLF = b"\r\n"
PING = b"PING\r\n"
PONG = b"PONG\r\n"
DEFAULT_MAX_PAYLOAD = 1 << 20
MAX_LINE = 1 << 20
"""Longest protocol line read from the server (INFO can list a cluster's URLs)."""
_IOV_CHUNK = 512
WARN_EVERY = 60.0
"""Seconds between two warnings about the server's ``-ERR`` lines (the count says how many)."""


NATS_USER_ENV = "KVSTRATA_NATS_USER"
NATS_PASSWORD_ENV = "KVSTRATA_NATS_PASSWORD"
NATS_TOKEN_ENV = "KVSTRATA_NATS_TOKEN"


def with_credentials(url: str, env=None) -> str:
    """``url`` with the bus's credentials from the environment when it names none:
    ``$KVSTRATA_NATS_USER`` and ``$KVSTRATA_NATS_PASSWORD``, or ``$KVSTRATA_NATS_TOKEN``
    (a URL or a command line shows in process listings and in vLLM's logged config; the
    environment does not). Credentials in the URL win."""
    env = os.environ if env is None else env
    scheme, sep, rest = url.partition("://")
    if not sep or "@" in rest.partition("/")[0]:
        return url
    if env.get(NATS_USER_ENV) and env.get(NATS_PASSWORD_ENV):
        userinfo = f"{quote(env[NATS_USER_ENV], safe='')}:{quote(env[NATS_PASSWORD_ENV], safe='')}"
    elif env.get(NATS_TOKEN_ENV):
        userinfo = quote(env[NATS_TOKEN_ENV], safe="")
    else:
        return url
    return f"{scheme}://{userinfo}@{rest}"


def py_send_nowait(sock: socket.socket, buffers: list) -> int:
    """``_wire.send_nowait`` in Python (the fallback; it lets go of the GIL for each call)."""
    total = 0
    for start in range(0, len(buffers), _IOV_CHUNK):
        chunk = buffers[start : start + _IOV_CHUNK]
        try:
            n = sock.sendmsg(chunk, (), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            break
        total += n
        if n < sum(map(len, chunk)):
            break
    return total


def _load_send_nowait():
    if os.environ.get("KVSTRATA_NATIVE_EVENTS", "1") == "0":
        return py_send_nowait
    try:
        from kvstrata.events._wire import send_nowait
    except ImportError:
        return py_send_nowait
    return send_nowait


send_nowait = _load_send_nowait()


class UnsupportedServerError(RuntimeError):
    """The server needs what this connection does not do (TLS)."""


class NatsPublishConnection:
    """Publishes on core NATS from one thread at a time, without the event loop (see the module
    docstring). ``loop`` is a :class:`~kvstrata.events._aio.LoopThread` that runs the
    connecting and reading; ``url`` is ``nats://[user:password@|token@]host:port``.

    :meth:`start` begins connecting in the background (forever, ``reconnect_wait`` between
    tries); :attr:`connected` says whether a connection is up; :meth:`publish` writes messages;
    :meth:`flush` waits for the server to have read everything written; :meth:`close` ends it.
    If the server requires TLS, :attr:`unsupported` says so and nothing is published."""

    def __init__(self, url: str, name: str, loop, *, connect_timeout: float = 1.0,
                 reconnect_wait: float = 0.1, send_timeout: float = 2.0) -> None:
        parts = urlparse(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 4222
        self._user = unquote(parts.username) if parts.username else None
        self._password = unquote(parts.password) if parts.password is not None else None
        self.name = name
        self.connect_timeout = connect_timeout
        self.reconnect_wait = reconnect_wait
        self.send_timeout = send_timeout
        self._aio = loop
        self._lock = threading.Lock()  # held for every write: frames never interleave
        self._sock: socket.socket | None = None
        self._inbuf = b""
        self._acks = threading.Condition()  # PONGs to our PINGs, for flush
        self._generation = 0  # connections made (a flush waits on one connection)
        self._pings = self._pongs = 0
        self._task = None
        self._closed = False
        self.max_payload = DEFAULT_MAX_PAYLOAD
        self.unsupported: str | None = None
        self.last_error: BaseException | None = None
        self.connects = 0
        self.server_errors = 0  # -ERR lines received
        self._warned_at = float("-inf")

    # -- lifecycle (any thread) -----------------------------------------------------------------
    def start(self) -> None:
        self._aio.loop.call_soon_threadsafe(self._reconnect)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self, timeout: float) -> None:
        """Stop reconnecting and close the socket (what was written is not waited for: call
        :meth:`flush` first)."""
        self._closed = True
        if self._aio.loop.is_closed():
            return
        try:
            self._aio.run(self._shutdown(), max(timeout, 0.1))
        except (TimeoutError, RuntimeError):
            pass

    async def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            self._drop(sock)

    # -- the publishing thread ----------------------------------------------------------------
    def publish(self, subject: bytes, payloads: list[bytes]) -> list[int]:
        """Write one message per payload on ``subject``, in order, except those over the
        server's ``max_payload`` (it would close the connection): returns their indices
        (usually none). Raises :class:`SinkUnavailableError` (no connection, or it failed:
        nothing of this call counts as sent)."""
        limit = self.max_payload
        frames: list[bytes] = []
        too_large: list[int] = []
        for i, p in enumerate(payloads):
            if len(p) > limit:
                too_large.append(i)
                continue
            frames += (b"PUB %s %d\r\n" % (subject, len(p)), p, CRLF)
        if not frames:
            return too_large
        with self._lock:
            sock = self._sock
            if sock is None:
                raise SinkUnavailableError(self._why_down())
            try:
                self._write_locked(sock, frames)
            except OSError as exc:
                self._lose_locked(sock, exc)
                raise SinkUnavailableError(f"NATS publish failed: {type(exc).__name__}: {exc}") from None
        return too_large

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the server has read everything written so far (a
        ``PING`` and its ``PONG``). False on timeout or without a connection."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            return False
        try:
            sock = self._sock
            if sock is None:
                return False
            with self._acks:
                generation = self._generation
                self._pings += 1
                target = self._pings
            try:
                self._write_locked(sock, [PING])
            except OSError as exc:
                self._lose_locked(sock, exc)
                return False
        finally:
            self._lock.release()
        with self._acks:
            while self._pongs < target and self._generation == generation:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._acks.wait(remaining)
            return self._generation == generation

    def _write_locked(self, sock: socket.socket, frames: list) -> None:
        """All of ``frames`` into the socket (under the write lock): what the kernel takes at
        once, then the rest, waiting for room at most ``send_timeout`` (TimeoutError)."""
        sent = send_nowait(sock, frames)
        total = sum(map(len, frames))
        if sent == total:
            return
        rest = memoryview(b"".join(frames))[sent:]
        deadline = time.monotonic() + self.send_timeout
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        while rest:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the server took no data for {self.send_timeout}s")
            poller.poll(remaining * 1000)
            rest = rest[send_nowait(sock, [rest]) :]

    def _lose_locked(self, sock: socket.socket, exc: BaseException) -> None:
        """``sock`` failed (under the write lock): stop writing to it, close it on the loop,
        reconnect."""
        if self._sock is not sock:
            return
        self._sock = None
        self.last_error = exc
        log.debug("NATS publish connection to %s:%d lost: %s", self.host, self.port, exc)
        try:
            self._aio.loop.call_soon_threadsafe(self._drop_and_reconnect, sock)
        except RuntimeError:  # the loop is closed: nothing will read the socket any more
            sock.close()

    def _why_down(self) -> str:
        why = f"not connected to nats://{self.host}:{self.port}"
        return why + (f": {self.unsupported or self.last_error}" if self.unsupported or self.last_error else "")

    # -- the event loop -----------------------------------------------------------------------
    def _drop(self, sock: socket.socket) -> None:
        try:
            self._aio.loop.remove_reader(sock.fileno())
        except (ValueError, OSError):  # already closed
            pass
        sock.close()
        with self._acks:
            self._acks.notify_all()

    def _drop_and_reconnect(self, sock: socket.socket) -> None:
        self._drop(sock)
        self._reconnect()

    def _reconnect(self) -> None:
        if self._closed or self.unsupported or self._sock is not None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._keep_trying())

    async def _keep_trying(self) -> None:
        while not self._closed:
            try:
                sock, info, rest = await asyncio.wait_for(self._handshake(), self.connect_timeout)
            except UnsupportedServerError as exc:
                self.unsupported = str(exc)
                log.info("NATS server %s:%d: %s; publishing through nats-py", self.host, self.port, exc)
                return
            except (OSError, asyncio.TimeoutError, ValueError) as exc:
                self.last_error = exc
                await asyncio.sleep(self.reconnect_wait)
                continue
            self._install(sock, info, rest)
            return

    async def _handshake(self) -> tuple[socket.socket, dict, bytes]:
        loop = asyncio.get_running_loop()
        family, address = await self._address(loop)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            line, rest = await _read_line(loop, sock, b"")
            if not line.startswith(b"INFO "):
                raise ValueError(f"expected INFO from the server, got {line[:80]!r}")
            info = _info(line)
            if info.get("tls_required"):
                raise UnsupportedServerError("the server requires TLS")
            await loop.sock_sendall(sock, b"CONNECT %s\r\n%s" % (json.dumps(self._connect_options()).encode(), PING))
            while True:  # the server answers the PING once it accepted CONNECT, or says why not
                line, rest = await _read_line(loop, sock, rest)
                if line == b"PONG":
                    return sock, info, rest
                if line.startswith(b"-ERR"):
                    raise ConnectionRefusedError(f"server refused the connection: {line[5:].decode(errors='replace')}")
        except BaseException:
            sock.close()
            raise

    async def _address(self, loop) -> tuple[int, tuple]:
        try:  # a numeric address needs no resolver (which would run on an executor thread)
            family = socket.AF_INET6 if ipaddress.ip_address(self.host).version == 6 else socket.AF_INET
            return family, (self.host, self.port)
        except ValueError:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            return infos[0][0], infos[0][4]

    def _connect_options(self) -> dict:
        options = {"verbose": False, "pedantic": False, "lang": "python", "version": "kvstrata",
                   "protocol": 1, "name": self.name}
        if self._user is not None and self._password is not None:
            options.update(user=self._user, **{"pass": self._password})
        elif self._user is not None:
            options["auth_token"] = self._user
        return options

    def _install(self, sock: socket.socket, info: dict, rest: bytes) -> None:
        self._inbuf = b""
        self._aio.loop.add_reader(sock.fileno(), self._on_readable, sock)
        with self._acks:
            self._generation += 1
            self._pings = self._pongs = 0
        with self._lock:
            self.max_payload = _max_payload(info) or DEFAULT_MAX_PAYLOAD
            self._sock = sock
        self.connects += 1
        if rest:
            self._received(sock, rest)

    def _on_readable(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, error = b"", exc
        else:
            error = ConnectionResetError("the server closed the connection")
        if not data:
            with self._lock:
                self._lose_locked(sock, error)
            return
        self._received(sock, data)

    def _received(self, sock: socket.socket, data: bytes) -> None:
        buf = self._inbuf + data
        while True:
            end = buf.find(CRLF)
            if end < 0:
                break
            self._on_line(sock, buf[:end])
            buf = buf[end + 2 :]
        self._inbuf = buf
        if len(buf) > MAX_LINE:
            with self._lock:
                self._lose_locked(sock, ValueError("protocol line too long"))

    def _on_line(self, sock: socket.socket, line: bytes) -> None:
        if line == b"PING":
            self._answer_ping(sock)
        elif line == b"PONG":
            with self._acks:
                self._pongs += 1
                self._acks.notify_all()
        elif line.startswith(b"-ERR"):  # e.g. a permissions violation: that message is lost
            self.server_errors += 1
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY:
                self._warned_at = now
                log.warning("NATS server %s:%d: %s (%d errors so far)", self.host, self.port,
                            line.decode(errors="replace"), self.server_errors)
        elif line.startswith(b"INFO "):     # a new one may change max_payload
            try:
                payload = _max_payload(_info(line))
            except ValueError:
                payload = None
            if payload:
                self.max_payload = payload

    def _answer_ping(self, sock: socket.socket) -> None:
        # Never wait for the publishing thread on the loop: try again shortly if it is writing.
        if not self._lock.acquire(blocking=False):
            self._aio.loop.call_later(0.005, self._answer_ping, sock)
            return
        try:
            if self._sock is sock:
                self._write_locked(sock, [PONG])
        except OSError as exc:
            self._lose_locked(sock, exc)
        finally:
            self._lock.release()


async def _read_line(loop, sock: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """The next CRLF-terminated line from ``sock`` (without CRLF) and what followed it."""
    while CRLF not in buf:
        if len(buf) > MAX_LINE:
            raise ValueError("protocol line too long")
        data = await loop.sock_recv(sock, 65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        buf += data
    line, _, rest = buf.partition(CRLF)
    return line, rest


MAX_SERVER_PAYLOAD = 64 << 20
"""The largest ``max_payload`` a server is taken at its word for (NATS allows 64 MiB)."""


def _info(line: bytes) -> dict:
    """The JSON object of a server's ``INFO`` line; :class:`ValueError` if it is none."""
    try:
        info = json.loads(line[5:])
    except (ValueError, RecursionError) as exc:   # RecursionError: nested past the parser
        raise ValueError(f"the server's INFO is not JSON: {type(exc).__name__}") from None
    if not isinstance(info, dict):
        raise ValueError(f"the server's INFO is not a JSON object: {line[:80]!r}")
    return info


def _max_payload(info: dict) -> int | None:
    """The ``max_payload`` an ``INFO`` states, where it is a sane size (1 byte to
    :data:`MAX_SERVER_PAYLOAD`); None otherwise (the default then stands)."""
    value = info.get("max_payload")
    return value if type(value) is int and 0 < value <= MAX_SERVER_PAYLOAD else None
