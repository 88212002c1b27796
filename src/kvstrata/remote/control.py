"""The control connection between an exporter and its readers: msgpack maps over plain TCP,
each message framed by its length (4 bytes, little-endian).

Why not ZMQ, which carried it before: a lease is one small request and one small reply on
the path of every remote read, and a ZMQ message passes through an I/O thread on each side,
so a round trip wakes four more threads than a socket's. On the 2-core VM the project is
measured on, an echo between two processes that had been idle for 10 ms took 475 us (median)
through ZMQ and 119 us through a socket (warm: 137 and 28 us).

:class:`ControlServer` serves one address from a thread of its own with a selector: it reads
requests from any number of readers, hands each complete one to a handler and writes the
reply, never blocking on a slow or hostile peer (a request whose length exceeds the limit
drops its connection unanswered; a peer that does not read its replies stops being read),
and bounded in time per connection: one that moves no byte for :data:`IDLE_TIMEOUT` is
closed, and a request that has not arrived whole :data:`REQUEST_TIMEOUT` after its first
byte drops its connection, so idle or dripping readers never hold the
:data:`MAX_CONNECTIONS` slots. :class:`ControlChannel` is a reader's connection: requests
with ids the replies echo, bounded by a timeout; every failure is a
:class:`~.errors.LeaseError`. A connection it kept that the server closed meanwhile is found
when the next reply does not come, and that request is sent once more on a fresh connection
(a request the server had already answered is never sent twice; one it was still handling
when it dropped the connection could be, which for a lease only means a second lease that
expires by its deadline).

With a shared secret (:mod:`.auth`), the server answers a connection nothing until it has
proved it holds the secret, and proves it holds it too; a channel given the secret does that
handshake on each new connection. A connection that has not authenticated within
:data:`AUTH_TIMEOUT` is closed, and one host holds at most :data:`MAX_CONNECTIONS_PER_HOST`
connections. The handler is told which connection a request came on (an id never reused),
so what a connection took (a lease) can be bound to it.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Callable, NamedTuple

import msgpack

from ..secret import SECRET_ENV, SECRET_FILE_ENV, SecretError, resolve_secret
from .auth import client_proof, new_nonce, proofs_match, server_proof
from .errors import LeaseError

__all__ = ["ControlServer", "ControlChannel", "PeerId", "parse_control", "format_control",
           "MAX_REPLY_BYTES"]

log = logging.getLogger(__name__)

FRAME = struct.Struct("<I")
MAX_REPLY_BYTES = 64 << 20
"""Largest reply a reader accepts (a block set with many regions, a lease of 65,536 blocks)."""
MAX_CONNECTIONS = 256
"""Readers one exporter serves at once; a connection beyond them is closed at once."""
MAX_CONNECTIONS_PER_HOST = 32
"""Connections one remote address may hold at once (one host cannot take every slot)."""
AUTH_TIMEOUT = 10.0
"""Seconds a connection has to prove it holds the shared secret, when there is one."""
MAX_UNAUTHENTICATED = 32
MAX_UNAUTHENTICATED_PER_HOST = 4
"""Connections still in the handshake, in all and from one network (:func:`network_of`).
One more from a network at its limit closes that network's oldest; one more when all are
taken closes the oldest of the network holding the most. A peer without the secret cannot
hold the slots of those that have it: it can only keep replacing its own. A connection so
closed is told first (``{"busy": true}``), and a reader's channel then tries its handshake
again until its deadline (a server that just closes the connection gets no new try)."""
MAX_HANDSHAKE_BYTES = 256
"""Largest frame of the handshake, either way (a hello is about 60 bytes)."""


def network_of(host: str) -> str:
    """The network a remote address counts against for connections still in the
    handshake: its IPv4 /24 or IPv6 /64, every loopback address as one (one machine), so
    that many addresses of one network are not many peers."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


class PeerId(NamedTuple):
    """Who sent a request: the connection (an id never reused) and its remote address."""

    ident: int
    host: str
