"""A threaded HTTP server bounded per request and in threads, for kvstrata's small endpoints
(the indexer's ``/match`` and ``/stats``, a manager's ``/metrics``).

:class:`BoundedHTTPServer` serves each connection on a thread of its own, at most
``max_connections`` at once (one more is closed at once, unanswered, and counted in
``refused``). A handler subclassing :class:`BoundedRequestHandler` waits at most its
``timeout`` for each read, and each request, headers and body together, has a deadline of
``request_timeout`` however slowly its bytes trickle in: one thread, waking at the earliest
deadline, shuts down the connection of every request still running by then, so its
handler's blocked read returns at once and the handler ends. (A per-read timeout alone lets
a client that drips a byte every few seconds hold a thread for as long as it likes.)

This module imports nothing from kvstrata.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["BoundedHTTPServer", "BoundedRequestHandler", "READ_TIMEOUT", "REQUEST_TIMEOUT",
           "MAX_CONNECTIONS"]

READ_TIMEOUT = 10.0
"""Seconds one read of a request may wait: a client that stops sending (a body shorter than
it announced) is answered 400 and dropped."""

REQUEST_TIMEOUT = 30.0
"""Seconds a whole request may take, headers and body together, however its bytes trickle
in: no client holds a thread for longer."""

MAX_CONNECTIONS = 64
"""Connections served at once (a thread each); one more is closed at once, unanswered."""


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
                    try:
                        connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                wait = min(self._due.values(), default=now + 3600) - now
                self._cond.wait(max(wait, 0.01))


class BoundedRequestHandler(BaseHTTPRequestHandler):
    """A request handler whose every request has the server's ``request_timeout`` as a
    deadline (keep-alive included: each request gets its own). Set ``timeout`` for the
    per-read wait."""

    timeout = READ_TIMEOUT
    server: "BoundedHTTPServer"

    def handle_one_request(self) -> None:
        self.server.deadlines.arm(self.connection, self.server.request_timeout)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.disarm(self.connection)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once, each request done within
    ``request_timeout`` (see the module docstring). :meth:`close` stops it all."""

    daemon_threads = True
    request_queue_size = 128          # a burst of connections waits to be accepted (or refused)

    def __init__(self, address: tuple[str, int], handler: type[BoundedRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        self.request_timeout = request_timeout
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

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
