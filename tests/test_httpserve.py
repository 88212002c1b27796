"""kvstrata.httpserve: the one HTTP server of kvstrata's endpoints (the indexer, a manager's
/metrics) is bounded per request and in threads (issue 28)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from kvstrata.httpserve import BoundedHTTPServer, BoundedRequestHandler


class Hello(BoundedRequestHandler):
    timeout = 1.0

    def log_message(self, fmt, *args):
        pass

    def do_GET(self):
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serving(**kw) -> BoundedHTTPServer:
    return BoundedHTTPServer(("127.0.0.1", 0), Hello, **kw).start("test-http")


def test_it_answers_and_closes():
    server = _serving()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        assert urllib.request.urlopen(url, timeout=10).read() == b"hello"
    finally:
        server.close()
    assert not any(t.name in ("test-http", "kvstrata-http-deadlines")
                   for t in threading.enumerate())


def test_a_dripping_request_is_cut_off_at_its_deadline_and_threads_stay_bounded():
    server = _serving(request_timeout=1.0, max_connections=4)
    socks = []
    try:
        before, peak = threading.active_count(), 0
        for _ in range(20):
            sock = socket.create_connection(server.server_address, timeout=10)
            sock.sendall(b"GET / HTTP/1.1\r\n")
            socks.append(sock)
        started = time.monotonic()
        drip = socks[0]
        closed = False
        while time.monotonic() - started < 8 and not closed:
            try:
                drip.sendall(b"X-Slow: a\r\n")        # a header every 0.2 s, never the end
            except OSError:
                closed = True
                break
            peak = max(peak, threading.active_count() - before)
            drip.settimeout(0.2)
            try:
                closed = drip.recv(1) == b""
            except (socket.timeout, TimeoutError):
                pass
            except ConnectionResetError:
                closed = True
        assert closed and time.monotonic() - started < 5
        assert peak <= 4, peak
        assert server.refused > 0
    finally:
        for sock in socks:
            sock.close()
        server.close()
