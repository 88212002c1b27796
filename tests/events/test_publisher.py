import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.events import EventPublisher, SinkUnavailableError, TierState, make_publisher
from kvstrata.events.model import ClearedEvent, RemovedEvent, StoredEvent
from kvstrata.events.sinks import CallbackSink, MemorySink
from kvstrata.events.publisher import Sink
from kvstrata.logical.registry import BlockRegistry

from .helpers import CountingCondition, chain, random_ops, registry_state
from .native import native_or_python


@pytest.fixture(autouse=True, params=["native", "python"])
def _native_or_python(request, monkeypatch):
    """Every test here runs with the native fast paths (when built) and without them."""
    return native_or_python(request, monkeypatch)


def _setup(**kw):
    reg = BlockRegistry()
    pub = EventPublisher(MemorySink(), **kw).start()
    reg.add_observer(pub)
    return reg, pub


def test_one_event_per_change_in_order():
    reg, pub = _setup()
    a, b = chain(1, 3), chain(2, 2)
    reg.record_stored("G1", a + b)
    reg.record_stored("G1", a[:1])  # already held: no event
    reg.record_stored("G2", a[:2])
    reg.record_removed("G1", [a[2].sequence_hash, 12345])  # unknown hash ignored
    reg.record_removed("G1", [a[2].sequence_hash])  # already gone: no event
    reg.record_cleared("G2", [r.sequence_hash for r in a[:2]])
    assert pub.flush(2)
    events = pub.sink.events
    assert [e.event_id for e in events] == [1, 2, 3, 4, 5]
    assert [type(e) for e in events] == [StoredEvent, StoredEvent, StoredEvent, RemovedEvent, ClearedEvent]
    assert events[0].block_hashes == [r.sequence_hash for r in a] and events[1].parent_hash is None
    assert events[3].block_hashes == (a[2].sequence_hash,)
    assert set(events[4].block_hashes) == {r.sequence_hash for r in a[:2]}
    assert TierState().apply_all(events).hashes() == registry_state(reg)
    pub.close()


def test_batches_by_count():
    reg, pub = _setup(max_batch=4, max_delay=10.0)
    for s in range(8):
        reg.record_stored("G1", chain(s, 1))
    deadline = time.monotonic() + 2
    while pub.metrics()["published"] < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    sizes = [len(b.events) for b in pub.sink.batches]
    assert sizes == [4, 4], sizes  # full batches went out without waiting for the 10 s window
    pub.close()


def test_a_backlog_still_wakes_the_sender_at_every_whole_batch():
    pub = EventPublisher(MemorySink(), max_batch=4)  # not started: everything stays buffered
    pub._cond = CountingCondition(pub._lock)
    for s in range(6):
        c = chain(s, 2)
        pub.on_tier_stored("G1", c)
        pub.on_tier_removed("G1", [c[1].sequence_hash])
    assert len(pub._buffer) == 12 and pub._cond.notified == 4  # at 1, 4, 8 and 12 items


def test_batches_by_time_window():
    reg, pub = _setup(max_batch=1000, max_delay=0.05)
    reg.record_stored("G1", chain(1, 1))
    t0 = time.monotonic()
    deadline = t0 + 2
    while not pub.sink.batches and time.monotonic() < deadline:
        time.sleep(0.002)
    waited = time.monotonic() - t0
    assert pub.sink.batches and len(pub.sink.batches[0].events) == 1
    assert waited >= 0.03  # held for the window (loose: only checks it did not go out at once)
    pub.close()


def test_flush_does_not_wait_for_the_window():
    reg, pub = _setup(max_batch=1000, max_delay=30.0)
    reg.record_stored("G1", chain(1, 2))
    t0 = time.monotonic()
    assert pub.flush(5)
    assert time.monotonic() - t0 < 5
    assert len(pub.sink.events) == 1
    pub.close()


