import random
import threading

from kvstrata.events import EventPublisher, StreamFollower, TierState, WorkerStates
from kvstrata.events.model import EventBatch, PublisherIdentity, RemovedEvent, stored_event
from kvstrata.events.sinks import CallbackSink
from kvstrata.logical.registry import BlockRegistry

from .helpers import chain, random_ops, registry_state

ID = PublisherIdentity(1, 5, 0.0)


def _events(n):
    c = chain(1, n)
    return [stored_event(i + 1, "G1", [r], 0.0) for i, r in enumerate(c)], c


def test_in_order_duplicates_dropped():
    target = WorkerStates()
    f = StreamFollower(target, snapshots=False)
    evs, c = _events(4)
    f.feed_batch(EventBatch(ID, evs[:3]))
    f.feed_batch(EventBatch(ID, evs[1:]))  # 2, 3 again then 4
    assert f.duplicates == 2 and f.applied == 4 and f.gaps == 0
    assert target.hashes(5)["G1"] == {r.sequence_hash for r in c}


def test_gap_triggers_sync_and_snapshot_heals():
    reg = BlockRegistry()
    got = []
    pub = EventPublisher(CallbackSink(got.append), max_delay=0).start()
    reg.add_observer(pub)
    reg.record_stored("G1", chain(1, 3))
    reg.record_stored("G2", chain(2, 2))
    reg.record_removed("G1", [next(iter(reg.hashes_in("G1")))])
    pub.flush(2)
    target = WorkerStates()
    f = StreamFollower(target)
    events = [e for b in got for e in b.events]
    f.feed(pub.identity.worker_id, pub.identity.publisher_id, events[:1])
    f.feed(pub.identity.worker_id, pub.identity.publisher_id, events[2:])  # event 2 lost
    assert f.gaps == 1 and f.pending_snapshots() == [pub.identity.worker_id]
    f.apply_snapshot(pub.snapshot())
    assert f.pending_snapshots() == []
    assert target.hashes(pub.identity.worker_id) == registry_state(reg)
    pub.close()


def test_restart_resets_worker_state():
    target = WorkerStates()
    f = StreamFollower(target)
    evs, c = _events(2)
    f.feed_batch(EventBatch(ID, evs))
    restarted = PublisherIdentity(2, 5, 1.0)
    other = chain(9, 1)
    f.feed_batch(EventBatch(restarted, [stored_event(1, "G2", other, 0.0)]))
    assert f.restarts == 1
    assert target.hashes(5) == {"G1": set(), "G2": {other[0].sequence_hash}, "G3": set(), "G4": set()}


def test_late_join_mid_stream_without_snapshot_source_gives_up_best_effort():
    target = WorkerStates()
    f = StreamFollower(target)
    evs, c = _events(5)
    f.feed_batch(EventBatch(ID, evs[2:]))
    assert f.pending_snapshots() == [5]
    f.give_up_sync(5)
    assert target.hashes(5)["G1"] == {r.sequence_hash for r in c[2:]}


def test_in_process_late_joiner_snapshot_plus_stream_equals_live_state():
    reg = BlockRegistry()
    followers = []
    lock = threading.Lock()

    def fan_out(batch):
        with lock:
            for f in followers:
                f.feed_batch(batch)

    pub = EventPublisher(CallbackSink(fan_out), max_batch=16, max_delay=0.001).start()
    reg.add_observer(pub)
    rng = random.Random(3)
    random_ops(reg, rng, 300)
    stop = threading.Event()

    def producer():
        while not stop.is_set():
            random_ops(reg, rng, 20)

    t = threading.Thread(target=producer)
    t.start()
    target = WorkerStates()
    follower = StreamFollower(target)
    follower.expect_snapshot(pub.identity.worker_id)
    with lock:  # subscribe first (buffering), then fetch the snapshot
        followers.append(follower)
    follower.apply_snapshot(pub.snapshot())
    stop.set()
    t.join()
    assert pub.flush(5)
    assert follower.gaps == 0 and follower.pending_snapshots() == []
    assert target.hashes(pub.identity.worker_id) == registry_state(reg)
    pub.close()
