"""A misbehaving S3 endpoint on 127.0.0.1 for fault-injection tests of the object tier.

:class:`FaultyS3` answers every request the way its ``mode`` says:

* ``"hang"`` -- accept the request and send nothing (until the server stops): a timeout;
* ``"stall"`` -- send headers and half a body, then nothing: a read that never finishes;
* ``"503"`` -- ``503 SlowDown`` (throttling); ``"500"`` -- ``500 InternalError``;
* ``"reset"`` -- close the connection without answering;
* ``"404"`` -- ``404 NoSuchKey``; ``"403"`` -- ``403 AccessDenied``;
* ``"no-conditional"`` -- a working in-memory store (PUT, GET, HEAD) that answers a
  conditional PUT (``If-None-Match``) with ``501 NotImplemented``, like servers without it.

``requests`` counts what arrived. Stopping the server releases every hung handler.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ERRORS = {"503": (503, "SlowDown", "Please reduce your request rate."),
           "500": (500, "InternalError", "We encountered an internal error."),
           "404": (404, "NoSuchKey", "The specified key does not exist."),
           "403": (403, "AccessDenied", "Access Denied.")}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:   # quiet
        pass

    def _serve(self) -> None:
        server: FaultyS3 = self.server.owner   # type: ignore[attr-defined]
        with server.lock:
            server.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        self._body = self.rfile.read(length) if length else b""
        mode = server.mode
        if mode == "no-conditional":
            self._memory(server, self._body)
            return
        if mode == "hang":
            server.release.wait()
            return
        if mode == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            self.close_connection = True
            return
        if mode == "stall":
            self.send_response(200)
            self.send_header("Content-Length", "400")     # no more than an object: read
            self.end_headers()
            self.wfile.write(b"\0" * 200)
            self.wfile.flush()
            server.release.wait()
            return
        self._error(*_ERRORS[mode])

    def _error(self, status: int, code: str, message: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _memory(self, server: "FaultyS3", body: bytes) -> None:
        key = self.path.split("?")[0]
        if self.command == "PUT":
            if self.headers.get("If-None-Match"):
                self._error(501, "NotImplemented", "A header you provided implies "
                            "functionality that is not implemented.")
                return
            server.objects[key] = body
            self._ok(b"", hashlib.md5(body).hexdigest())
            return
        data = server.objects.get(key)
        if data is None:
            self._error(404, "NoSuchKey", "The specified key does not exist.")
            return
        self._ok(data, hashlib.md5(data).hexdigest())

    def _ok(self, data: bytes, etag: str) -> None:
        self.send_response(200)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _serve


class FaultyS3:
    """A loopback HTTP server answering every request per ``mode`` (see the module doc)."""

    def __init__(self, mode: str = "503") -> None:
        self.mode = mode
        self.requests = 0
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.owner = self   # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "FaultyS3":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
