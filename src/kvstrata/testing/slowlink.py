"""A slow network link in a box: a TCP proxy that adds latency and caps bandwidth.

:class:`SlowLink` listens on 127.0.0.1 and forwards every connection to an upstream address
(an S3 server, say). Each chunk the client sends is held for ``latency`` seconds before it is
forwarded (a request/response protocol sees one extra round trip of ``latency`` per request),
and each direction is capped at ``bytes_per_s`` shared by all connections, as one link to a
remote store would be. Benchmarks and tests use it to make a tier slow on one machine
(``kvstrata``'s cost model must then stop loading from it); it is not meant for production.

``set(latency=..., bytes_per_s=...)`` changes the link while it runs (a store that turns slow
and recovers).

``python -m kvstrata.testing.slowlink HOST:PORT [--latency S] [--rate BYTES_PER_S]`` runs one link as a
process of its own (a benchmark can then confine it, with the store it fronts, to a CPU budget
of their own): it prints ``PORT`` on a line once it listens and runs until its standard input
closes (its parent ended or let go of it) or it receives SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import queue
import signal
import socket
import sys
import threading
import time

__all__ = ["SlowLink", "main"]

_CHUNK = 64 << 10


class _Pace:
    """A shared cap of ``rate`` bytes per second: :meth:`wait` sleeps until ``n`` more bytes
    may go (None: no cap)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self, n: int) -> None:
        rate = self.rate
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / rate
            due = self._next
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class SlowLink:
    """See the module docstring. ``latency`` in seconds, ``bytes_per_s`` per direction
    (None: unlimited). Use as a context manager or call :meth:`close`."""

    def __init__(self, upstream: tuple[str, int], latency: float = 0.0,
                 bytes_per_s: float | None = None) -> None:
        if latency < 0 or (bytes_per_s is not None and bytes_per_s <= 0):
            raise ValueError("latency must be >= 0 and bytes_per_s > 0 (or None)")
        self.upstream = upstream
        self.latency = latency
        self._up = _Pace(bytes_per_s)
        self._down = _Pace(bytes_per_s)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="slowlink-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: where clients connect instead of the upstream."""
        return f"http://127.0.0.1:{self.port}"

    def set(self, latency: float | None = None, bytes_per_s: float | None = None) -> None:
        """Change the latency and/or the bandwidth cap (0 removes the cap)."""
        if latency is not None:
            self.latency = max(0.0, latency)
        if bytes_per_s is not None:
            self._up.rate = self._down.rate = bytes_per_s or None

    def close(self) -> None:
        """Stop accepting and drop every connection. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        _close(self._listener)
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for s in sockets:
            _close(s)

    def __enter__(self) -> "SlowLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- forwarding -----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, server))
            pending = [2]                       # directions still open on this connection

            def finished(pair=(client, server), pending=pending) -> None:
                with self._lock:
                    pending[0] -= 1
                    if pending[0]:
                        return
                    self._sockets.difference_update(pair)
                for s in pair:
                    _close(s)

            self._pipe(client, server, self._up, True, finished)
            self._pipe(server, client, self._down, False, finished)

    def _pipe(self, src: socket.socket, dst: socket.socket, pace: _Pace, delayed: bool,
              finished) -> None:
        """Forward ``src`` to ``dst`` paced by ``pace``; chunks from the client wait out the
        latency first (a reader queues them stamped, a writer sends them when due, so
        latency does not cost bandwidth)."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            try:
                while data := src.recv(_CHUNK):
                    chunks.put((time.monotonic() + (self.latency if delayed else 0.0), data))
            except OSError:
                pass
            chunks.put(None)

        def write() -> None:
            try:
                while (item := chunks.get()) is not None:
                    due, data = item
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pace.wait(len(data))
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                _close(src)
                _close(dst)
            finished()

        threading.Thread(target=read, name="slowlink-read", daemon=True).start()
        threading.Thread(target=write, name="slowlink-write", daemon=True).start()


def _close(s: socket.socket) -> None:
    """Shut down, then close: a thread blocked in recv or accept on ``s`` wakes up."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def main(argv: list[str] | None = None) -> None:
    """Run one :class:`SlowLink` to ``HOST:PORT`` until stdin closes or SIGTERM/SIGINT (see
    the module docstring); print the port it listens on first."""
    parser = argparse.ArgumentParser(prog="python -m kvstrata.testing.slowlink",
                                     description="a TCP proxy adding latency and a bandwidth cap")
    parser.add_argument("upstream", help="HOST:PORT to forward to")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added per request")
    parser.add_argument("--rate", type=float, default=None,
                        help="bytes per second each way (default: no cap)")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"upstream must be HOST:PORT, not {args.upstream!r}")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read(1 << 12):
                pass
        except (OSError, ValueError):
            pass
        done.set()

    with SlowLink((host, int(port)), latency=args.latency, bytes_per_s=args.rate) as link:
        print(link.port, flush=True)
        threading.Thread(target=watch_stdin, name="slowlink-stdin", daemon=True).start()
        while not done.wait(1.0):
            pass


if __name__ == "__main__":
    main()