def test_blocking_sink_never_blocks_caller_and_counts_drops():
    release = threading.Event()
    reg = BlockRegistry()
    pub = EventPublisher(CallbackSink(lambda b: release.wait()), max_batch=8, buffer_events=64).start()
    reg.add_observer(pub)
    t0 = time.monotonic()
    for s in range(2000):
        reg.record_stored("G1", chain(s, 1))
    elapsed = time.monotonic() - t0
    m = pub.metrics()
    # lag: the buffer and the batch the sink holds
    assert m["dropped"] > 0 and m["lag"] <= 64 + 8 and m["enqueued"] == 2000
    assert elapsed < 30  # generous; the point is the loop finished while the sink is stuck
    release.set()
    assert pub.flush(5)
    m = pub.metrics()
    assert m["published"] + m["dropped"] == 2000
    # the shadow is complete regardless of drops, so a snapshot can heal the gap
    assert pub.state()["G1"] == reg.hashes_in("G1")
    pub.close()


class _Flaky(Sink):
    kind = "flaky"

    def __init__(self, failures):
        self.failures = failures
        self.batches = []

    def send(self, batch):
        if self.failures > 0:
            self.failures -= 1
            raise SinkUnavailableError("down")
        self.batches.append(batch)


def test_unavailable_sink_is_retried_without_loss():
    sink = _Flaky(3)
    reg = BlockRegistry()
    pub = EventPublisher(sink, retry_backoff=(0.001, 0.01)).start()
    reg.add_observer(pub)
    reg.record_stored("G1", chain(1, 3))
    assert pub.flush(5)
    m = pub.metrics()
    assert m["sink_errors"] == 3 and m["published"] == 1 and m["dropped"] == 0
    pub.close()


def test_broken_sink_drops_batch_and_continues():
    calls = []

    def boom(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise ValueError("bug")

    reg = BlockRegistry()
    pub = EventPublisher(CallbackSink(boom), max_delay=0).start()
    reg.add_observer(pub)
    reg.record_stored("G1", chain(1, 1))
    assert pub.flush(2)
    reg.record_stored("G1", chain(2, 1))
    assert pub.flush(2)
    m = pub.metrics()
    assert m["dropped"] == 1 and m["published"] == 1 and m["sink_errors"] == 1
    pub.close()


def test_close_counts_undelivered_and_rejects_after_close():
    release = threading.Event()
    reg = BlockRegistry()
    pub = EventPublisher(CallbackSink(lambda b: release.wait()), max_batch=1, buffer_events=16).start()
    reg.add_observer(pub)
    for s in range(10):
        reg.record_stored("G1", chain(s, 1))
    pub.close(timeout=0.2)
    m = pub.metrics()
    assert m["lag"] == 0 and m["dropped"] >= 8
    reg.record_stored("G1", chain(99, 1))  # after close: dropped, never blocks
    assert pub.metrics()["dropped"] >= 9
    release.set()


def test_validation_errors():
    with pytest.raises(ValueError, match="max_batch"):
        EventPublisher(MemorySink(), max_batch=0)
    with pytest.raises(ValueError, match="buffer_events"):
        EventPublisher(MemorySink(), max_batch=10, buffer_events=5)
    with pytest.raises(ValueError, match="worker_id"):
        EventPublisher(MemorySink(), worker_id=-1)


def test_keep_tokens_false_strips_tokens():
    reg = BlockRegistry()
    pub = EventPublisher(MemorySink(), keep_tokens=False).start()
    reg.add_observer(pub)
    reg.record_stored("G1", chain(1, 2, tokens=True))
    pub.flush(2)
    assert all(b.token_ids is None for b in pub.sink.events[0].blocks)
    pub.close()


def test_snapshot_is_consistent_with_its_event_id_under_concurrency():
    reg = BlockRegistry()
    pub = EventPublisher(MemorySink(), max_delay=0.001).start()
    reg.add_observer(pub)
    stop = threading.Event()

    def producer():
        rng = random.Random(7)
        while not stop.is_set():
            random_ops(reg, rng, 50)

    t = threading.Thread(target=producer)
    t.start()
    snaps = []
    for _ in range(20):
        time.sleep(0.005)
        snaps.append(pub.snapshot())
    stop.set()
    t.join()
    assert pub.flush(5)
    events = pub.sink.events
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    for snap in snaps:
        base = TierState().apply_all(snap.events)
        later = [e for e in events if e.event_id > snap.last_event_id]
        assert base.apply_all(later).hashes() == registry_state(reg)
    pub.close()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 120))
