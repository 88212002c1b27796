import json
import random
from collections import OrderedDict

import pytest

from kvstrata.config import KvConfig, TierConfig
from kvstrata.logical.registry import RegistryObserver
from kvstrata.replay import (
    RequestHasher,
    TraceFormatError,
    TraceRequest,
    iter_trace,
    load_trace,
    replay,
)


def one_tier(capacity, policy="lru", admission="always"):
    return KvConfig(tiers={"G1": TierConfig(blocks=capacity)}, eviction=policy, admission=admission)


def reference_lru(requests, capacity):
    """Plain LRU over trace ids, written independently of the pools: a request hits its
    longest prefix of cached ids, then every id is used (moved to most recent) or inserted,
    evicting the least recently used beyond ``capacity``."""
    cache, hits = OrderedDict(), 0
    for req in requests:
        for h in req.hash_ids:
            if h not in cache:
                break
            hits += 1
        for h in req.hash_ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                while len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def random_trace(seed, n=600):
    """Prefix-structured synthetic requests: ids imply their prefix (as in Mooncake traces)."""
    rng = random.Random(seed)
    convs, next_id, out = [], 0, []
    for t in range(n):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
        else:
            conv = [0] if rng.random() < 0.5 else []
            convs.append(conv)
        for _ in range(rng.randint(1, 4)):
            conv.append(next_id := next_id + 1)
        out.append(TraceRequest(t, len(conv) * 512 - rng.randint(0, 500), 10, tuple(conv)))
    return out


@pytest.mark.parametrize("seed, capacity", [(1, 7), (2, 40), (3, 150), (4, 1)])
def test_lru_matches_independent_reference_on_random_traces(seed, capacity):
    requests = random_trace(seed)
    result = replay(requests, one_tier(capacity), granularity="trace")
    assert result.tiers["G1"].blocks_hit == reference_lru(requests, capacity)
    assert result.tiers["G1"].blocks_looked_up == sum(len(r.hash_ids) for r in requests)


@pytest.mark.slow
@pytest.mark.parametrize("capacity, hits", [(1_000, 12_831), (5_000, 31_840), (16_000, 75_776)])
def test_shipped_trace_reproduces_reference_lru(capacity, hits):
    result = replay(load_trace(), one_tier(capacity), granularity="trace")
    assert result.tiers["G1"].blocks_looked_up == 288_500
    assert result.tiers["G1"].blocks_hit == hits


def test_tokens_hit_counts_partial_last_block():
    reqs = [TraceRequest(0, 1000, 1, (1, 2)), TraceRequest(1, 1100, 1, (1, 2, 3))]
    result = replay(reqs, one_tier(10), granularity="trace")
    g1 = result.tiers["G1"]
    assert (g1.blocks_hit, g1.tokens_hit) == (2, 1024)
    assert g1.tokens_looked_up == 1000 + 1100


def test_engine_granularity_counts_full_prompt_blocks():
    reqs = [TraceRequest(0, 1000, 1, (1, 2)), TraceRequest(1, 1100, 1, (1, 2, 3))]
    result = replay(reqs, one_tier(1000), granularity="engine")
    assert result.block_size == 16
    assert result.blocks == 1000 // 16 + 1100 // 16
    assert result.blocks_hit == 1000 // 16  # the second request re-uses the whole first prompt


