"""The ``predicted-reuse`` admission filter: it learns which kinds of block return."""

import random

import pytest

from kvstrata.config import KvConfig, TierConfig
from kvstrata.logical.admission import PolicyError
from kvstrata.logical.policy import make_tier_policies
from kvstrata.logical.reuse_prediction import (
    SAMPLE,
    THRESHOLD,
    PredictedReuseAdmission,
    RecentHashes,
    _mixed,
)
from kvstrata.replay import TraceRequest, replay


def _sampled(h):
    return (_mixed(h) >> 20) % SAMPLE == 0


class _Workload:
    """Conversations that come back (a few new blocks a turn) between one-off documents
    (many new blocks, never seen again), each request ending in a block of its own."""

    def __init__(self, seed=1):
        self.rng = random.Random(seed)
        self.open = []

    def fresh(self, n):
        return [self.rng.getrandbits(64) for _ in range(n)]

    def requests(self, count):
        for _ in range(count):
            if self.open and self.rng.random() < 0.5:
                chain = self.open.pop(self.rng.randrange(len(self.open)))
                chain = chain + self.fresh(2)
            elif self.rng.random() < 0.5:
                yield self.fresh(40) + self.fresh(1)            # a document, then its tail
                continue
            else:
                chain = self.fresh(3)
            if len(chain) < 12:
                self.open.append(chain)
            yield chain + self.fresh(1)                          # the turn's own last block


def _serve(admission, requests):
    """Show and offer each request's blocks; what was refused, per kind of block."""
    offered = {"document": [0, 0], "conversation": [0, 0], "tail": [0, 0]}
    seen = set()
    for hashes in requests:
        admission.observe_request(hashes)
        kind = "document" if len(hashes) == 41 else "conversation"
        for i, h in enumerate(hashes):
            if h in seen:
                continue
            seen.add(h)
            who = "tail" if i == len(hashes) - 1 else kind
            offered[who][0] += 1
            offered[who][1] += not admission.admit(h)
    return {k: refused / max(1, n) for k, (n, refused) in offered.items()}


def test_refuses_kinds_that_do_not_return_and_admits_those_that_do():
    admission = PredictedReuseAdmission(capacity=2000)
    work = _Workload()
    _serve(admission, work.requests(3000))                     # learn
    refused = _serve(admission, work.requests(1000))           # then decide
    assert refused["document"] > 0.8
    assert refused["tail"] > 0.8
    assert refused["conversation"] < 0.1     # only turns that came back too late to count
    assert admission.reuse_rate(last=False, new_blocks=40, continues=False) < THRESHOLD
    assert admission.reuse_rate(last=False, new_blocks=2, continues=True) > 2 * THRESHOLD


def test_a_refused_kind_is_still_followed_and_its_last_block_goes_with_it():
    admission = PredictedReuseAdmission(capacity=2000)
    work = _Workload()
    _serve(admission, work.requests(3000))
    document = work.fresh(40) + work.fresh(1)
    admission.observe_request(document)
    decisions = [admission.admit(h) for h in document]
    assert not any(decisions)                  # the tail too: alone it could never hit
    followed = {h for h in document if _sampled(h)}
    ring = admission._samples
    waiting = {ring._hashes[(ring._head + i) % ring._size] for i in range(ring.count)}
    assert followed and followed <= waiting
    assert admission.admit(work.fresh(1)[0])   # never shown: no kind known


def test_a_last_block_after_a_held_prefix_is_decided_by_its_own_kind():
    """Its parent is not new, so its own kind decides: a conversation's turn with one new
    block is kept if such last blocks come back."""
    admission = PredictedReuseAdmission(capacity=500)
    rng = random.Random(8)
    chats = [[rng.getrandbits(64) for _ in range(3)] for _ in range(20)]
    for turn in range(2000):
        chat = chats[turn % len(chats)]
        chat.append(rng.getrandbits(64))
        admission.observe_request(chat)
        assert admission.admit(chat[-1]) or turn < 100
    assert admission.reuse_rate(last=True, new_blocks=1, continues=True) > 0.5


def test_a_kind_that_starts_returning_is_admitted_again():
    admission = PredictedReuseAdmission(capacity=500)
    rng = random.Random(3)
    documents = []
    for _ in range(400):                                       # one-off documents
        doc = [rng.getrandbits(64) for _ in range(40)]
        admission.observe_request(doc)
        for h in doc:
            admission.admit(h)
        documents.append(doc)
    assert admission.reuse_rate(last=False, new_blocks=40, continues=False) < THRESHOLD
    for _ in range(600):                                       # now each is asked twice
        doc = [rng.getrandbits(64) for _ in range(40)]
        for _ in range(2):
            admission.observe_request(doc)
            for h in doc:
                admission.admit(h)
    assert admission.reuse_rate(last=False, new_blocks=40, continues=False) > THRESHOLD


