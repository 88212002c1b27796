"""``_wire.send_nowait`` (native) and ``natswire.py_send_nowait`` (its fallback): the same bytes
reach the peer, the same counts come back, the same errors are raised."""

from __future__ import annotations

import random
import socket

import pytest

from kvstrata.events import natswire


@pytest.fixture(params=["native", "python"])
def send_nowait(request):
    if request.param == "python":
        return natswire.py_send_nowait
    wire = pytest.importorskip("kvstrata.events._wire", reason="native event fast paths not built")
    return wire.send_nowait


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _drain(sock: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return bytes(out)
        if not data:
            return bytes(out)
        out += data


def _buffers(rng: random.Random, count: int, size: int) -> list:
    kinds = (bytes, bytearray, lambda b: memoryview(b)[1:] if b else memoryview(b))
    return [rng.choice(kinds)(rng.randbytes(rng.randrange(size))) for _ in range(count)]


@pytest.mark.parametrize("count", [0, 1, 3, 511, 512, 513, 1500])  # around the iovec chunk size
def test_everything_that_fits_is_sent_in_order(send_nowait, pair, count):
    a, b = pair
    bufs = _buffers(random.Random(count), count, 40)
    want = b"".join(bytes(x) for x in bufs)
    assert send_nowait(a, bufs) == len(want)
    assert _drain(b) == want


def test_a_full_socket_takes_a_prefix_then_nothing(send_nowait, pair):
    a, b = pair
    rng = random.Random(5)
    sent, total = 0, 0
    wrote = bytearray()
    while True:  # fill the socket: the last call takes only part of what it was given
        bufs = _buffers(rng, 50, 20000)
        data = b"".join(bytes(x) for x in bufs)
        n = send_nowait(a, bufs)
        wrote += data[:n]
        sent += n
        total += len(data)
        if n < len(data):
            break
    assert send_nowait(a, [b"more"]) == 0  # full: nothing taken, no error
    assert _drain(b) == bytes(wrote) and sent < total


def test_a_closed_peer_is_an_error(send_nowait, pair):
    a, b = pair
    b.close()
    with pytest.raises(OSError):
        send_nowait(a, [b"PUB x 1\r\n", b"y", b"\r\n"])



def test_a_server_that_requires_tls_leaves_publishing_to_nats_py():
    """Fault injection: a listener that greets like a TLS-only NATS server. The sink's own
    connection gives up on it (it does not do TLS) and the sink publishes through nats-py."""
    import threading
    import time

    from kvstrata.events import EventPublisher
    from kvstrata.events.sinks import NatsSink

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    greeted = []

    def greet():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b'INFO {"server_id":"x","max_payload":1048576,"tls_required":true}\r\n')
            greeted.append(conn)

    thread = threading.Thread(target=greet, daemon=True)
    thread.start()
    pub = EventPublisher(NatsSink(f"nats://127.0.0.1:{port}", "kv.tls")).start()
    wire = pub.sink._wire
    deadline = time.monotonic() + 10
    while wire.unsupported is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wire.unsupported == "the server requires TLS" and not wire.connected
    assert pub.sink._direct_wire() is None  # from now on: nats-py's connection
    pub.close(timeout=0.5)
    listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
    listener.close()
    thread.join(5)
    assert not thread.is_alive()
    for conn in greeted:
        conn.close()


def test_a_server_whose_info_is_malformed_is_tried_again_and_odd_sizes_are_not_believed():
    """Fault injection: a listener that first greets with an INFO that is no JSON object,
    then with one whose max_payload is no size, then (connected) sends more odd INFOs. The
    sink keeps reconnecting (a malformed INFO once ended its retries for good), keeps the
    default max_payload, and reads on past an odd INFO (it still answers PINGs)."""
    import threading
    import time

    from kvstrata.events import EventPublisher
    from kvstrata.events.natswire import DEFAULT_MAX_PAYLOAD
    from kvstrata.events.sinks import NatsSink

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    conns, pongs, checked = [], [], threading.Event()

    def serve():
        greetings = [b"INFO []\r\n", b'INFO {"server_id":"x","max_payload":"abc"}\r\n']
        while greetings:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            conn.sendall(greetings.pop(0))
        seen = b""
        while b"PING\r\n" not in seen:           # CONNECT, then the handshake's PING
            seen += conn.recv(4096)
        conn.sendall(b"PONG\r\n")
        time.sleep(0.2)
        conn.sendall(b'INFO {"max_payload":-5}\r\nINFO [1]\r\nINFO {"max_payload":1e9}\r\n'
                     b"PING\r\n")
        seen = b""
        while b"PONG\r\n" not in seen:
            seen += conn.recv(4096)
        pongs.append(True)
        checked.wait(10)
        conn.sendall(b'INFO {"max_payload":2048}\r\n')

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    pub = EventPublisher(NatsSink(f"nats://127.0.0.1:{port}", "kv.info")).start()
    wire = pub.sink._wire
    deadline = time.monotonic() + 20
    while not pongs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pongs and wire.connected and wire.unsupported is None
    assert len(conns) == 2                              # tried again after the bad INFO
    assert wire.max_payload == DEFAULT_MAX_PAYLOAD      # no odd size believed
    checked.set()
    while wire.max_payload != 2048 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wire.max_payload == 2048                     # a sane one is taken
    pub.close(timeout=0.5)
    listener.close()
    thread.join(5)
    for conn in conns:
        conn.close()
