"""The event plane against a real nats-server."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from kvstrata.events import EventPublisher, WorkerStates, make_publisher
from kvstrata.events.indexer import PrefixIndex
from kvstrata.events.natsserver import free_port
from kvstrata.events.sinks import CallbackSink, NatsSink, NullSink
from kvstrata.events.subscriber import NatsFollower
from kvstrata.logical.registry import BlockRegistry

from kvstrata.events.testing import chain, random_ops, registry_state

pytestmark = pytest.mark.integration


def subject() -> str:
    return f"kvtest.{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["1", "0"], ids=["direct", "nats-py"])
def direct(request):
    """Core NATS tests run on the sink's own publishing connection and through nats-py."""
    return request.param


def test_events_arrive_complete_and_in_order(nats_server, direct):
    subj = subject()
    seen = []
    target = WorkerStates()
    with NatsFollower(nats_server.url, subj, target, on_batch=seen.append) as nf:
        pub = make_publisher(f"{nats_server.url}/{subj}?direct={direct}", max_batch=64, worker_id=1)
        assert nf.wait_for(lambda: pub.sink.connected, 5)
        reg = BlockRegistry()
        reg.add_observer(pub)
        random_ops(reg, random.Random(1), 2000)
        assert pub.flush(10)
        last = pub.last_event_id
        assert nf.wait_for(lambda: nf.follower.last_event_id(1) == last, 10)
        stats = nf.follower.stats()
        assert stats["gaps"] == 0 and stats["duplicates"] == 0 and stats["applied"] == last
        assert target.hashes(1) == registry_state(reg)
        assert pub.metrics()["dropped"] == 0
        pub.close()


def test_dynamo_format_over_nats(nats_server, direct):
    subj = subject()
    target = WorkerStates()
    with NatsFollower(nats_server.url, subj, target, format="dynamo") as nf:
        pub = make_publisher(f"{nats_server.url}/{subj}?format=dynamo&direct={direct}", worker_id=77)
        assert nf.wait_for(lambda: pub.sink.connected, 5)
        reg = BlockRegistry()
        reg.add_observer(pub)
        random_ops(reg, random.Random(2), 300)
        assert pub.flush(10)
        assert nf.wait_for(lambda: nf.follower.last_event_id(77) == pub.last_event_id, 10)
        assert target.hashes(77) == registry_state(reg)
        pub.close()


def test_late_joiner_snapshot_plus_stream_equals_live_state(nats_server, direct):
    subj = subject()
    reg = BlockRegistry()
    pub = make_publisher(f"{nats_server.url}/{subj}?direct={direct}", max_batch=32, max_delay=0.002, worker_id=5)
    reg.add_observer(pub)
    rng = random.Random(3)
    random_ops(reg, rng, 500)  # history the late joiner never sees live
    assert pub.flush(10)
    stop = threading.Event()
    lock = threading.Lock()  # the registry is single-owner: one thread drives it at a time

    def producer():
        while not stop.is_set():
            with lock:
                random_ops(reg, rng, 10)
            time.sleep(0.001)

    t = threading.Thread(target=producer)
    t.start()
    try:
        index = PrefixIndex()
        with NatsFollower(nats_server.url, subj, index) as nf:
            time.sleep(0.05)
            # either the first live event (id > 1) triggers a per-worker snapshot, or discovery does
            nf.discover(0.3)
            time.sleep(0.2)
            stop.set()
            t.join()
            assert pub.flush(10)
            last = pub.last_event_id
            assert nf.wait_for(lambda: nf.follower.last_event_id(5) == last, 10)
            stats = nf.follower.stats()
            assert stats["snapshots_applied"] >= 1
            for tier, hashes in registry_state(reg).items():
                assert index.hashes_in(5, tier) == hashes, tier
    finally:
        stop.set()
        t.join()
        pub.close()


def test_jetstream_nothing_lost_across_server_restart(nats_server):
    subj = subject()
    reg = BlockRegistry()
    pub = make_publisher(f"{nats_server.url}/{subj}?jetstream=1", max_batch=16, worker_id=9)
    deadline = time.monotonic() + 5
    while not pub.sink.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    reg.add_observer(pub)
    rng = random.Random(4)
    random_ops(reg, rng, 300)
    assert pub.flush(10)
    before = pub.last_event_id
    nats_server.restart()
    random_ops(reg, rng, 300)  # produced while the client reconnects: buffered and retried
    assert pub.flush(20), pub.metrics()
    m = pub.metrics()
    assert m["dropped"] == 0 and m["published"] == m["enqueued"] and pub.last_event_id > before
    # a consumer starting now replays the whole stream from JetStream storage
    target = WorkerStates()
    with NatsFollower(nats_server.url, subj, target, jetstream=True) as nf:
        assert nf.wait_for(lambda: nf.follower.last_event_id(9) == pub.last_event_id, 10), nf.follower.stats()
        assert nf.follower.stats()["gaps"] == 0
        assert target.hashes(9) == registry_state(reg)
    pub.close()


def _loop(reg, n):
    t0 = time.perf_counter()
    for s in range(n):
        c = chain(s, 2)
        reg.record_stored("G1", c)
        reg.record_removed("G1", [c[1].sequence_hash])
    return time.perf_counter() - t0


@pytest.mark.parametrize("kind", ["nats-nothing-listening", "blocking-callback"])
def test_dead_sink_never_blocks_the_caller(kind, capsys):
    n = 5000
    base_reg = BlockRegistry()
    base_pub = EventPublisher(NullSink(), buffer_events=1024).start()
    base_reg.add_observer(base_pub)
    base = _loop(base_reg, n)
    base_pub.close()

    release = threading.Event()
    if kind == "nats-nothing-listening":
        sink = NatsSink(f"nats://127.0.0.1:{free_port()}", "dead.subject")
    else:
        sink = CallbackSink(lambda batch: release.wait())
    pub = EventPublisher(sink, buffer_events=1024, max_batch=64).start()
    reg = BlockRegistry()
    reg.add_observer(pub)
    dead = _loop(reg, n)
    m = pub.metrics()
    with capsys.disabled():
        print(f"\n[{kind}] {2 * n} registry updates: {base * 1e3:.1f} ms with a null sink, "
              f"{dead * 1e3:.1f} ms with a dead sink (x{dead / base:.2f}); dropped={m['dropped']}")
    assert m["dropped"] > 0 and m["lag"] <= 1024 + 64   # the buffer and the batch in the sink
    release.set()
    pub.close(timeout=1.0)