def test_recent_hashes_holds_the_last_window_additions():
    rng = random.Random(2)
    recent = RecentHashes(4000)
    hashes = [rng.getrandbits(64) for _ in range(16000)]
    for start in range(0, 8000, 20):                             # requests of 20 blocks
        recent.held_then_add(hashes[start:start + 20])
    window = hashes[4000:8000]
    assert sum(map(recent.holds, window)) >= 0.95 * len(window)   # a few drop out early
    assert recent.held_then_add(hashes[7000:7010] + hashes[12000:12005])[0] == 10
    recent.held_then_add(hashes[8000:12000])
    assert sum(map(recent.holds, window)) < 0.01 * len(window)    # now older than the window
    assert sum(map(recent.holds, hashes[12005:])) < 0.001 * 4000  # never added
    assert recent.held_then_add(hashes[:3])[0] == 0
    assert recent.holds(hashes[0])
    with pytest.raises(PolicyError):
        RecentHashes(0)
    with pytest.raises(PolicyError):
        PredictedReuseAdmission(0)


def test_recent_hashes_survives_its_stamp_wrapping():
    recent = RecentHashes(16)
    recent._now = 0xFFFFFFF0
    hashes = list(range(40))
    for h in hashes[:30]:
        recent.held_then_add([h])                   # wraps past 2**32
    assert all(recent.holds(h) for h in hashes[20:30])
    assert not any(recent.holds(h) for h in hashes[:10])
    assert recent.held_then_add(hashes[20:30])[0] == 10


def test_names_and_wiring():
    fixed = make_tier_policies("lru", "predicted-reuse", 100)
    assert isinstance(fixed.admission, PredictedReuseAdmission)
    assert fixed.observe_request == fixed.admission.observe_request
    assert make_tier_policies("lru", "second-offer", 100).observe_request is None
    dueled = make_tier_policies("adaptive", "predicted-reuse", 100)
    dueled.observe_request([1, 2, 3])                           # reaches the filter too
    assert dueled.admission.admit(1) is True and 2 in dueled.admission._kinds


def _scan_trace(seed):
    """Short conversations between long one-off documents, as ``(hash_ids)`` lists."""
    rng = random.Random(seed)
    ids = iter(range(1, 10**9))
    out, open_chats = [], []
    for _ in range(2500):
        if open_chats and rng.random() < 0.6:
            chain = open_chats.pop(rng.randrange(len(open_chats)))
            chain = chain + [next(ids) for _ in range(2)]
        elif rng.random() < 0.4:
            out.append([next(ids) for _ in range(rng.randint(30, 80))])
            continue
        else:
            chain = [next(ids) for _ in range(rng.randint(2, 6))]
        open_chats.append(chain)
        out.append(chain + [next(ids)])                        # a partial last block
    return [TraceRequest(i * 100, 512 * len(h), 10, tuple(h)) for i, h in enumerate(out)]


def test_replay_holds_more_of_what_returns_than_lru():
    """Through kvstrata's planner and pool: the filter keeps documents from flushing the
    conversations, so more look-ups hit than under plain LRU with the same capacity."""
    requests = _scan_trace(5)
    hits = {}
    for admission in ("always", "predicted-reuse"):
        config = KvConfig(tiers={"G1": TierConfig(blocks=1500)}, eviction="lru",
                          admission=admission)
        result = replay(requests, config, granularity="trace")
        hits[admission] = result.blocks_hit
        if admission != "always":
            assert result.rejected["G1"] > 0
    assert hits["predicted-reuse"] > 1.1 * hits["always"]



def test_the_native_history_is_the_python_one():
    """``_blockops.recent_held_then_add`` and the Python loop: same answers, same table,
    whatever the hashes (negative and over 64 bits are taken modulo 2**64 by both)."""
    from native_paths import NATIVE_BUILT
    from kvstrata.logical import blockops
    if not NATIVE_BUILT:
        pytest.skip("native extensions not built")
    ops = blockops._load()[0]
    rng = random.Random(9)
    python, native = RecentHashes(300), RecentHashes(300)
    pool = [rng.getrandbits(64) for _ in range(500)] + [-5, 2**70 + 3, 0]
    for _ in range(400):
        request = rng.sample(pool, rng.randint(1, 12))
        known, native._now, sampled = ops.recent_held_then_add(
            request, native._fingerprints, native._stamps, native._sets, native._window,
            native._now, 3)
        assert (known, sampled) == python._held_then_add(request, 3)
        assert sampled == [i for i, h in enumerate(request) if (_mixed(h) >> 20) % 3 == 0]
    assert (python._fingerprints == native._fingerprints).all()
    assert (python._stamps == native._stamps).all() and python._now == native._now
    with pytest.raises(ValueError):
        ops.recent_held_then_add([1], native._fingerprints[:-1], native._stamps,
                                 native._sets, native._window, 0, SAMPLE)


