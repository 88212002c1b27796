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


# -- issue 27, finding 5: no single event makes the follower drop later real events ----------

def _forged(event_id, hashes):
    return stored_event(event_id, "G1", chain(hashes, 1), 0.0)


class _Live:
    """A registry publishing through a callback, and a snapshot-mode follower that has
    applied everything published so far."""

    def __init__(self, blocks: int) -> None:
        self.reg = BlockRegistry()
        self.got = []
        self.pub = EventPublisher(CallbackSink(self.got.append), max_delay=0).start()
        self.reg.add_observer(self.pub)
        self.target = WorkerStates()
        self.follower = StreamFollower(self.target)
        self.wid, self.pid = self.pub.identity.worker_id, self.pub.identity.publisher_id
        self.store(1, blocks)

    def store(self, seed: int, blocks: int) -> None:
        """Store a chain and feed the follower the events it makes."""
        self.got.clear()
        self.reg.record_stored("G1", chain(seed, blocks))
        self.pub.flush(2)
        self.follower.feed(self.wid, self.pid, [e for b in self.got for e in b.events])


def test_a_forged_far_ahead_id_does_not_turn_later_real_events_into_duplicates():
    """Best effort (a file, or no snapshot to be had): an event with id 2^64-1 used to set
    the worker's last id, and every real event after it was dropped as a duplicate."""
    target = WorkerStates()
    f = StreamFollower(target, snapshots=False)
    evs, c = _events(6)
    f.feed_batch(EventBatch(ID, evs[:2]))
    f.feed_batch(EventBatch(ID, [_forged(2**64 - 1, 77)]))
    f.feed_batch(EventBatch(ID, evs[2:]))
    assert f.duplicates == 0 and f.applied == 7
    assert {r.sequence_hash for r in c} <= target.hashes(5)["G1"]
    assert f.last_event_id(5) == 6                    # the unbroken run, not the forged id
    f.feed_batch(EventBatch(ID, evs[3:5]))            # real repeats are still duplicates
    assert f.duplicates == 2


def test_ordinary_gaps_move_the_stream_on_and_far_jumps_are_capped():
    """Best effort: a gap of a few ids (the publisher dropped them) moves the stream past
    it as before; ids far past the stream are kept apart, at most MAX_AHEAD of them."""
    from kvstrata.events import subscriber

    f = StreamFollower(WorkerStates(), snapshots=False)
    evs, _ = _events(1)
    f.feed_batch(EventBatch(ID, evs))
    f.feed_batch(EventBatch(ID, [stored_event(10, "G1", chain(100, 1), 0.0)]))
    assert f.last_event_id(5) == 10 and f.gaps == 1 and not f.workers[5].ahead
    far = [stored_event(10 + 2 * subscriber.MAX_JUMP + i, "G1", chain(200 + i, 1), 0.0)
           for i in range(subscriber.MAX_AHEAD + 1)]
    f.feed_batch(EventBatch(ID, far))
    assert len(f.workers[5].ahead) <= subscriber.MAX_AHEAD


def test_best_effort_late_join_and_restart_of_a_dynamo_stream():
    """A stream joined at id 1001 (no publisher id, as Dynamo's) takes earlier ids as
    history, and a restart (id 1 again) resets the worker."""
    target = WorkerStates()
    f = StreamFollower(target, snapshots=False)
    late = [stored_event(1001 + i, "G1", chain(300 + i, 1), 0.0) for i in range(20)]
    f.feed(5, None, late)
    assert f.last_event_id(5) == 1020 and f.gaps == 1
    again = [stored_event(1 + i, "G1", chain(400 + i, 1), 0.0) for i in range(3)]
    f.feed(5, None, again)
    assert f.restarts == 1 and len(target.hashes(5)["G1"]) == 3


def test_an_event_replayed_with_other_contents_is_a_conflict_and_resyncs_from_the_snapshot():
    """A forged ``cleared`` (or anything) sent with the next id used to be applied, and the
    real event with that id then dropped as a duplicate. Now the second, different event
    with one id is a conflict: the follower re-syncs the worker from its own snapshot."""
    from kvstrata.events.model import ClearedEvent

    live = _Live(3)
    f, wid = live.follower, live.wid
    f.feed(wid, live.pid, [ClearedEvent(f.last_event_id(wid) + 1, "G1")])   # forged, first
    assert live.target.hashes(wid)["G1"] == set()
    live.store(2, 1)                                     # the real event with that id
    assert f.conflicts == 1 and f.pending_snapshots() == [wid]
    f.apply_snapshot(live.pub.snapshot())
    assert live.target.hashes(wid) == registry_state(live.reg)
    live.pub.close()


def test_a_forged_gap_costs_one_snapshot_and_then_nothing():
    """A made-up id past a gap starts a re-sync; after the snapshot it is dropped, not
    buffered into another re-sync."""
    live = _Live(2)
    f, wid = live.follower, live.wid
    f.feed(wid, live.pid, [_forged(2**64 - 1, 55)])
    assert f.pending_snapshots() == [wid]
    f.apply_snapshot(live.pub.snapshot())
    assert f.pending_snapshots() == [] and f.snapshots_applied == 1
    live.store(3, 1)
    assert f.pending_snapshots() == [] and f.duplicates == 0
    assert live.target.hashes(wid) == registry_state(live.reg)
    live.pub.close()


def test_a_snapshot_of_an_untrusted_worker_is_not_applied():
    target = WorkerStates()
    f = StreamFollower(target, trusted_workers=[5])
    from kvstrata.events.model import Snapshot

    f.apply_snapshot(Snapshot(PublisherIdentity(3, 666, 0.0), 7,
                              [stored_event(1, "G1", chain(5, 1), 0.0)]))
    assert f.untrusted == 1 and 666 not in f.workers
