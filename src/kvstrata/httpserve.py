"""A threaded HTTP server bounded per request, per client and in threads, for kvstrata's
small endpoints (the indexer's ``/match`` and ``/stats``, a manager's ``/metrics``).

:class:`BoundedHTTPServer` serves each connection on a thread of its own, at most
``max_connections`` at once, at most ``max_connections_per_host`` of them from one client
(:func:`client_of`: an IPv4 address, an IPv6 /64). A connection beyond a limit makes room by
closing, unanswered, the oldest connection still sending its request line and headers (one
whose headers have all arrived, waiting to be read, is not): its own client's at the
per-client limit, else that of the client holding the most connections. A newcomer is closed
at once (counted in ``refused``) only when no connection it could replace is still sending
its headers (all are being answered). So a client that opens connections and sends
its headers slowly (slowloris) can hold at most its own share, and a newcomer whose headers
come at once is still answered however many such connections there are (before, 64 sockets
dripping a header every 5 s from one local user kept the server unanswered).

A handler subclassing :class:`BoundedRequestHandler` waits at most its ``timeout`` for each
read; a request's line and headers must arrive within ``header_timeout`` and the whole
request, body included, within ``request_timeout``, however slowly their bytes trickle in:
one thread, waking at the earliest deadline, shuts down the connection of every request
still running by then, so its handler's blocked read returns at once and the handler ends.
(A per-read timeout alone lets a client that drips a byte every few seconds hold a thread
for as long as it likes.)

This module imports nothing from kvstrata.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["BoundedHTTPServer", "BoundedRequestHandler", "READ_TIMEOUT", "HEADER_TIMEOUT",
           "REQUEST_TIMEOUT", "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_HOST", "client_of"]

log = logging.getLogger(__name__)

READ_TIMEOUT = 10.0
"""Seconds one read of a request may wait: a client that stops sending (a body shorter than
it announced) is answered 400 and dropped."""

HEADER_TIMEOUT = 5.0
"""Seconds a request's line and headers may take to arrive, from when the server starts
waiting for them: a connection that has not sent them whole by then is closed unanswered."""

REQUEST_TIMEOUT = 30.0
"""Seconds a whole request may take, headers and body together, however its bytes trickle
in: no client holds a thread for longer."""

MAX_CONNECTIONS = 64
"""Connections served at once (a thread each)."""

MAX_CONNECTIONS_PER_HOST = 32
"""Connections one client (:func:`client_of`) may hold at once, half of them: one more
closes its own oldest still sending its headers (refused if none is)."""

ROOM_WAIT = 1.0
"""Seconds the accepting thread waits for a connection closed to make room to end its
thread, before the newcomer is refused (the read it is blocked in returns at once)."""


def client_of(address) -> str:
    """Who a connection counts against for ``max_connections_per_host``: its IPv4 address
    (an IPv4-mapped IPv6 address as that IPv4 address), the /64 of an IPv6 address other than
    loopback (one host has a whole /64), else the address as given."""
    host = address[0] if isinstance(address, tuple) and address else address
    host = str(host)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Deadlines:
    """The connections of requests in progress and when each must be done; one thread shuts
    down those past it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[socket.socket, float] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstrata-http-deadlines",
                                        daemon=True)
        self._thread.start()

    def arm(self, connection: socket.socket, seconds: float) -> None:
        """Shut ``connection`` down ``seconds`` from now (replacing its deadline, if any)."""
        with self._cond:
            self._due[connection] = time.monotonic() + seconds
            self._cond.notify()

    def disarm(self, connection: socket.socket) -> None:
        with self._cond:
            self._due.pop(connection, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for connection in [c for c, due in self._due.items() if due <= now]:
                    del self._due[connection]
                    _shut(connection)
                wait = min(self._due.values(), default=now + 3600) - now
                self._cond.wait(max(wait, 0.01))


def _shut(connection: socket.socket) -> None:
    """Shut ``connection`` down both ways: a read blocked on it returns at once."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _headers_arrived(connection: socket.socket) -> bool:
    """Whether the bytes waiting unread in ``connection`` hold the blank line that ends a
    request's headers (looked at, not taken: its handler reads them)."""
    try:
        # a copy without the handler's timeout, so the look never waits
        with socket.fromfd(connection.fileno(), connection.family, connection.type) as look:
            waiting = look.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:                     # nothing waiting (EAGAIN), or already closed
        return False
    return b"\n\r\n" in waiting or b"\n\n" in waiting


class _Connection:
    """A connection being served: its client, when it was accepted, whether it is waiting
    for a request's line and headers, and whether it was closed to make room."""

    __slots__ = ("sock", "client", "accepted", "in_headers", "dropped")

    def __init__(self, sock: socket.socket, client: str) -> None:
        self.sock = sock
        self.client = client
        self.accepted = time.monotonic()
        self.in_headers = True
        self.dropped = False


class BoundedRequestHandler(BaseHTTPRequestHandler):
    """A request handler whose every request has the server's ``header_timeout`` as a
    deadline for its line and headers and ``request_timeout`` for the whole (keep-alive
    included: each request gets its own). Set ``timeout`` for the per-read wait."""

    timeout = READ_TIMEOUT
    server: "BoundedHTTPServer"

    def handle_one_request(self) -> None:
        server = self.server
        if not server._sending_headers(self.connection, True):   # closed to make room
            self.close_connection = True
            return
        self._request_due = time.monotonic() + server.request_timeout
        server.deadlines.arm(self.connection, min(server.header_timeout,
                                                  server.request_timeout))
        try:
            super().handle_one_request()
        finally:
            server.deadlines.disarm(self.connection)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if not self.server._sending_headers(self.connection, False):   # closed meanwhile
            self.close_connection = True
            return False
        self.server.deadlines.arm(self.connection,
                                  max(self._request_due - time.monotonic(), 0.0))
        return True


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once and
    ``max_connections_per_host`` from one client, each request's headers done within
    ``header_timeout`` and the whole within ``request_timeout`` (see the module docstring).
    ``refused``: newcomers closed unanswered; ``dropped``: connections closed while still
    sending their headers, to make room. :meth:`close` stops it all."""

    daemon_threads = True
    request_queue_size = 128          # a burst of connections waits to be accepted (or refused)

    def __init__(self, address: tuple[str, int], handler: type[BoundedRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
                 header_timeout: float = HEADER_TIMEOUT,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
        if max_connections < 1 or max_connections_per_host < 1:
            raise ValueError("max_connections and max_connections_per_host must be >= 1")
        self.max_connections = max_connections
        self.max_connections_per_host = max_connections_per_host
        self.header_timeout = header_timeout
        self.request_timeout = request_timeout
        self.refused = 0
        self.dropped = 0
        self._room = threading.Condition()
        self._connections: dict[socket.socket, _Connection] = {}   # with a thread each
        self.deadlines = _Deadlines()
        try:
            super().__init__(address, handler)
        except BaseException:
            self.deadlines.close()
            raise
        self._thread: threading.Thread | None = None

    def start(self, name: str) -> "BoundedHTTPServer":
        """Serve from a daemon thread named ``name``."""
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving (if started), close the port and the deadline thread."""
        if self._thread is not None:
            self.shutdown()
        self.server_close()
        self.deadlines.close()

    # -- admission (the accepting thread) --------------------------------------------------
    def process_request(self, request, client_address) -> None:
        client = client_of(client_address)
        with self._room:
            admitted = self._make_room(client)
            if admitted:
                self._connections[request] = _Connection(request, client)
            else:
                self.refused += 1
        if not admitted:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._ended(request)
            raise

    def _make_room(self, client: str) -> bool:
        """Whether a connection of ``client`` may be served now (``_room`` held), having
        closed the connection it replaces, if it must replace one."""
        live = [c for c in self._connections.values() if not c.dropped]
        mine = [c for c in live if c.client == client]
        if len(mine) >= self.max_connections_per_host:
            if not self._drop_oldest_in_headers(mine):
                return False
        elif len(live) >= self.max_connections:
            holding = collections.Counter(c.client for c in live)
            for who, _ in holding.most_common():   # the client holding the most first
                if self._drop_oldest_in_headers([c for c in live if c.client == who]):
                    break
            else:
                return False
        # the one closed ends at once (its blocked read returns): wait for its thread, so
        # there are never more than max_connections threads
        return self._room.wait_for(lambda: len(self._connections) < self.max_connections,
                                   timeout=ROOM_WAIT)

    def _drop_oldest_in_headers(self, candidates: list[_Connection]) -> bool:
        """Close the oldest of ``candidates`` still sending its request line and headers;
        False if none is. One whose headers have all arrived and wait in its socket to be
        read (a burst its thread has not got to yet) is not one of them."""
        for conn in sorted((c for c in candidates if c.in_headers), key=lambda c: c.accepted):
            if _headers_arrived(conn.sock):
                continue
            conn.dropped = True
            self.dropped += 1
            _shut(conn.sock)
            return True
        return False

    # -- what a connection's thread reports --------------------------------------------------
    def _sending_headers(self, sock: socket.socket, sending: bool) -> bool:
        """Whether ``sock``'s connection is waiting for a request's line and headers (True: a
        request starts, and it may be closed to make room) or has them whole (False: no
        longer one to close). Returns False if it was closed to make room already."""
        with self._room:
            conn = self._connections.get(sock)
            if conn is None or conn.dropped:
                return False
            conn.in_headers = sending
            return True

    def _ended(self, sock: socket.socket) -> None:
        with self._room:
            self._connections.pop(sock, None)
            self._room.notify_all()

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._ended(request)

    def handle_error(self, request, client_address) -> None:
        """A connection closed under its handler (a deadline, room made, a client gone) is
        no error worth a traceback on stderr; anything else is logged."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("http: connection from %s ended: %s", client_address, error)
            return
        log.error("http: a request from %s failed", client_address, exc_info=True)