def test_replaying_events_reaches_registry_state(seed, steps):
    reg = BlockRegistry()
    sink = MemorySink()
    pub = EventPublisher(sink, max_delay=0).start()
    reg.add_observer(pub)
    random_ops(reg, random.Random(seed), steps)
    assert pub.flush(5)
    assert TierState().apply_all(sink.events).hashes() == registry_state(reg)
    pub.close()


def test_metrics_and_prometheus_collector():
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvstrata.events.metrics import register_publisher

    reg, pub = _setup(worker_id=42)
    reg.record_stored("G1", chain(1, 2))
    pub.flush(2)
    registry = prometheus_client.CollectorRegistry()
    register_publisher(pub, registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvstrata_events_published_total{sink="callback",worker_id="42"} 1.0' in text
    assert "kvstrata_events_dropped_total" in text and "kvstrata_events_lag_seconds" in text
    assert registry.get_sample_value("kvstrata_events_enqueued_total", {"worker_id": "42", "sink": "callback"}) == 1
    pub.close()


def test_make_publisher_none_still_snapshots():
    reg = BlockRegistry()
    pub = make_publisher("none")
    reg.add_observer(pub)
    reg.record_stored("G3", chain(1, 3))
    assert pub.flush(2)
    snap = pub.snapshot()
    assert snap.last_event_id == 1 and TierState().apply_all(snap.events).hashes()["G3"] == reg.hashes_in("G3")
    pub.close()


# -- seeding a publisher attached late ----------------------------------------------------------
def _tier_records(pool_like: dict[str, list]) -> dict[str, set[int]]:
    return {t: {r.sequence_hash for r in recs} for t, recs in pool_like.items()}


def test_seed_publishes_what_pools_already_hold():
    reg = BlockRegistry()
    a, b = chain(1, 5, tokens=True), chain(2, 3, parent=None)
    fork = chain(3, 2, parent=a[1].sequence_hash)  # shares a's first two blocks
    held = {"G1": a + fork, "G2": b + a[:2]}
    for tier, recs in held.items():
        reg.record_stored(tier, recs)  # before the publisher exists: it sees none of this
    sink = MemorySink()
    pub = EventPublisher(sink, max_delay=0).start()
    reg.add_observer(pub)
    assert pub.state()["G1"] == set()
    # children first and shuffled: seed groups them back into parent-linked runs
    shuffled = list(reversed(held["G1"]))
    n1 = pub.seed("G1", shuffled)
    n2 = pub.seed("G2", held["G2"])
    assert n1 == 2 and n2 == 2  # a (5) + fork (2); b (3) + a[:2] (2)
    assert pub.seed("G1", held["G1"]) == 0  # idempotent
    reg.record_stored("G1", chain(4, 2))  # live changes continue the id sequence
    reg.record_removed("G2", [b[2].sequence_hash])
    assert pub.flush(2)
    events = sink.events
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    assert TierState().apply_all(events).hashes() == registry_state(reg)
    assert pub.state() == registry_state(reg)
    first, second = events[0], events[1]
    assert isinstance(first, StoredEvent) and first.parent_hash is None
    assert first.block_hashes[:2] == [r.sequence_hash for r in a[:2]]  # the root run comes first
    assert second.parent_hash == a[1].sequence_hash  # the other branch, after its parent
    assert set(first.block_hashes + second.block_hashes) == {r.sequence_hash for r in a + fork}
    assert first.blocks[0].token_ids == a[0].token_ids  # tokens kept
    snap = pub.snapshot()
    assert TierState().apply_all(snap.events).hashes() == registry_state(reg)
    pub.close()


def test_seed_rejects_unknown_tier_and_accepts_empty():
    pub = EventPublisher(MemorySink())
    with pytest.raises(ValueError, match="unknown tier"):
        pub.seed("G9", chain(1, 1))
    assert pub.seed("G1", []) == 0 and pub.last_event_id == 0


def test_seed_larger_than_the_buffer_drops_events_but_the_snapshot_heals():
    release = threading.Event()
    pub = EventPublisher(CallbackSink(lambda b: release.wait()), max_batch=4, buffer_events=8).start()
    records = [r for s in range(40) for r in chain(s, 3)]
    assert pub.seed("G3", records) == 40
    m = pub.metrics()
    assert m["dropped"] > 0 and m["lag"] <= 8 and pub.last_event_id == 40
    snap = pub.snapshot()
    assert snap.last_event_id == 40
    assert TierState().apply_all(snap.events).hashes()["G3"] == {r.sequence_hash for r in records}
    release.set()
    pub.close()


# -- shadow log compaction and timestamps -------------------------------------------------------
@pytest.mark.parametrize("where", ["background", "inline"])
def test_shadow_log_compaction_keeps_snapshots_exact(where, monkeypatch):
    from kvstrata.events import publisher as publisher_mod

    if where == "background":
        monkeypatch.setattr(publisher_mod, "COMPACT_SLACK", 8)
        monkeypatch.setattr(publisher_mod, "COMPACT_STEP", 3)
        reg, pub = _setup(max_delay=0)
    else:
        monkeypatch.setattr(publisher_mod, "HARD_SLACK", 8)
        reg = BlockRegistry()
        pub = EventPublisher(MemorySink())  # never started: only the hooks can compact
        reg.add_observer(pub)
    rng = random.Random(11)
    pool = [chain(s, 6) for s in range(30)]

    def churn(steps):  # stores and removals, no clears (a clear empties the log by itself)
        for _ in range(steps):
            tier = rng.choice(("G1", "G2"))
            if rng.random() < 0.5:
                c = rng.choice(pool)
                start = rng.randrange(len(c))
                reg.record_stored(tier, c[start : start + rng.randrange(1, 4)])
            else:
                held = sorted(reg.hashes_in(tier))
                if held:
                    reg.record_removed(tier, rng.sample(held, min(rng.randrange(1, 4), len(held))))

    for step in range(40):
        churn(25)
        if where == "background":
            assert pub.flush(5)
        snap = pub.snapshot()
        assert TierState().apply_all(snap.events).hashes() == registry_state(reg), step
        for sh in pub._tiers.values():  # the log never loses a held hash
            logged = {h for item in sh.log for h in item[7 : 7 + ((len(item) - 7) >> 1)]}
            assert sh.held <= logged
    assert pub.compactions > 0
    if where == "background":
        assert TierState().apply_all(pub.sink.events).hashes() == registry_state(reg)
    pub.close()


def test_events_of_one_millisecond_share_one_timestamp(monkeypatch):
    import kvstrata.events.publisher as publisher_module

    clock = iter(1_000_000.0 + 0.0004 * i for i in range(10_000))  # 0.4 ms per call
    monkeypatch.setattr(publisher_module.time, "time", lambda: next(clock))
    reg, pub = _setup()
    for s in range(20):
        reg.record_stored("G1", chain(s, 1))
    assert pub.flush(2)
    stamps = [e.ts for e in pub.sink.events]
    assert stamps == sorted(stamps) and abs(stamps[-1] - 1_000_000.0) < 1
    # Stamps less than 1 ms apart are shared: fewer distinct values than events, but the
    # clock still advances (not one value for all 20 events, 8 ms apart end to end).
    assert 1 < len(set(stamps)) < len(stamps)
    pub.close()


def test_seed_from_real_pools_then_live_changes():
    from kvstrata.logical.pool import BlockPool

    reg = BlockRegistry()
    pools = {t: BlockPool(t, n, 16, registry=reg, keep_tokens=True) for t, n in (("G1", 8), ("G2", 32))}

    def put(tier, records):
        pool = pools[tier]
        new = [r for r in records if r.sequence_hash not in pool]
        handle = pool.allocate(len(new))
        handle.apply_token_blocks(new)
        pool.release(pool.register(handle))

    a, b = chain(1, 6, tokens=True), chain(2, 5, tokens=True)
    put("G2", a + b)
    put("G1", a[:4])
    sink = MemorySink()
    pub = EventPublisher(sink, max_delay=0).start()
    reg.add_observer(pub)
    for tier, pool in pools.items():
        # the pool's registered blocks, through public calls only
        records = [pool.lookup(h).record(pool.keep_tokens) for h in reg.hashes_in(tier)]
        pub.seed(tier, records)
    put("G1", b)  # evicts from G1 (8 slots): live removed + stored events follow the seed
    assert pub.flush(2)
    events = sink.events
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    assert TierState().apply_all(events).hashes() == registry_state(reg)
    assert sum(len(e.blocks) for e in events[:3] if isinstance(e, StoredEvent)) == 4 + 11  # seeded
    assert events[0].blocks[0].token_ids is not None
    pub.close()
