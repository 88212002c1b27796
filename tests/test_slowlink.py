"""The slow link the benchmarks put in front of a store: it forwards bytes unchanged, holds
requests for its latency and caps bandwidth (lower bounds on time only: a loaded machine can
make it slower, never faster)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvstrata.testing.slowlink import SlowLink


@pytest.fixture
def echo():
    """A TCP server that echoes every connection's bytes back as they come."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def run(conn=conn) -> None:
                with conn:
                    while data := conn.recv(1 << 16):
                        conn.sendall(data)
            threading.Thread(target=run, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()
    server.close()


def roundtrip(port: int, payload: bytes) -> tuple[bytes, float]:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while data := s.recv(1 << 16):
            got += data
        sender.join()
    return bytes(got), time.monotonic() - start


def test_bytes_pass_unchanged_after_the_latency(echo):
    payload = os.urandom(300_000)
    with SlowLink(echo, latency=0.2) as link:
        got, seconds = roundtrip(link.port, payload)
    assert got == payload
    assert seconds >= 0.2


def test_bandwidth_is_capped_per_direction_across_connections(echo):
    payload = os.urandom(1 << 20)
    with SlowLink(echo, bytes_per_s=4 << 20) as link:
        results = []
        threads = [threading.Thread(target=lambda: results.append(roundtrip(link.port, payload)))
                   for _ in range(2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        assert all(got == payload for got, _ in results)
        assert elapsed >= 2 * len(payload) / (4 << 20) * 0.95        # 2 MiB each way at 4 MiB/s
        link.set(bytes_per_s=0)                                      # uncapped now
        got, seconds = roundtrip(link.port, payload)
        assert got == payload


def test_closing_drops_connections_and_refuses_new_ones(echo):
    link = SlowLink(echo)
    s = socket.create_connection(("127.0.0.1", link.port))
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    link.close()
    link.close()
    assert s.recv(1) == b""
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", link.port), timeout=1).close()
    with pytest.raises(ValueError):
        SlowLink(echo, latency=-1)


def test_the_link_runs_as_a_process_until_its_stdin_closes(echo):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.testing.slowlink",
                             f"{echo[0]}:{echo[1]}", "--latency", "0.01"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        payload = os.urandom(100_000)
        got, _ = roundtrip(port, payload)
        assert got == payload
        assert proc.poll() is None
        proc.stdin.close()                       # the parent let go: the link ends itself
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