def test_engine_hashes_equal_hashing_the_synthetic_prompt():
    from kvstrata.replay import synthetic_tokens
    from kvstrata.tokens import hash_blocks
    import numpy as np

    req = TraceRequest(0, 1500, 1, (7, 8, 9))
    records, _ = RequestHasher(32, "engine").records(req)
    tokens = np.concatenate([synthetic_tokens(h) for h in req.hash_ids])
    assert [r.sequence_hash for r in records] == hash_blocks(tokens[: 1500 // 32 * 32], 32)[1]
    # Block sizes that do not divide 512 take the unmemoised path and agree too.
    records48, _ = RequestHasher(48, "engine").records(req)
    assert [r.sequence_hash for r in records48] == hash_blocks(tokens[: 1500 // 48 * 48], 48)[1]


def three_tiers(**kw):
    return KvConfig(
        tiers={"G1": TierConfig(blocks=20), "G2": TierConfig(blocks=60), "G3": TierConfig(blocks=200)},
        **kw,
    )


def test_multi_tier_accounting_is_consistent():
    requests = random_trace(5, n=400)
    result = replay(requests, three_tiers(), granularity="trace")
    tiers = result.tiers
    assert sum(t.blocks_hit for t in tiers.values()) == result.blocks_hit
    assert tiers["G2"].blocks_looked_up == tiers["G1"].blocks_looked_up - tiers["G1"].blocks_hit
    assert tiers["G3"].blocks_looked_up == tiers["G2"].blocks_looked_up - tiers["G2"].blocks_hit
    assert result.moves["G2->G1"] == tiers["G2"].blocks_hit
    assert result.moves["G3->G1"] == tiers["G3"].blocks_hit
    assert tiers["G2"].blocks_hit > 0 and tiers["G3"].blocks_hit > 0
    # Lower tiers add hits beyond what G1 alone gets.
    alone = replay(requests, KvConfig(tiers={"G1": TierConfig(blocks=20)}), granularity="trace")
    assert result.blocks_hit > alone.blocks_hit
    for pool in result.planner.pools.values():
        assert pool.status().active == 0
        pool.check_invariants()


def test_second_offer_admission_rejects_first_offers():
    requests = random_trace(6, n=300)
    cfg = three_tiers(admission="always")
    cfg = KvConfig(tiers={**cfg.tiers, "G3": TierConfig(blocks=200, admission="second-offer")})
    result = replay(requests, cfg, granularity="trace")
    assert result.as_dict()["rejected"]["G3"] > 0
    assert result.moves["G2->G3"] < result.moves["G1->G2"]



def test_global_admission_filters_the_bottom_tier_only():
    """A block a tier refuses never reaches the tiers below it (write-through), so the
    global filter applies to the bottom tier: with second-offer everywhere, G2 refused every
    first offer and G3 starved (on the packaged trace the three tiers' hit rate fell from
    26.3 % to 11.0 %)."""
    requests = random_trace(6, n=300)
    result = replay(requests, three_tiers(admission="second-offer"), granularity="trace")
    report = result.as_dict()
    assert [report["tiers"][t]["admission"] for t in ("G1", "G2", "G3")] == \
        ["always", "always", "second-offer"]
    assert report["rejected"].get("G2", 0) == 0 and report["rejected"]["G3"] > 0
    assert result.moves["G1->G2"] > 0 and 0 < result.moves["G2->G3"] < result.moves["G1->G2"]

def test_replay_is_deterministic():
    requests = random_trace(7, n=500)
    runs = [replay(requests, three_tiers(eviction=p), granularity="engine").as_dict()
            for p in ("lfu", "lfu")]
    for run in runs:
        run.pop("wall_seconds"), run.pop("block_accesses_per_s"), run.pop("block_ops_per_s")
    assert runs[0] == runs[1]


def test_observers_see_registry_changes():
    class Count(RegistryObserver):
        stored = removed = 0

        def on_tier_stored(self, tier, records):
            Count.stored += len(records)

        def on_tier_removed(self, tier, hashes):
            Count.removed += len(hashes)

    result = replay(random_trace(8, n=200), three_tiers(), granularity="trace", observers=[Count()])
    held = sum(p.status().inactive for p in result.planner.pools.values())
    assert Count.stored - Count.removed == held > 0


def test_malformed_line_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
        + "\n{not json\n"
    )
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2"):
        load_trace(path)
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": ["x"]}\n')
    with pytest.raises(TraceFormatError, match=r":1: hash_ids"):
        list(iter_trace(path))
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match="missing field"):
        load_trace(path)


def test_packaged_trace_loads():
    requests = load_trace()
    assert len(requests) == 12_031
    assert sum(len(r.hash_ids) for r in requests) == 288_500


def test_multi_tier_pins_the_located_prefix_while_bringing_blocks_up():
    # G1 holds {2, 3}; the third request needs 1 (in G2) then 2 (in G1). Bringing 1 up must
    # not evict 2, which was already counted as a G1 hit.
    cfg = KvConfig(tiers={"G1": TierConfig(blocks=2), "G2": TierConfig(blocks=10)}, eviction="lru")
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 512, 1, (3,)),
            TraceRequest(2, 1024, 1, (1, 2))]
    result = replay(reqs, cfg, granularity="trace")
    assert (result.tiers["G1"].blocks_hit, result.tiers["G2"].blocks_hit) == (1, 1)
    assert result.moves == {"G1->G2": 3, "G2->G1": 1}  # block 2 was not recomputed


def test_hits_count_only_blocks_actually_served():
    # A request longer than G1 cannot pin its prefix in G1; a located block evicted before its
    # turn is recomputed and ends the served prefix instead of counting as a hit.
    cfg = KvConfig(tiers={"G1": TierConfig(blocks=2), "G2": TierConfig(blocks=20)}, eviction="lru")
    reqs = [TraceRequest(0, 1536, 1, (1, 2, 3)), TraceRequest(1, 512, 1, (9,)),
            TraceRequest(2, 1536, 1, (1, 2, 3))]
    result = replay(reqs, cfg, granularity="trace")
    served = result.moves.get("G2->G1", 0) + result.tiers["G1"].blocks_hit
    assert result.blocks_hit == served
    for pool in result.planner.pools.values():
        assert pool.status().active == 0


def test_the_hashers_memo_is_bounded_and_changes_no_hash(monkeypatch):
    """Its memory follows MEMO_RECORDS, not the trace's distinct blocks; records made again
    after it starts over are the same."""
    import kvstrata.trace as trace_module
    from kvstrata.trace import RequestHasher, TraceRequest

    requests = [TraceRequest(0, 512 * 6, 1, tuple(range(start, start + 6)))
                for start in range(0, 60, 3)]
    unbounded = RequestHasher(16, "engine")
    expected = [unbounded.records(r) for r in requests]
    monkeypatch.setattr(trace_module, "MEMO_RECORDS", 64)
    bounded = RequestHasher(16, "engine")
    for request, want in zip(requests * 2, expected * 2):
        assert bounded.records(request) == want
        assert bounded._memo_records <= 64 + 32


def test_a_parsed_trace_holds_its_hash_ids_in_a_few_bytes_each():
    """A trace is held whole while it is replayed: ids as a tuple of ints took about 36
    bytes each (a 52 MB gzipped trace of long prompts grew the process to 780 MB)."""
    import json
    import tracemalloc

    from kvstrata.trace import parse_request

    lines = [json.dumps({"timestamp": i, "input_length": 512 * 1000, "output_length": 1,
                         "hash_ids": list(range(i * 1000 + 300, i * 1000 + 1300))})
             for i in range(100)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = [parse_request(line, f"t:{n}") for n, line in enumerate(lines, 1)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sum(len(r.hash_ids) for r in held) == 100_000
    assert list(held[7].hash_ids[:3]) == [7300, 7301, 7302]
    assert grown < 8 * 100_000, grown