def test_the_native_history_refuses_bad_tables_and_arguments():
    from native_paths import NATIVE_BUILT
    from kvstrata.logical import blockops
    if not NATIVE_BUILT:
        pytest.skip("native extensions not built")
    import numpy as np
    ops = blockops._load()[0]
    prints, stamps = np.zeros(8, np.uint16), np.zeros(8, np.uint32)
    for bad in [(prints, stamps, 2**61, 4, 0),                 # 4 x sets overflows
                (prints, stamps, 2, 0, 0),                     # an empty window
                (prints, stamps, 0, 4, 0),
                (prints.astype(np.float16), stamps, 2, 4, 0),  # the right size, wrong type
                (prints, stamps.astype(np.float32), 2, 4, 0),
                (prints[:4], stamps, 2, 4, 0)]:
        with pytest.raises(ValueError):
            ops.recent_held_then_add([1, 2], *bad, SAMPLE)
    with pytest.raises(ValueError):                            # no sample size
        ops.recent_held_then_add([1, 2], prints, stamps, 2, 4, 0, 0)

    class Shrinks:
        def __index__(self):
            victims.clear()
            return 7
    victims = [Shrinks(), 1, 2, 3]
    known, _, _ = ops.recent_held_then_add(victims, prints, stamps, 2, 4, 0, SAMPLE)  # no stray read
    assert known == 0 and victims == []


def test_a_block_shown_again_before_its_offer_counts_as_reused():
    """Where offers lag (a lower tier is written after the request moved on), a followed
    block shown twice before its offer is a reuse of its kind, not lost."""
    admission = PredictedReuseAdmission(capacity=100)
    rng = random.Random(4)
    for _ in range(200):
        request = [rng.getrandbits(64) for _ in range(8)]
        admission.observe_request(request)
        admission.observe_request(request)          # shown again, still not offered
        for h in request:
            admission.admit(h)
    assert admission.reuse_rate(last=False, new_blocks=8, continues=False) > 0.9


def test_refused_offers_do_not_run_the_horizon_out():
    """The horizon counts admitted blocks: refusing a flood of one-off documents must not
    make conversations that return after a few hundred admissions look one-off too."""
    admission = PredictedReuseAdmission(capacity=1000)
    rng = random.Random(6)
    chats = [[rng.getrandbits(64) for _ in range(3)] for _ in range(60)]
    for turn in range(3000):
        document = [rng.getrandbits(64) for _ in range(40)]
        admission.observe_request(document)
        for h in document:
            admission.admit(h)
        chat = chats[turn % len(chats)]
        chat.append(rng.getrandbits(64))
        admission.observe_request(chat)
        admission.admit(chat[-1])
    assert admission.reuse_rate(last=True, new_blocks=1, continues=True) > 0.5
    assert admission.reuse_rate(last=False, new_blocks=40, continues=False) < THRESHOLD


def test_followed_blocks_stay_bounded_when_nearly_everything_is_refused():
    """Refused blocks are followed too, and refusals do not move the horizon: the samples
    waiting must still stay bounded (the oldest are judged early)."""
    admission = PredictedReuseAdmission(capacity=320)
    rng = random.Random(10)

    def documents(count):
        for _ in range(count):                                 # one-off documents only
            document = [rng.getrandbits(64) for _ in range(40)]
            admission.observe_request(document)
            for h in document:
                admission.admit(h)
    documents(500)
    admitted, judged = admission._admitted, sum(admission._outcomes)
    documents(500)
    assert admission._admitted - admitted < 20        # nearly all refused: the clock stands
    assert sum(admission._outcomes) - judged > 400    # ... yet the samples are still judged
    assert admission.reuse_rate(last=False, new_blocks=40, continues=False) < THRESHOLD


def test_a_batch_decides_as_one_offer_at_a_time():
    """``admit_many`` (one pass, in C when built) and ``admit`` per block: the same
    decisions and the same learning on the same workload (learning that would flip a kind
    mid-batch applies from the next batch; this workload's batches are single requests)."""
    one, many = PredictedReuseAdmission(capacity=1500), PredictedReuseAdmission(capacity=1500)
    singles, batches = [], []
    for hashes in _Workload(seed=12).requests(4000):
        one.observe_request(hashes)
        many.observe_request(hashes)
        singles += [one.admit(h) for h in hashes]
        batches += many.admit_many(hashes)
    assert 0 < sum(singles) < len(singles)                 # some refused, some admitted
    mismatched = sum(a != b for a, b in zip(singles, batches))
    assert mismatched <= 0.001 * len(singles)
    assert abs(one._admitted - many._admitted) <= 0.001 * len(singles)