IDLE_TIMEOUT = 120.0
"""Seconds a connection may sit with nothing to send or receive before the server closes it
(a reader's channel reconnects on its next call), so idle connections cannot hold every
slot for ever. A connection holding a lease is kept while it does (its reader may be reading
the blocks); the lease's own deadline, at most 300 s, bounds that."""
REQUEST_TIMEOUT = 30.0
"""Seconds a request may take to arrive whole from its first byte, however its bytes
trickle in; a slower one drops its connection."""


def format_control(host: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_control(control: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://host:port`` control address; ``ValueError`` if it is not
    one."""
    if not isinstance(control, str) or not control.startswith("tcp://"):
        raise ValueError(f"control address {control!r} is not tcp://host:port")
    host, sep, port = control[len("tcp://"):].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"control address {control!r} is not tcp://host:port")
    return host, int(port)


def can_listen_on(host: str) -> bool:
    """Whether this host has the address ``host`` (resolved) to listen on: binding a socket
    to it on a port the system picks succeeds. Nothing stays bound."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address)
                return True
        except OSError:
            continue
    return False


def is_own_address(control: str, own: str) -> bool:
    """Whether control address ``control`` surely names the server bound at ``own``: the
    same port and the same host, as written or as the same IP address (``localhost`` being
    127.0.0.1), or the loopback address where ``own`` binds every address (``0.0.0.0``,
    ``::``). Nothing is resolved: a name that merely resolves to this host, or an address
    this host could bind, is not taken for it (it may be another machine's, or another
    server's). Both must be ``tcp://host:port``."""
    host, port = parse_control(control)
    own_host, own_port = parse_control(own)
    if port != own_port:
        return False
    address, own_address = _literal(host), _literal(own_host)
    if host.casefold() == own_host.casefold() or (address is not None and address == own_address):
        return True
    return (address is not None and address.is_loopback and own_address is not None
            and own_address.is_unspecified
            and (address.version == 4 or own_address.version == 6))


def _literal(host: str) -> "ipaddress.IPv4Address | ipaddress.IPv6Address | None":
    """``host`` as an IP address (``localhost`` as 127.0.0.1), or None for other names."""
    if host.casefold() == "localhost":
        return ipaddress.ip_address("127.0.0.1")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _frame(body: bytes) -> bytes:
    return FRAME.pack(len(body)) + body


class _Peer:
    """One reader's connection: bytes received and not yet a whole request, the reply not
    yet written, when it last moved a byte and when its pending request began."""

    __slots__ = ("sock", "inbox", "outbox", "active_at", "request_at", "ident", "host",
                 "connected_at", "authenticated", "nonces")

    def __init__(self, sock: socket.socket, ident: int, host: str) -> None:
        self.sock, self.inbox, self.outbox = sock, bytearray(), b""
        self.active_at = self.connected_at = time.monotonic()
        self.request_at = 0.0
        self.ident, self.host = ident, host
        self.authenticated = False
        self.nonces: tuple[bytes, bytes] | None = None
        """(the reader's nonce, ours) once it said hello."""


class ControlServer:
    """Serve ``handler(request bytes, PeerId) -> reply bytes`` on ``host:port`` (0: any free
    port) from a thread named ``name``, calling ``on_tick()`` at least every ``tick`` seconds
    and ``on_close(PeerId)`` when a connection that reached the handler closes; a
    connection for which ``holds(PeerId)`` is true is not closed for being idle. Requests
    longer than ``max_request`` bytes drop their connection. With ``secret``, only
    connections that proved they hold it reach the handler (:mod:`.auth`). The port is bound
    (:attr:`address` known) when this returns; serving begins with :meth:`start`."""

    def __init__(self, host: str, port: int, handler: Callable[[bytes, PeerId], bytes], *,
                 max_request: int, tick: float, on_tick: Callable[[], None], name: str,
                 idle_timeout: float = IDLE_TIMEOUT,
                 request_timeout: float = REQUEST_TIMEOUT,
                 secret: bytes | None = None,
                 on_close: Callable[[PeerId], None] | None = None,
                 holds: Callable[[PeerId], bool] | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.address = format_control(host, self._listener.getsockname()[1])
        self._handler, self._max_request = handler, max_request
        self._tick, self._on_tick = tick, on_tick
        self._idle_timeout, self._request_timeout = idle_timeout, request_timeout
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[int, _Peer] = {}
        self._secret = secret
        self._on_close = on_close
        self._holds = holds
        self._idents = itertools.count(1)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._started = False
        self._accept_paused, self._accept_retry = False, 0.0

    def start(self) -> None:
        """Begin serving."""
        self._started = True
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection and the port. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if not self._started:
            self._release()
            return
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(timeout)

    # -- the serving thread ----------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                events = self._selector.select(self._tick)
                try:
                    self._on_tick()
                except Exception:
                    log.exception("kvstrata: control server tick failed")
                if self._accept_paused and time.monotonic() >= self._accept_retry:
                    self._accept_paused = False
                    self._selector.register(self._listener, selectors.EVENT_READ, None)
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._service(key.data, mask)
                self._drop_late()
        finally:
            self._release()

    def _drop_late(self) -> None:
        """Close the connections that moved no byte for the idle timeout (idle, or a reader
        not reading its reply) and those whose request has not arrived whole within the
        request timeout. An idle connection that ``holds`` something is kept: closing it
        would end what its reader counts on (a lease, while the reader reads the blocks)."""
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if (now - peer.active_at > self._idle_timeout and not self._held(peer)) or (
                    peer.inbox and now - peer.request_at > self._request_timeout) or (
                    self._secret is not None and not peer.authenticated
                    and now - peer.connected_at > AUTH_TIMEOUT):
                self._drop(peer)

    def _held(self, peer: _Peer) -> bool:
        """Whether an authenticated connection holds something its handler gave it."""
        if self._holds is None or (self._secret is not None and not peer.authenticated):
            return False
        try:
            return bool(self._holds(PeerId(peer.ident, peer.host)))
        except Exception:
            log.exception("kvstrata: control server holds() failed")
            return False

    def _release(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept(self) -> None:
        try:
            sock, remote = self._listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # the waiting connection keeps the port readable: stop watching it for a
                # tick instead of spinning until a descriptor frees up
                if not self._accept_paused:
                    log.warning("kvstrata: control server %s cannot accept (%s); retrying "
                                "every %.2f s", self.address, exc.strerror, self._tick)
                self._accept_paused = True
                self._accept_retry = time.monotonic() + self._tick
                self._selector.unregister(self._listener)
            return
        host = str(remote[0]) if isinstance(remote, tuple) and remote else ""
        if len(self._peers) >= MAX_CONNECTIONS or sum(
                p.host == host for p in self._peers.values()) >= MAX_CONNECTIONS_PER_HOST:
            sock.close()
            return
        if self._secret is not None:
            self._make_room_to_authenticate(network_of(host))
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = _Peer(sock, next(self._idents), host)
        self._peers[sock.fileno()] = peer
        self._selector.register(sock, selectors.EVENT_READ, peer)

    def _make_room_to_authenticate(self, network: str) -> None:
        """Close a connection still in the handshake if one more from ``network`` would
        pass a limit: ``network``'s oldest if it is at its own, else the oldest of the
        network holding the most when all slots are taken. (Refusing the newcomer instead
        let a peer without the secret hold every slot by refilling them.)"""
        by_network: dict[str, list[_Peer]] = {}
        waiting = 0
        for peer in self._peers.values():
            if not peer.authenticated:
                by_network.setdefault(network_of(peer.host), []).append(peer)
                waiting += 1
        mine = by_network.get(network, [])
        if len(mine) >= MAX_UNAUTHENTICATED_PER_HOST:
            victims = mine
        elif waiting >= MAX_UNAUTHENTICATED:
            victims = max(by_network.values(), key=len)
        else:
            return
        victim = min(victims, key=lambda p: p.connected_at)
        if not victim.outbox:     # say why, so a reader with the secret tries again
            try:
                victim.sock.recv(MAX_HANDSHAKE_BYTES)   # unread bytes would reset it
            except OSError:
                pass
            try:
                victim.sock.send(_BUSY)
            except OSError:
                pass
        self._drop(victim)

    def _service(self, peer: _Peer, mask: int) -> None:
        if mask & selectors.EVENT_WRITE and not self._flush(peer):
            return
        if mask & selectors.EVENT_READ and not peer.outbox:
            try:
                data = peer.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:                                  # the reader went away
                self._drop(peer)
                return
            peer.active_at = time.monotonic()
            if not peer.inbox:
                peer.request_at = peer.active_at
            peer.inbox += data
        self._answer_waiting(peer)

    def _answer_waiting(self, peer: _Peer) -> None:
        """Answer the whole requests received, one at a time: a reply not yet written stops
        the reading (a reader that never reads its replies gets no more answered)."""
        while not peer.outbox and len(peer.inbox) >= FRAME.size:
            (length,) = FRAME.unpack_from(peer.inbox)
            limit = self._max_request if self._secret is None or peer.authenticated \
                else MAX_HANDSHAKE_BYTES
            if length > limit:
                self._drop(peer)
                return
            if len(peer.inbox) < FRAME.size + length:
                return
            body = bytes(peer.inbox[FRAME.size:FRAME.size + length])
            del peer.inbox[:FRAME.size + length]
            peer.request_at = time.monotonic()           # what is left starts the next one
            if self._secret is not None and not peer.authenticated:
                reply = self._authenticate(peer, body)
                if reply is None:                        # not a step of the handshake
                    self._drop(peer)
                    return
                peer.outbox = _frame(reply)
                if not self._flush(peer):
                    return
                continue
            try:
                reply = self._handler(body, PeerId(peer.ident, peer.host))
            except Exception:
                log.exception("kvstrata: control server %s failed a request", self.address)
                self._drop(peer)
                return
            peer.outbox = _frame(reply)
            if not self._flush(peer):
                return

    def _authenticate(self, peer: _Peer, body: bytes) -> bytes | None:
        """The reply to one step of the handshake (:mod:`.auth`), or None: drop the peer."""
        try:
            message = msgpack.unpackb(body, raw=False, max_bin_len=64, max_str_len=16,
                                      max_array_len=0, max_map_len=4)
        except Exception:
            return None
        if not isinstance(message, dict):
            return None
        op = message.get("op")
        if op == "hello" and peer.nonces is None:
            theirs = message.get("nonce")
            if not isinstance(theirs, bytes) or len(theirs) != len(new_nonce()):
                return None
            peer.nonces = (theirs, new_nonce())
            return msgpack.packb({"nonce": peer.nonces[1],
                                  "proof": server_proof(self._secret, *peer.nonces)})
        if op == "auth" and peer.nonces is not None and proofs_match(
                client_proof(self._secret, *peer.nonces), message.get("proof")):
            peer.authenticated = True
            return msgpack.packb({"ok": True})
        return None

    def _flush(self, peer: _Peer) -> bool:
        """Write what the reply has left; False if the connection was dropped."""
        try:
            sent = peer.sock.send(peer.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(peer)
            return False
        peer.outbox = peer.outbox[sent:]
        if sent:
            peer.active_at = time.monotonic()
        events = selectors.EVENT_WRITE if peer.outbox else selectors.EVENT_READ
        self._selector.modify(peer.sock, events, peer)
        return True

    def _drop(self, peer: _Peer) -> None:
        if self._peers.pop(peer.sock.fileno(), None) is not None:
            self._selector.unregister(peer.sock)
        peer.sock.close()
        if self._on_close is not None and (self._secret is None or peer.authenticated):
            try:
                self._on_close(PeerId(peer.ident, peer.host))
            except Exception:
                log.exception("kvstrata: control server %s: closing %s failed", self.address,
                              peer.host)


class _Closed(Exception):
    """The server closed the connection before a frame's first byte."""


class _HandshakeCut(LeaseError):
    """The server said it was busy and closed the connection in the handshake (at its limit
    of connections in the handshake): worth another try."""


class _StaleConnection(Exception):
    """A connection kept from an earlier call was closed by the server before the request
    was answered (it closes idle connections): the request may be sent again."""


_BUSY = FRAME.pack(len(msgpack.packb({"busy": True}))) + msgpack.packb({"busy": True})
"""What a connection still in the handshake is told when it is closed to make room."""

HANDSHAKE_RETRY = 0.01
"""Seconds a channel waits before its first new try of a handshake the server cut (at its
limit of connections in the handshake), doubling to 0.2 s, until the call's deadline."""


class ControlChannel:
    """A reader's connection to the exporter at ``control``: each request carries an id the
    reply echoes, so a caller may wait for its reply (bounded by ``timeout``) or not (a
    release); replies nobody waits for are skipped. Connects on first use and again after a
    failure; safe to share between threads. A malformed ``control`` is a
    :class:`~.errors.LeaseError` here. ``secret`` (default: the deployment's, from the
    environment: :func:`~.auth.resolve_secret`; ``b""``: none, for a server without one) is
    proved on each new connection."""

    def __init__(self, control: str, timeout: float, secret: bytes | None = None) -> None:
        self.control, self.timeout = control, timeout
        try:
            found = secret if secret is not None else resolve_secret()
        except SecretError as exc:
            raise LeaseError(str(exc)) from None
        if found is None:
            raise LeaseError(f"{control}: no sharing secret to prove to the exporter: set "
                             f"${SECRET_ENV} (or ${SECRET_FILE_ENV}) as in the exporter's "
                             f"environment")
        self._secret = found or None
        try:
            self._address = parse_control(control)
        except ValueError as exc:
            raise LeaseError(str(exc)) from None
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(self, request: dict, wait: bool = True) -> dict:
        """Send ``request`` and, with ``wait``, return the reply with its id."""
        deadline = time.monotonic() + self.timeout
        if not self._lock.acquire(timeout=self.timeout):
            raise LeaseError(f"{self.control} did not answer within {self.timeout:.1f} s "
                             f"(other calls on this channel held it)")
        try:
            request_id = next(self._ids)
            try:
                try:
                    return self._exchange(request, request_id, wait, deadline)
                except _StaleConnection:
                    # The server closed a connection this channel had kept (idle too long)
                    # before it answered: send the request again on a fresh one, once (a
                    # fresh connection cannot be stale, so this does not loop).
                    self._close()
                    return self._exchange(request, request_id, wait, deadline)
            except LeaseError:
                self._close()
                raise
            except (OSError, ValueError, msgpack.UnpackException) as exc:
                self._close()
                if isinstance(exc, (socket.timeout, TimeoutError)):
                    raise LeaseError(f"{self.control} did not answer within "
                                     f"{self.timeout:.1f} s") from None
                raise LeaseError(f"{self.control}: {type(exc).__name__}: {exc}") from None
            except BaseException:             # interrupted mid-frame: the stream is unusable
                self._close()
                raise
        finally:
            self._lock.release()

    def _exchange(self, request: dict, request_id: int, wait: bool, deadline: float) -> dict:
        """Send one request and wait for its reply (``_StaleConnection`` if a connection
        kept from before turns out closed before any byte of the reply came)."""
        reused = self._sock is not None
        sock = self._connected(deadline)
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        try:
            sock.sendall(_frame(msgpack.packb({**request, "id": request_id})))
            if not wait:
                return {}
            while True:     # replies to earlier requests nobody waited for are skipped
                header = self._exactly(sock, FRAME.size, deadline, first=True)
                reply = msgpack.unpackb(self._body(sock, header, deadline), raw=False)
                if not isinstance(reply, dict):
                    raise LeaseError(f"{self.control} answered a {type(reply).__name__}, "
                                     f"not a map")
                if reply.get("id") == request_id:
                    return reply
        except (ConnectionResetError, BrokenPipeError, _Closed):
            # closed at a frame's start, before any byte of this request's reply
            if reused:
                raise _StaleConnection() from None
            raise LeaseError(f"{self.control} closed the connection") from None

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        with self._lock:
            self._close()

    def _connected(self, deadline: float) -> socket.socket:
        pause = HANDSHAKE_RETRY
        while self._sock is None:
            sock = socket.create_connection(self._address,
                                            timeout=max(1e-3, deadline - time.monotonic()))
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._secret is not None:
                    self._handshake(sock, deadline)
            except _HandshakeCut:
                sock.close()
                if time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.2)
                continue
            except BaseException:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        """Prove this channel holds the secret, and check the exporter does (:mod:`.auth`)."""
        ours = new_nonce()
        reply = self._roundtrip(sock, {"op": "hello", "nonce": ours}, deadline)
        theirs = reply.get("nonce")
        if not isinstance(theirs, bytes) or not proofs_match(
                server_proof(self._secret, ours, theirs), reply.get("proof")):
            raise LeaseError(f"{self.control} did not prove it holds the sharing secret "
                             f"(another secret, or not a kvstrata exporter that has one)")
        reply = self._roundtrip(sock, {"op": "auth",
                                       "proof": client_proof(self._secret, ours, theirs)},
                                deadline)
        if reply.get("ok") is not True:
            raise LeaseError(f"{self.control} refused this channel's proof of the secret")

    def _roundtrip(self, sock: socket.socket, message: dict, deadline: float) -> dict:
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        sock.sendall(_frame(msgpack.packb(message)))
        try:
            header = self._exactly(sock, FRAME.size, deadline, first=True)
        except _Closed:
            raise LeaseError(f"{self.control} closed the connection during the handshake "
                             f"(another secret, or its connection limit reached)") from None
        (length,) = FRAME.unpack(header)
        if length > MAX_HANDSHAKE_BYTES:          # nothing proved yet: nothing big parsed
            raise LeaseError(f"{self.control} sent a handshake frame of {length} bytes")
        reply = msgpack.unpackb(self._exactly(sock, length, deadline), raw=False,
                                max_bin_len=64, max_str_len=16, max_array_len=0,
                                max_map_len=4)
        if not isinstance(reply, dict):
            raise LeaseError(f"{self.control} answered the handshake with a "
                             f"{type(reply).__name__}")
        if reply.get("busy") is True:
            raise _HandshakeCut(f"{self.control} is at its limit of connections in the "
                                f"handshake")
        return reply

    def _body(self, sock: socket.socket, header: bytes, deadline: float) -> bytes:
        (length,) = FRAME.unpack(header)
        if length > MAX_REPLY_BYTES:
            raise LeaseError(f"{self.control} sent a reply of {length} bytes (at most "
                             f"{MAX_REPLY_BYTES})")
        return self._exactly(sock, length, deadline)

    def _exactly(self, sock: socket.socket, count: int, deadline: float, *,
                 first: bool = False) -> bytes:
        """``count`` bytes from ``sock`` by ``deadline``; with ``first`` (the reply's first
        frame header), a connection closed before any byte is ``_Closed``."""
        data = bytearray(count)
        view, got = memoryview(data), 0
        while got < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            n = sock.recv_into(view[got:])
            if not n:
                if first and got == 0:
                    raise _Closed()
                raise LeaseError(f"{self.control} closed the connection")
            got += n
        return bytes(data)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
