"""A raw socket to an exporter that has done the sharing-secret handshake (:mod:`kvstrata.remote.auth`),
for tests that speak the control protocol byte by byte."""

from __future__ import annotations

import socket
import struct

import msgpack

from kvstrata.remote.auth import client_proof, new_nonce, resolve_secret, server_proof


def _frame(obj) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack("<I", len(body)) + body


def _reply(sock: socket.socket) -> dict:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "the exporter closed the connection during the handshake"
        head += chunk
    (length,) = struct.unpack("<I", head)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        assert chunk, "the exporter closed the connection during the handshake"
        body += chunk
    return msgpack.unpackb(body, raw=False)


def authenticate(sock: socket.socket, secret: bytes | None = None) -> socket.socket:
    """Prove ``sock`` holds the secret (the session's, by default); returns ``sock``."""
    secret = secret or resolve_secret()
    ours = new_nonce()
    sock.sendall(_frame({"op": "hello", "nonce": ours}))
    reply = _reply(sock)
    assert reply["proof"] == server_proof(secret, ours, reply["nonce"])
    sock.sendall(_frame({"op": "auth", "proof": client_proof(secret, ours, reply["nonce"])}))
    assert _reply(sock) == {"ok": True}
    return sock


def connect(address: tuple[str, int], timeout: float | None = None,
            source: str | None = None) -> socket.socket:
    """A new connection to an exporter, authenticated; from the loopback address ``source``
    (another "host") if given."""
    sock = socket.create_connection(address, timeout=timeout,
                                    source_address=(source, 0) if source else None)
    try:
        return authenticate(sock)
    except BaseException:
        sock.close()
        raise
