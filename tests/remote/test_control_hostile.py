"""The plain-TCP control protocol (:mod:`kvstrata.remote.control`) under hostile readers and
hostile servers: the serving thread never hangs, crashes, leaks descriptors or threads, or
stops serving the other readers; a :class:`ControlChannel` returns the right reply or raises
:class:`LeaseError` within its timeout.

"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from kvstrata.remote.control import (MAX_CONNECTIONS, ControlChannel, ControlServer,
                                     format_control, parse_control)
from kvstrata.remote.auth import resolve_secret
from kvstrata.remote.errors import LeaseError
from kvstrata.remote.nixl_agent import nixl_available

from .handshake import connect


needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
MAX_REQUEST = 1 << 20


# -- helpers -------------------------------------------------------------------------------
def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(predicate, timeout: float = 2.0, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def framed(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def packed(obj) -> bytes:
    return framed(msgpack.packb(obj))


def read_frame(sock: socket.socket) -> bytes | None:
    """One whole frame's body, or None if the peer closed/reset the connection."""
    def exactly(n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            try:
                chunk = sock.recv(min(n - len(data), 1 << 20))
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    head = exactly(4)
    if head is None:
        return None
    return exactly(struct.unpack("<I", head)[0])


def read_reply(sock: socket.socket):
    body = read_frame(sock)
    return None if body is None else msgpack.unpackb(body, raw=False)


def address(control: str) -> tuple[str, int]:
    return parse_control(control)


def hashes(*values) -> bytes:
    return np.array(values, dtype="<u8").tobytes()


class Ticks:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@contextlib.contextmanager
def serving(handler=lambda body: body, *, on_tick=None, tick: float = 0.05,
            max_request: int = MAX_REQUEST, port: int = 0, secret: bytes | None = None):
    """A started ControlServer on 127.0.0.1 (echo by default), closed after."""
    server = ControlServer("127.0.0.1", port, lambda body, peer: handler(body),
                           max_request=max_request, tick=tick,
                           on_tick=on_tick or (lambda: None), name="kvstrata-control-test",
                           secret=secret)
    server.start()
    try:
        yield server
    finally:
        server.close()


def echo_id(body: bytes) -> bytes:
    """Handler: a map echoing the request (its id included)."""
    request = msgpack.unpackb(body, raw=False)
    return msgpack.packb({"echo": request, "id": request.get("id")})


@contextlib.contextmanager
def fake_server(behave):
    """A hostile *exporter*: for each connection, ``behave(conn)`` runs on a thread."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def run():
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (socket.timeout, OSError):
                continue
            conns.append(conn)
            threading.Thread(target=_guard, args=(behave, conn), daemon=True).start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield format_control("127.0.0.1", listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(2)
        for c in conns:
            c.close()
        listener.close()


def _guard(behave, conn):
    with contextlib.suppress(OSError, TypeError):        # TypeError: the reader left
        behave(conn)


def read_request(conn: socket.socket) -> dict:
    return msgpack.unpackb(read_frame(conn), raw=False)


# == the server under hostile readers ========================================================
def test_connections_opened_and_closed_in_a_loop_leak_no_descriptors():
    with serving() as server:
        host, port = address(server.address)
        with socket.create_connection((host, port)) as warm:     # settle lazy allocations
            warm.sendall(framed(b"x"))
            assert read_frame(warm) == b"x"
        assert wait_until(lambda: not server._peers)
        before = fd_count()
        for i in range(300):
            s = socket.create_connection((host, port))
            kind = i % 4
            if kind == 1:                                        # half a frame
                s.sendall(struct.pack("<I", 100) + b"abc")
            elif kind == 2:                                      # RST instead of FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.sendall(framed(b"hello"))
            elif kind == 3:                                      # a length over the limit
                s.sendall(struct.pack("<I", MAX_REQUEST + 1))
            s.close()
        assert wait_until(lambda: not server._peers and fd_count() <= before, timeout=3), \
            (len(server._peers), fd_count(), before)
        with socket.create_connection((host, port)) as s:
            s.sendall(framed(b"still here"))
            assert read_frame(s) == b"still here"


def test_servers_started_and_closed_leak_no_threads_or_descriptors():
    with serving():
        pass
    threads, fds = threading.active_count(), fd_count()
    for _ in range(20):
        with serving() as server:
            host, port = address(server.address)
            idle = socket.create_connection((host, port))
            busy = socket.create_connection((host, port))
            busy.sendall(framed(b"ping"))
            assert read_frame(busy) == b"ping"
        assert read_frame(idle) is None and read_frame(busy) is None  # closed by the server
        idle.close()
        busy.close()
    assert threading.active_count() <= threads
    assert fd_count() <= fds
    assert not any(t.name == "kvstrata-control-test" for t in threading.enumerate())


def test_300_concurrent_connections_keep_256_and_refuse_the_rest_at_once():
    """From 10 addresses of the loopback network, 30 each (one host may hold
    MAX_CONNECTIONS_PER_HOST)."""
    with serving(echo_id) as server:
        host, port = address(server.address)
        socks = [socket.create_connection((host, port), timeout=2,
                                          source_address=(f"127.0.0.{2 + i % 10}", 0))
                 for i in range(300)]
        try:
            assert wait_until(lambda: len(server._peers) == MAX_CONNECTIONS)
            answered = refused = 0
            for i, s in enumerate(socks):
                try:
                    s.sendall(packed({"i": i, "id": i}))
                except (BrokenPipeError, ConnectionResetError):
                    refused += 1
                    continue
                reply = read_reply(s)
                if reply is None:
                    refused += 1
                else:
                    assert reply["id"] == i and reply["echo"]["i"] == i
                    answered += 1
            assert answered == MAX_CONNECTIONS and refused == 300 - MAX_CONNECTIONS
            # one more reader while full: refused promptly, a LeaseError (no hang)
            channel = ControlChannel(server.address, 3.0, secret=b"")
            assert len(server._peers) == MAX_CONNECTIONS
            t0 = time.monotonic()
            with pytest.raises(LeaseError):
                channel.call({"op": "x"})
            assert time.monotonic() - t0 < 1.0
        finally:
            for s in socks:
                s.close()
        # and served again once the others leave
        assert wait_until(lambda: not server._peers)
        assert channel.call({"op": "again"})["echo"]["op"] == "again"
        channel.close()


def test_a_reader_that_disconnects_mid_reply_is_dropped_and_others_are_served():
    big = os.urandom(4 << 20)
    with serving(lambda body: big if body == b"big" else body) as server:
        host, port = address(server.address)
        before = fd_count()
        for i in range(10):
            s = socket.create_connection((host, port))
            s.sendall(framed(b"big"))
            assert len(s.recv(4096)) > 0                      # the reply has begun
            if i % 2:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        with socket.create_connection((host, port), timeout=2) as other:
            other.sendall(framed(b"small"))
            assert read_frame(other) == b"small"
        assert wait_until(lambda: not server._peers and fd_count() <= before, timeout=3)
        # a whole big reply still arrives intact
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(framed(b"big"))
            assert read_frame(s) == big


def test_a_reader_that_never_reads_its_replies_is_not_read_further():
    big = b"\0" * (8 << 20)
    with serving(lambda body: big) as server:
        host, port = address(server.address)
        flooder = socket.create_connection((host, port))
        flooder.setblocking(False)
        frame = framed(b"r" * 1000)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            for _ in range(20000):
                sent += flooder.send(frame)
        time.sleep(0.1)
        (peer,) = [p for p in server._peers.values()]
        assert peer.outbox                                       # stuck writing the reply
        assert len(peer.inbox) <= MAX_REQUEST + 4 + (1 << 16)    # nothing piles up
        with socket.create_connection((host, port), timeout=5) as other:
            other.sendall(framed(b"x"))
            assert len(read_frame(other)) == len(big)
        flooder.close()
        assert wait_until(lambda: not server._peers)


@needs_nixl
def test_a_request_trickled_byte_by_byte_is_answered_and_does_not_block_others(exporter):
    ex, _ = exporter
    host, port = address(ex.control)
    data = packed({"op": "has", "hashes": hashes(1, 2, 3), "id": 41})
    with connect((host, port), timeout=3) as slow, \
            connect((host, port), timeout=3) as quick:
        for i, byte in enumerate(data):
            slow.sendall(bytes([byte]))
            if i == len(data) // 2:
                quick.sendall(packed({"op": "has", "hashes": hashes(1), "id": 1}))
                assert read_reply(quick) == {"held": 1, "id": 1}
            time.sleep(0.002)
        assert read_reply(slow) == {"held": 3, "id": 41}


@needs_nixl
def test_pipelined_requests_in_one_send_are_answered_in_order(exporter):
    ex, pins = exporter
    host, port = address(ex.control)
    requests = b"".join(packed({"op": "has", "hashes": hashes(*range(1, 1 + i % 9)), "id": i})
                        for i in range(200))
    with connect((host, port), timeout=3) as s:
        s.sendall(requests)
        for i in range(200):
            reply = read_reply(s)
            assert reply["id"] == i
            if i % 9:
                assert reply == {"held": i % 9, "id": i}
            else:
                assert "error" in reply                           # empty hashes
    assert pins.pinned and all(pins.pinned.count(t) == pins.unpinned.count(t)
                               for t in pins.pinned)


@needs_nixl
@pytest.mark.parametrize("body", [b"", msgpack.packb([1, 2]), msgpack.packb(7),
                                  msgpack.packb(None), b"\xc1", msgpack.packb({1: 2}),
                                  msgpack.packb({"op": "has"}) + b"trailing",
                                  b"\xa3\xff\xfe\xfd"])
def test_bad_frames_get_an_error_and_the_connection_stays_usable(exporter, body):
    ex, _ = exporter
    with connect(address(ex.control), timeout=3) as s:
        s.sendall(framed(body) + packed({"op": "has", "hashes": hashes(1, 2), "id": 5}))
        first = read_reply(s)
        assert isinstance(first, dict) and "error" in first
        assert read_reply(s) == {"held": 2, "id": 5}


@needs_nixl
def test_a_request_of_exactly_max_request_is_read_and_one_byte_more_is_dropped(exporter):
    ex, _ = exporter
    overhead = len(msgpack.packb({"op": "has", "hashes": hashes(1), "id": 3,
                                  "pad": b"\0" * 70000})) - 70000
    body = msgpack.packb({"op": "has", "hashes": hashes(1), "id": 3,
                          "pad": b"\0" * (MAX_REQUEST - overhead)})
    assert len(body) == MAX_REQUEST
    with connect(address(ex.control), timeout=3) as s:
        s.sendall(framed(body))
        assert read_reply(s) == {"held": 1, "id": 3}
    with connect(address(ex.control), timeout=3) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(framed(body + b"\0"))
        assert read_reply(s) is None
    assert ControlChannel(ex.control, 2).call({"op": "has", "hashes": hashes(1)})["held"] == 1


@needs_nixl
def test_lease_expiry_keeps_running_while_a_reader_floods(exporter):
    ex, pins = exporter
    channel = ControlChannel(ex.control, 2.0)
    lease = channel.call({"op": "lease", "hashes": hashes(1, 2), "ttl": 0.2})
    assert lease["lease"] > 0
    stop = threading.Event()
    answered = [0]

    def flood():
        batch = packed({"op": "has", "hashes": hashes(1)}) * 50
        with connect(address(ex.control), timeout=2) as s:
            while not stop.is_set():
                s.sendall(batch)
                for _ in range(50):
                    assert read_reply(s) == {"held": 1}
                answered[0] += 50

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        assert wait_until(lambda: ex.leases.expired == 1, timeout=1.5)
    finally:
        stop.set()
        flooder.join(3)
    assert answered[0] > 0 and len(ex.leases) == 0 and [1, 2] in pins.unpinned
    assert channel.call({"op": "release", "lease": lease["lease"]})["released"] is False
    channel.close()


def test_on_tick_exceptions_are_contained_and_ticking_goes_on():
    calls = Ticks()

    def on_tick():
        calls()
        raise RuntimeError("tick failed")

    with serving(echo_id, on_tick=on_tick, tick=0.02) as server:
        assert wait_until(lambda: calls.count >= 5)
        channel = ControlChannel(server.address, 2.0, secret=b"")
        assert channel.call({"op": "x"})["echo"]["op"] == "x"
        assert server._thread.is_alive()
        channel.close()


def test_on_tick_runs_every_tick_while_idle():
    ticks = Ticks()
    with serving(on_tick=ticks, tick=0.02):
        time.sleep(0.3)
        n = ticks.count
    assert 5 <= n <= 40


def test_resets_before_accept_do_not_crash_the_server():
    gate = threading.Event()

    def handler(body):
        if body == b"block":
            gate.wait(3)
        return body

    with serving(handler) as server:
        host, port = address(server.address)
        blocker = socket.create_connection((host, port))
        blocker.sendall(framed(b"block"))
        time.sleep(0.05)
        for _ in range(40):                              # queued, reset before accepted
            s = socket.create_connection((host, port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.sendall(framed(b"x"))
            s.close()
        gate.set()
        assert read_frame(blocker) == b"block"
        blocker.close()
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(framed(b"ok"))
            assert read_frame(s) == b"ok"
        assert server._thread.is_alive()


# == close ===================================================================================
@needs_nixl
def test_close_with_readers_connected_is_prompt_frees_the_port_and_fails_callers(exporter):
    ex, _ = exporter
    host, port = address(ex.control)
    idle = [connect((host, port)) for _ in range(20)]
    stuck = connect((host, port))                               # a reply it never reads
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        stuck.send(packed({"op": "blockset"}) * 5000)
    channel = ControlChannel(ex.control, 3.0)
    assert channel.call({"op": "has", "hashes": hashes(1)})["held"] == 1
    assert wait_until(lambda: len(ex._server._peers) == 22)
    t0 = time.monotonic()
    ex.close()
    assert time.monotonic() - t0 < 1.0
    assert not any(t.name == f"kvstrata-export-{ex.name}" for t in threading.enumerate())
    for s in idle:
        assert read_frame(s) is None
        s.close()
    stuck.close()
    t0 = time.monotonic()
    with pytest.raises(LeaseError):
        channel.call({"op": "has", "hashes": hashes(1)})
    with pytest.raises(LeaseError):                              # nobody listens any more
        channel.call({"op": "has", "hashes": hashes(1)})
    assert time.monotonic() - t0 < 1.0
    with serving(echo_id, port=port, secret=resolve_secret()) as again:   # the port is free
        assert address(again.address) == (host, port)
        reply = channel.call({"op": "x", "id": 1})
        assert reply["echo"]["op"] == "x"
    channel.close()
    ex.close()                                                   # idempotent


def test_a_call_in_flight_when_the_server_closes_fails_fast():
    gate = threading.Event()

    def handler(body):
        gate.wait(0.3)
        return echo_id(body)

    server = ControlServer("127.0.0.1", 0, lambda body, peer: handler(body),
                           max_request=MAX_REQUEST, tick=0.05,
                           on_tick=lambda: None, name="kvstrata-control-test")
    server.start()
    channel = ControlChannel(server.address, 4.0, secret=b"")
    outcome = []

    def call():
        t0 = time.monotonic()
        try:
            channel.call({"op": "first"})
            channel.call({"op": "second"})
            outcome.append(("ok", time.monotonic() - t0))
        except LeaseError:
            outcome.append(("LeaseError", time.monotonic() - t0))

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 1.0
    caller.join(5)
    assert outcome and outcome[0][0] == "LeaseError" and outcome[0][1] < 2.0
    channel.close()


def test_close_before_start_releases_the_port():
    server = ControlServer("127.0.0.1", 0, lambda b, peer: b, max_request=16, tick=0.05,
                           on_tick=lambda: None, name="never-started")
    port = address(server.address)[1]
    server.close()
    server.close()
    with serving(port=port):
        pass


# == the channel against hostile or absent servers ==========================================
def test_a_channel_to_a_port_nobody_listens_on_raises_lease_error_at_once():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    channel = ControlChannel(format_control("127.0.0.1", port), 3.0, secret=b"")
    t0 = time.monotonic()
    for _ in range(3):
        with pytest.raises(LeaseError):
            channel.call({"op": "blockset"})
        with pytest.raises(LeaseError):
            channel.call({"op": "release", "lease": 1}, wait=False)
    assert time.monotonic() - t0 < 1.0


def _ids_then_answer(conn):
    while True:
        request = read_request(conn)
        conn.sendall(packed({"id": -1, "stale": True}) + packed({"id": "x"}) +
                     packed({"no": "id"}) + packed({"id": request["id"], "ok": request}))


def _not_a_map(conn):
    read_request(conn)
    conn.sendall(packed([1, 2, 3]))
    time.sleep(1)


def _garbage(conn):
    read_request(conn)
    conn.sendall(framed(b"\xc1\xc1\xc1"))
    time.sleep(1)


def _bad_utf8(conn):
    request = read_request(conn)
    conn.sendall(framed(b"\x81\xa2id\xa2\xff\xfe"))             # an invalid UTF-8 str
    time.sleep(1)


def _huge_length(conn):
    read_request(conn)
    conn.sendall(struct.pack("<I", 0xFFFFFFFF) + b"\0" * 16)
    time.sleep(1)


def _header_only(conn):
    read_request(conn)
    conn.sendall(struct.pack("<I", 100) + b"\x81")
    time.sleep(1)


def _silent(conn):
    read_request(conn)
    time.sleep(1)


def _trickle(conn):
    """Unrelated replies, one byte every 20 ms, for ever: each recv succeeds in time."""
    read_request(conn)
    stream = packed({"id": 0, "noise": "x" * 50}) * 100
    for b in stream:
        conn.sendall(bytes([b]))
        time.sleep(0.02)


def _hang_up(conn):
    read_request(conn)
    conn.close()


def _reset(conn):
    read_request(conn)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _trailing_extra(conn):
    request = read_request(conn)
    conn.sendall(framed(msgpack.packb({"id": request["id"]}) + b"\x00"))
    time.sleep(1)


@pytest.mark.parametrize("behave", [_not_a_map, _garbage, _bad_utf8, _huge_length,
                                    _header_only, _silent, _trickle, _hang_up, _reset,
                                    _trailing_extra])
def test_a_hostile_server_gives_only_lease_errors_within_the_timeout(behave):
    with fake_server(behave) as control:
        channel = ControlChannel(control, 0.5, secret=b"")
        t0 = time.monotonic()
        with pytest.raises(LeaseError):
            channel.call({"op": "blockset"})
        assert time.monotonic() - t0 < 0.5 + 0.3
        assert channel._sock is None                             # never reused half-read
        channel.close()


def test_replies_with_other_ids_are_skipped():
    with fake_server(_ids_then_answer) as control:
        channel = ControlChannel(control, 2.0, secret=b"")
        for i in range(5):
            reply = channel.call({"op": "has", "n": i})
            assert reply["ok"]["n"] == i and reply["id"] == reply["ok"]["id"]
        channel.close()


@needs_nixl
def test_replies_nobody_waits_for_are_skipped_and_the_next_call_gets_its_own(exporter):
    ex, _ = exporter
    channel = ControlChannel(ex.control, 2.0)
    for n in range(1, 9):
        assert channel.call({"op": "release", "lease": 999}, wait=False) == {}
        assert channel.call({"op": "has", "hashes": hashes(*range(1, n + 1))},
                            wait=False) == {}
    for n in range(1, 9):
        reply = channel.call({"op": "has", "hashes": hashes(*range(1, n + 1))})
        assert reply["held"] == n
    channel.close()


@needs_nixl
def test_concurrent_calls_on_one_channel_each_get_their_own_reply(exporter):
    ex, _ = exporter
    channel = ControlChannel(ex.control, 3.0)
    errors: list[BaseException] = []

    def worker(n: int):
        try:
            for i in range(40):
                if i % 5 == 0:
                    channel.call({"op": "release", "lease": 10_000 + n}, wait=False)
                reply = channel.call({"op": "has", "hashes": hashes(*range(1, n + 1))})
                assert reply["held"] == n, reply
        except BaseException as exc:        # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in threads)
    channel.close()


def test_malformed_requests_are_caller_errors_and_leave_the_channel_usable():
    with serving(echo_id) as server:
        channel = ControlChannel(server.address, 2.0, secret=b"")
        with pytest.raises((TypeError, ValueError)):
            channel.call({"op": object()})
        assert channel.call({"op": "fine"})["echo"]["op"] == "fine"
        channel.close()


# == bugs ===================================================================================
def test_a_shared_channel_bounds_every_callers_wait_by_its_timeout():
    with fake_server(_silent) as control:
        channel = ControlChannel(control, 0.4, secret=b"")
        waited: list[float] = []

        def call():
            t0 = time.monotonic()
            with contextlib.suppress(LeaseError):
                channel.call({"op": "has"})
            waited.append(time.monotonic() - t0)

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        channel.close()
    assert len(waited) == 3
    assert max(waited) < 0.4 + 0.3, waited                       # today: ~0.4, 0.8, 1.2


def test_running_out_of_descriptors_does_not_make_the_server_spin():
    ticks = Ticks()
    with serving(on_tick=ticks, tick=0.05) as server:
        host, port = address(server.address)
        client = socket.socket()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers: list[int] = []
        try:
            highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 16, hard))
            with contextlib.suppress(OSError):
                while True:
                    fillers.append(os.open("/dev/null", os.O_RDONLY))
            client.connect((host, port))          # queued; the server cannot accept it
            time.sleep(0.05)
            start = ticks.count
            time.sleep(0.2)
            spins = ticks.count - start
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # once descriptors are back the connection is served
        client.settimeout(2)
        client.sendall(framed(b"late"))
        assert read_frame(client) == b"late"
        client.close()
    assert spins < 50, f"{spins} loop iterations in 0.2 s"      # ~4 expected at tick=0.05


def test_a_handler_that_raises_drops_its_reader_and_the_server_keeps_serving():
    def handler(body: bytes) -> bytes:
        if body == b"boom":
            raise ValueError("a bug in the handler")
        return body

    with serving(handler) as server:
        host, port = address(server.address)
        with socket.create_connection((host, port), timeout=2) as bad:
            bad.sendall(framed(b"boom"))
            assert read_frame(bad) is None                    # dropped, not answered
        with socket.create_connection((host, port), timeout=2) as good:
            good.sendall(framed(b"still here"))
            assert read_frame(good) == b"still here"


class _Replies:
    """A control channel that answers every call with ``reply`` (unit-level fault
    injection: what a broken or hostile exporter could send)."""

    def __init__(self, reply: dict) -> None:
        self.reply = reply

    def call(self, request: dict) -> dict:
        return dict(self.reply)


@pytest.mark.parametrize("granted", [float("nan"), float("inf"), 10.5, -1.0, True, "5"])
def test_a_lease_reply_lasting_longer_than_asked_or_not_a_duration_is_refused(granted):
    import types
    from kvstrata.remote.importer import RemotePeer
    reply = {"lease": 7, "ttl": granted, "slots": struct.pack("<Q", 3),
             "checksums": struct.pack("<Q", 9)}
    peer = RemotePeer(None, types.SimpleNamespace(name="peer"), _Replies(reply))
    with pytest.raises(LeaseError, match="malformed lease reply"):
        peer.lease([1, 2], ttl=10.0)        # NaN or inf would turn off every expiry check
    reply["ttl"] = 4.0
    lease = peer.lease([1, 2], ttl=10.0)
    assert lease.expires <= time.monotonic() + 4.0 and len(lease.blocks) == 1
