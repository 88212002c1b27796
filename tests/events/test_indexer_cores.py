"""The native indexer core and the native Dynamo parser give the same answers as the pure-Python
reference (the fallback when the extension is not built): random event streams, random and
mutated messages, both paths side by side."""

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.events import formats
from kvstrata.events.indexer import NATIVE_CORE, PrefixIndex, match_response
from kvstrata.events.model import ClearedEvent, EventFormatError, RemovedEvent, StoredBlock, StoredEvent

native = pytest.mark.skipif(NATIVE_CORE is None, reason="native indexer core not built")

TIERS = ("G1", "G2", "G3", "G4")
# small pools: shared prefixes, re-stores, orphans, a child under two parents, cycles
hashes = st.integers(0, 12) | st.sampled_from([0, 2**64 - 1, 2**63])
blocks = st.lists(st.tuples(hashes, st.integers(0, 5)), min_size=1, max_size=6)
events = st.lists(
    st.one_of(
        st.tuples(st.just("stored"), st.integers(0, 2), st.sampled_from(TIERS),
                  st.none() | hashes, blocks),
        st.tuples(st.just("removed"), st.integers(0, 2), st.sampled_from(TIERS),
                  st.lists(hashes, max_size=6)),
        st.tuples(st.just("cleared"), st.integers(0, 2), st.sampled_from(TIERS)),
        st.tuples(st.just("reset"), st.integers(0, 2)),
    ),
    max_size=40,
)
queries = st.lists(st.lists(hashes, max_size=7), min_size=1, max_size=4)


def _apply(idx: PrefixIndex, op) -> None:
    if op[0] == "stored":
        _, w, tier, parent, bl = op
        idx.apply_event(w, StoredEvent(1, tier, parent, 4, tuple(StoredBlock(s, l) for s, l in bl)))
    elif op[0] == "removed":
        idx.apply_event(op[1], RemovedEvent(1, op[2], tuple(op[3])))
    elif op[0] == "cleared":
        idx.apply_event(op[1], ClearedEvent(1, op[2]))
    else:
        idx.reset_worker(op[1])


def _view(idx: PrefixIndex, qs) -> tuple:
    return (
        idx.stats(),
        idx.workers(),
        {(w, t): idx.hashes_in(w, t) for w in range(3) for t in TIERS},
        [idx.match(q) for q in qs],
        [idx.match_local(q) for q in qs],
        [match_response(idx, q) for q in qs],
    )


@native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events, queries)
def test_native_core_answers_as_the_python_core(ops, qs):
    ours, ref = PrefixIndex(native=True), PrefixIndex(native=False)
    assert ours.native and not ref.native
    for op in ops:
        _apply(ours, op)
        _apply(ref, op)
        assert _view(ours, qs) == _view(ref, qs), op
    for idx in (ours, ref):          # nothing outlives the workers that stored it
        for w in range(3):
            idx.reset_worker(w)
        assert idx.stats()["nodes"] == 0, ops


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=native), False])
@pytest.mark.parametrize("chain", [
    [(7, 0, 7)],                                   # a block its own parent
    [(1, 0, 2), (2, 0, 1)],                        # two blocks each other's parent
    [(1, 0, 2), (2, 0, 3), (3, 0, 1)],             # a longer cycle, over three events
])
def test_a_cycle_of_parents_is_not_linked_and_everything_goes_with_its_worker(use_native,
                                                                              chain):
    """Made-up parents that would close a cycle (no real chain has one) are not linked:
    the cycle's nodes would keep each other alive after every worker let go of them."""
    idx = PrefixIndex(native=use_native)
    for seq, local, parent in chain:
        idx.apply_event(1, StoredEvent(1, "G1", parent, 4, (StoredBlock(seq, local),)))
    assert idx.match([chain[-1][0]]) == {1: {"G1": 1}}
    idx.reset_worker(1)
    assert idx.stats()["nodes"] == 0


