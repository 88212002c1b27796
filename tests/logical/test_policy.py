import pytest

from kvstrata.logical.block import Block
from kvstrata.logical.policy import (
    AdaptiveAdmission,
    PolicyError,
    SecondOfferAdmission,
    make_admission,
    make_eviction,
)
from kvstrata.logical.pool import BlockPool
from kvstrata.logical.registry import BlockRecord


def store(pool, h, parent=None):
    handle = pool.allocate(1)
    handle.apply_token_blocks([BlockRecord(h, h, parent, 1)])
    pool.release(pool.register(handle))


def test_unknown_names_are_typed_errors():
    with pytest.raises(PolicyError, match="unknown eviction"):
        make_eviction("mru", 4)
    with pytest.raises(PolicyError, match="unknown admission"):
        make_admission("never", 4)
    with pytest.raises(PolicyError):
        SecondOfferAdmission(0)


def test_second_offer_admits_on_second_offer_within_history():
    adm = SecondOfferAdmission(capacity=1, history=2)
    assert not adm.admit(1)
    assert adm.admit(1)
    assert not adm.admit(1)  # admitted offers are forgotten: a third offer starts over
    for h in (2, 3, 4):  # pushes 1's record out of the 2-entry history
        adm.admit(h)
    assert not adm.admit(2)  # 2 was forgotten too (FIFO of 2: holds 3, 4)


def test_lfu_keeps_the_frequently_used_block():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lfu", 2))
    store(pool, 1)
    store(pool, 2)
    for _ in range(3):
        pool.touch([1])
    pool.touch([2])  # 2 is more recent, 1 more frequent
    store(pool, 3)
    assert 1 in pool and 2 not in pool


def test_lfu_ghost_restores_count_of_a_returning_block():
    pool = BlockPool("G1", 1, 1, eviction=make_eviction("lfu", 1))
    store(pool, 1)
    pool.touch([1, 1, 1])  # f = 4
    store(pool, 2)  # evicts 1 into the ghost with f = 4
    store(pool, 1)  # 1 returns: its count resumes (f = 5), so it beats 2 (f = 1) next time
    assert 1 in pool and pool.lookup(1).policy_state == 5


def test_lfu_ages_old_popularity_away():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lfu", 2))
    store(pool, 100)
    pool.touch([100] * 3)  # popular long ago: key 4
    next_id = 1
    for _ in range(8):  # a stream of blocks each used twice raises the age L past 100's key
        store(pool, next_id)
        pool.touch([next_id])
        next_id += 1
    assert 100 not in pool


def test_lru_policy_counts_no_hits_and_evicts_oldest():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lru", 2))
    store(pool, 1)
    store(pool, 2)
    pool.touch([1] * 5)
    store(pool, 3)
    assert 1 in pool and 2 not in pool


def _serve(adm, pool, hashes):
    adm.observe_request(hashes)
    for h in hashes:
        if h in pool:
            pool.touch([h])
        elif adm.admit(h):
            store(pool, h)


def test_adaptive_turns_second_offer_on_when_one_hit_blocks_flood():
    adm = AdaptiveAdmission(capacity=40, sample=1)
    pool = BlockPool("G1", 40, 1, eviction=make_eviction("lfu", 40))
    hot = list(range(1, 31))
    fresh = 10_000
    for _ in range(60):  # a hot set slightly smaller than the tier, between floods of one-offs
        _serve(adm, pool, hot)
        _serve(adm, pool, list(range(fresh, fresh + 30)))
        fresh += 30
    assert adm.second_offer


def test_adaptive_stays_off_when_everything_fits():
    adm = AdaptiveAdmission(capacity=100, sample=1)
    pool = BlockPool("G1", 100, 1, eviction=make_eviction("lfu", 100))
    for turn in range(30):  # growing conversations that fit: every first reuse matters
        for conv in range(3):
            base = conv * 1000
            _serve(adm, pool, list(range(base, base + turn + 1)))
    assert not adm.second_offer
