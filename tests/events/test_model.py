from kvstrata.events.model import (
    ClearedEvent,
    PublisherIdentity,
    RemovedEvent,
    TierState,
    split_chains,
    stored_event,
)
from kvstrata.logical.registry import BlockRecord

from .helpers import chain


def test_split_chains_breaks_on_parent_and_block_size():
    a = chain(1, 3)
    b = chain(2, 2)
    odd = [BlockRecord(99, 98, b[-1].sequence_hash, 32)]
    runs = list(split_chains(a + b + odd))
    assert [len(r) for r in runs] == [3, 2, 1]
    assert runs[0][0].parent_hash is None and runs[2][0].block_size == 32


def test_stored_event_round_trips_records():
    c = chain(3, 4, tokens=True)
    ev = stored_event(7, "G2", c, 1.0)
    assert ev.parent_hash is None and ev.block_size == 16 and ev.event_id == 7
    assert ev.records() == c


def test_tier_state_replay_and_snapshot_events():
    c = chain(4, 5)
    st = TierState().apply_all(
        [stored_event(1, "G1", c, 0), RemovedEvent(2, "G1", (c[4].sequence_hash,)), stored_event(3, "G2", c[:2], 0)]
    )
    assert st.hashes()["G1"] == {r.sequence_hash for r in c[:4]}
    snap = st.snapshot_events(3)
    again = TierState().apply_all(snap)
    assert again.hashes() == st.hashes()
    assert all(e.event_id == 3 for e in snap)
    st.apply(ClearedEvent(4, "G1"))
    assert st.hashes()["G1"] == set()


def test_identity_changes_per_instance():
    a, b = PublisherIdentity.new(5), PublisherIdentity.new(5)
    assert a.worker_id == b.worker_id == 5 and a.publisher_id != b.publisher_id