@native
def test_native_core_on_real_chains_and_at_size():
    rng = random.Random(5)
    ours, ref = PrefixIndex(native=True), PrefixIndex(native=False)
    chains = []
    for c in range(3000):
        base = chains[rng.randrange(len(chains))][: rng.randrange(1, 8)] if chains and rng.random() < 0.5 else []
        chain = base + [(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(rng.randrange(1, 20))]
        chains.append(chain)
        w, tier = rng.randrange(8), rng.choice(TIERS)
        k = len(base)
        ev = StoredEvent(1, tier, chain[k - 1][0] if k else None, 4, tuple(StoredBlock(*b) for b in chain[k:]))
        if k and rng.random() < 0.5:
            ev = StoredEvent(1, tier, None, 4, tuple(StoredBlock(*b) for b in chain))
        for idx in (ours, ref):
            idx.apply_event(w, ev)
        if rng.random() < 0.3:
            victim = rng.choice(chains)
            rm = RemovedEvent(2, rng.choice(TIERS), tuple(s for s, _ in victim[rng.randrange(len(victim)):]))
            w = rng.randrange(8)
            for idx in (ours, ref):
                idx.apply_event(w, rm)
    qs = [[s for s, _ in c] for c in chains] + [[l for _, l in c] for c in chains]
    assert _view(ours, qs) == _view(ref, qs)
    for idx in (ours, ref):
        for w in range(8):
            idx.reset_worker(w)
    assert ours.stats()["nodes"] == ref.stats()["nodes"] == 0


@native
def test_native_core_refuses_hashes_that_are_not_u64_before_changing_anything():
    idx = PrefixIndex(native=True)
    with pytest.raises(ValueError):
        idx.apply_event(1, StoredEvent(1, "G1", None, 4, (StoredBlock(1, 2), StoredBlock(-1, 3))))
    with pytest.raises(ValueError):
        idx.apply_event(1, StoredEvent(1, "G1", 2**64, 4, (StoredBlock(1, 2),)))
    assert idx.stats()["nodes"] == 0 and idx.match([1]) == {}
    assert idx.match([1, "x"]) == {} and idx.match([2**70]) == {}


# -- the Dynamo RouterEvent parser ---------------------------------------------------------


def _reference(data, need_tier=False):
    """What the reference decoder does: (worker_id, event) or the EventFormatError text."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return "not json"
    if need_tier and not (isinstance(obj, dict) and "event" in obj and "storage_tier" in obj):
        return "not dynamo"
    saved = formats.fast_decode_dynamo
    formats.fast_decode_dynamo = None
    try:
        return formats.decode_dynamo(obj)
    except EventFormatError as exc:
        return str(exc)
    finally:
        formats.fast_decode_dynamo = saved


FAST_DECODERS = [d for d in (formats._fast_dynamo_decoder(True), formats._fast_dynamo_decoder(False)) if d]
"""The native parser (when built) and the msgspec decoder (its fallback)."""


def _check(text: str) -> None:
    for data in (text, text.encode("utf-8", "surrogatepass")):
        for need_tier in (False, True):
            for fast_decode in FAST_DECODERS:
                fast = fast_decode(data, need_tier)
                if fast is not None:  # what a fast path accepts, the reference decodes alike
                    assert fast == _reference(data, need_tier), (text, need_tier, fast_decode)


GOOD = [
    '{"worker_id":3,"storage_tier":"device","event":{"event_id":1,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":14643705804678351452,"tokens_hash":14643705804678351452},{"block_hash":4945711292740353085,"tokens_hash":16777012769546811212}]}},"dp_rank":0}}',
    '{"worker_id":3,"storage_tier":"device","event":{"event_id":2,"data":{"removed":{"block_hashes":[4945711292740353085]}},"dp_rank":0}}',
    '{"worker_id":3,"storage_tier":"host_pinned","event":{"event_id":3,"data":"cleared","dp_rank":0}}',
    '{"worker_id":1,"storage_tier":"device","residency_domain":"worker","event":{"event_id":0,"data":{"stored":{"parent_hash":5,"start_position":null,"blocks":[{"block_hash":9,"tokens_hash":9,"mm_extra_info":null}]}},"dp_rank":0}}',
    ' { "event" : { "data" : { "removed" : { "block_hashes" : [ ] } } , "event_id" : 0 } , "worker_id" : 18446744073709551615 } ',
]


@pytest.mark.skipif(formats.fast_decode_dynamo is None, reason="no fast Dynamo decoder")
def test_fast_dynamo_decoder_on_good_messages():
    for text in GOOD:
        for fast_decode in FAST_DECODERS:
            assert fast_decode(text) is not None, text
        _check(text)
    wid, ev = formats.fast_decode_dynamo(GOOD[0])
    assert wid == 3 and ev == StoredEvent(1, "G1", None, 0, (
        StoredBlock(14643705804678351452, 14643705804678351452),
        StoredBlock(4945711292740353085, 16777012769546811212)))
    assert type(ev.blocks[0]) is StoredBlock and ev.blocks[0].token_ids is None
    assert formats.fast_decode_dynamo(GOOD[4], need_tier=True) is None  # no storage_tier
    assert formats.fast_decode_dynamo(GOOD[4]) == (2**64 - 1, RemovedEvent(0, "G1", ()))


BAD = [
    '{"worker_id":-1,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":1.0,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":-0,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":1e2,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":18446744073709551616,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":true,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":1,"worker_id":2,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared"}} x',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared",}}',
    '{"worker_id":1,"event":{"event_id":1,"data":"clear"}}',
    '{"worker_id":1,"event":{"event_id":1,"data":{"stored":null}}}',
    '{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"blocks":[]}}}}',
    '{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"blocks":[{"block_hash":1}]}}}}',
    '{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"blocks":[{"block_hash":1,"tokens_hash":2}]},"removed":{"block_hashes":[1]}}}}',
    '{"worker_id":1,"event":{"event_id":1,"data":{"removed":{"block_hashes":[1,-2]}}}}',
    '{"worker_id":1,"event":{"event_id":1,"data":{}}}',
    '{"worker_id":1,"storage_tier":"gpu","event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":1,"storage_tier":null,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_\\u0069d":1,"event":{"event_id":1,"data":"cleared"}}',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared"},"x":NaN}',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared"},"x":"a\\qb"}',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared"},"x":[1,2,{"a":[true,false,null,-1.5e3]}]}',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared"},"x":"\\ud800 \u00e9"}',
    '{"worker_id":1,"event":{"event_id":1,"data":"cleared"},"x":01}',
    '[1]', '', '{', 'null', '{"worker_id":1}',
]


@pytest.mark.skipif(formats.fast_decode_dynamo is None, reason="no fast Dynamo decoder")
def test_fast_dynamo_decoder_on_odd_messages():
    for text in BAD:
        _check(text)


@pytest.mark.skipif(formats.fast_decode_dynamo is None, reason="no fast Dynamo decoder")
@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(0, 10**6), st.sampled_from(
    list('{}[]",:0123456789-.eE \\tnulrfsa') + ["null", "true", '"x"', "1.5", "-1", "1e5", "99999999999999999999"]))
def test_fast_dynamo_decoder_on_mutated_messages(which, pos, insert):
    text = GOOD[which]
    pos %= len(text) + 1
    for mutated in (text[:pos] + insert + text[pos:], text[:pos] + insert + text[pos + 1:], text[:pos]):
        _check(mutated)


@native
def test_native_core_equals_python_core_after_a_trace_replay():
    """Stores, removals across tiers and reuse of freed records, from a real replay."""
    from kvstrata.config import KvConfig, normalize_tiers
    from kvstrata.events import EventPublisher, StreamFollower
    from kvstrata.events.sinks import CallbackSink
    from kvstrata.replay import load_trace, replay

    ours, ref = PrefixIndex(native=True), PrefixIndex(native=False)
    followers = [StreamFollower(ours), StreamFollower(ref)]
    publisher = EventPublisher(CallbackSink(lambda b: [f.feed_batch(b) for f in followers]), worker_id=11).start()
    config = KvConfig(tiers=normalize_tiers({"G1": 500, "G2": 1500}))
    result = replay(load_trace()[:300], config, granularity="engine", observers=[publisher])
    assert publisher.flush(60)
    publisher.close()
    assert ours.stats() == ref.stats() and ours.stats()["nodes"] > 0
    for tier in TIERS:
        assert ours.hashes_in(11, tier) == ref.hashes_in(11, tier) == result.registry.hashes_in(tier)
    for seqs_ in [sorted(ours.hashes_in(11, "G2"))[:k] for k in (1, 5, 50)]:
        assert ours.match(seqs_) == ref.match(seqs_)
