"""The NATS sink's own publishing connection (kvstrata.events.natswire) against a real
nats-server: keep-alive, a server restart, a torn write, an oversized message, a clean close."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
import uuid

import pytest

from kvstrata.events import EventPublisher, WorkerStates
from kvstrata.events import natswire
from kvstrata.events.sinks import NatsSink
from kvstrata.events.subscriber import NatsFollower
from kvstrata.events.testing import chain

pytestmark = pytest.mark.integration


@pytest.fixture(params=["native", "python"])
def send_path(request, monkeypatch):
    """Each test runs with the native non-blocking send (when built) and with its fallback."""
    if request.param == "python":
        monkeypatch.setattr(natswire, "send_nowait", natswire.py_send_nowait)
    elif natswire.send_nowait is natswire.py_send_nowait:
        pytest.skip("native event fast paths not built")
    return request.param


def subject() -> str:
    return f"kvwire.{uuid.uuid4().hex[:10]}"


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _publisher(url: str, subj: str, **sink_options) -> EventPublisher:
    pub = EventPublisher(NatsSink(url, subj, **sink_options), max_batch=64, worker_id=7).start()
    assert _wait(lambda: pub.sink.connected), "sink never connected"
    return pub


def _produce(pub: EventPublisher, start: int, count: int) -> None:
    for s in range(start, start + count):
        c = chain(s, 4)
        pub.on_tier_stored("G1", c)
        pub.on_tier_removed("G1", [c[-1].sequence_hash])


def _caught_up(nf: NatsFollower, pub: EventPublisher) -> bool:
    return _wait(lambda: nf.follower.last_event_id(7) == pub.last_event_id)


def test_server_pings_are_answered_so_an_idle_connection_stays_up(own_nats_server, send_path):
    # the server drops a client that leaves two of its PINGs (100 ms apart) unanswered
    server = own_nats_server('ping_interval: "100ms"\nping_max: 2\n')
    subj = subject()
    with NatsFollower(server.url, subj, WorkerStates()) as nf:
        pub = _publisher(server.url, subj)
        _produce(pub, 0, 10)
        assert pub.flush(5)
        time.sleep(1.0)  # idle through ten of the server's PINGs
        _produce(pub, 10, 10)
        assert pub.flush(5) and _caught_up(nf, pub)
        assert pub.sink._wire.connects == 1  # never dropped, never reconnected
        assert nf.follower.stats()["gaps"] == 0
        pub.close()


def test_events_produced_while_the_server_is_down_arrive_after_it_returns(own_nats_server, send_path):
    server = own_nats_server()
    subj = subject()
    with NatsFollower(server.url, subj, WorkerStates()) as nf:
        pub = _publisher(server.url, subj)
        wire = pub.sink._wire
        _produce(pub, 0, 50)
        assert pub.flush(5) and _caught_up(nf, pub)
        before = pub.last_event_id
        # The publisher's connection may come back only once the follower is subscribed again
        # (core NATS delivers nothing to a subject nobody listens on).
        gate = threading.Event()
        reconnect = wire._keep_trying

        async def gated():
            while not gate.is_set():
                await asyncio.sleep(0.01)
            await reconnect()

        wire._keep_trying = gated
        server.stop()
        assert _wait(lambda: not wire.connected)
        _produce(pub, 50, 100)  # buffered by the publisher, its sends fail and are retried
        assert not pub.flush(0.2)
        server.start()
        assert _wait(lambda: nf._nc.is_connected)
        nf._aio.run(nf._nc.flush(timeout=5), 6)  # the server has the follower's subscription
        gate.set()
        assert pub.flush(20) and _caught_up(nf, pub)
        m = pub.metrics()
        assert pub.last_event_id == before + 200 and m["dropped"] == 0 and m["sink_errors"] > 0
        assert m["published"] == m["enqueued"] == pub.last_event_id
        stats = nf.follower.stats()
        assert stats["gaps"] == 0 and stats["duplicates"] == 0 and wire.connects == 2
        pub.close()


def test_a_torn_write_is_sent_again_whole_on_a_new_connection(own_nats_server, send_path, monkeypatch):
    server = own_nats_server()
    subj = subject()
    real = natswire.send_nowait
    torn = []

    def tear_once(sock, buffers):  # fault injection: half a batch written, then the link fails
        if not torn and sum(map(len, buffers)) > 1000:
            data = b"".join(bytes(b) for b in buffers)
            real(sock, [data[: len(data) // 2]])
            torn.append(len(data))
            raise ConnectionResetError(errno.ECONNRESET, "injected")
        return real(sock, buffers)

    with NatsFollower(server.url, subj, WorkerStates()) as nf:
        pub = _publisher(server.url, subj)
        monkeypatch.setattr(natswire, "send_nowait", tear_once)
        _produce(pub, 0, 200)
        assert pub.flush(20) and _caught_up(nf, pub)
        stats = nf.follower.stats()
        assert torn and stats["gaps"] == 0 and stats["duplicates"] == 0
        assert stats["applied"] == pub.last_event_id == 400
        m = pub.metrics()
        assert m["dropped"] == 0 and m["sink_errors"] >= 1 and pub.sink._wire.connects == 2
        pub.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "nats-py"])
def test_an_event_over_max_payload_fails_its_batch_only(own_nats_server, direct, caplog):
    server = own_nats_server("max_payload: 2048\n")
    subj = subject()
    with NatsFollower(server.url, subj, WorkerStates()) as nf:
        pub = _publisher(server.url, subj, direct=direct)
        _produce(pub, 0, 5)
        assert pub.flush(5)
        with caplog.at_level("WARNING", logger="kvstrata.events.publisher"):
            pub.on_tier_stored("G2", chain(999, 100))  # ~4 KB on its own: never sent
            assert pub.flush(5)
        _produce(pub, 5, 5)
        assert pub.flush(5) and _caught_up(nf, pub)
        m = pub.metrics()
        assert m["sink_errors"] == 1 and m["dropped"] == 1 and "max_payload" in caplog.text
        assert nf.follower.stats()["gaps"] >= 1  # the consumer sees the hole
        if direct:
            assert pub.sink._wire.connects == 1  # the server never saw it, kept the connection
        pub.close()


def test_close_leaves_no_thread_and_does_not_hang_with_the_server_gone(own_nats_server, send_path):
    server = own_nats_server()
    before = set(threading.enumerate())
    pub = _publisher(server.url, subject())
    _produce(pub, 0, 10)
    assert pub.flush(5)
    server.stop()
    assert _wait(lambda: not pub.sink._wire.connected)
    _produce(pub, 10, 10)  # cannot go out
    t0 = time.monotonic()
    pub.close(timeout=1.0)
    assert time.monotonic() - t0 < 10  # bounded (generous: the point is it returns)
    assert _wait(lambda: set(threading.enumerate()) <= before, 5), set(threading.enumerate()) - before
    assert pub.metrics()["dropped"] == 20


def test_credentials_from_the_url_and_a_refused_publish_is_reported(own_nats_server, caplog):
    server = own_nats_server('authorization { users = [ {user: "kv", password: "s3cret", '
                        'permissions: {publish: {deny: ["denied.>"]}}} ] }\n')
    url = server.url.replace("nats://", "nats://kv:s3cret@")
    subj = subject()
    with NatsFollower(url, subj, WorkerStates()) as nf:
        pub = _publisher(url, subj)
        _produce(pub, 0, 10)
        assert pub.flush(5) and _caught_up(nf, pub)
        pub.close()
    refused = _publisher(url, "denied.events")
    with caplog.at_level("WARNING", logger="kvstrata.events.natswire"):
        _produce(refused, 0, 10)
        assert refused.flush(5)  # written and read by the server, which dropped the messages
        assert _wait(lambda: refused.sink._wire.server_errors > 0)
    assert "Permissions Violation" in caplog.text and refused.sink._wire.connects == 1
    refused.close()
    wrong = EventPublisher(NatsSink(server.url.replace("nats://", "nats://kv:wrong@"), subject())).start()
    assert _wait(lambda: wrong.sink._wire.last_error is not None)
    assert not wrong.sink._wire.connected and "Authorization" in str(wrong.sink._wire.last_error)
    wrong.close(timeout=0.5)


def test_a_token_in_the_sink_spec_authenticates(own_nats_server):
    """``nats://TOKEN@host:port/subject``: a token alone (no password) is sent as the
    server's auth token, by the sink's own connection and by the spec parser alike."""
    from kvstrata.events import make_publisher

    server = own_nats_server('authorization { token: "s3cret-tok" }\n')
    subj = subject()
    url = server.url.replace("nats://", "nats://s3cret-tok@")
    with NatsFollower(url, subj, WorkerStates()) as nf:
        pub = make_publisher(f"{url}/{subj}", worker_id=7, max_batch=64)
        assert _wait(lambda: pub.sink.connected), "a token-only spec did not connect"
        _produce(pub, 0, 10)
        assert pub.flush(5) and _caught_up(nf, pub)
        pub.close()
