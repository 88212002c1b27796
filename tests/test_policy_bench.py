"""The policy comparison's own pieces (bench/policy_table.py, bench/synth_trace.py): the
references it measures policies against, and the synthetic workloads it reports."""

import importlib.util
import json
import pathlib
import sys

import pytest

from kvstrata.replay import parse_request

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def _load(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module        # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


common = _load("_common")
synth = _load("synth_trace")
table = _load("policy_table")


def _trace(profile, requests=400, seed=3):
    rows = synth.generate(requests, seed, synth.PROFILES[profile])
    return [parse_request(json.dumps(r), f"{profile}:{i}") for i, r in enumerate(rows)]


def test_profiles_are_reproducible_and_differ():
    first = {p: synth.generate(200, 5, w) for p, w in synth.PROFILES.items()}
    assert first == {p: synth.generate(200, 5, w) for p, w in synth.PROFILES.items()}
    shapes = {p: sum(len(r["hash_ids"]) for r in rows) for p, rows in first.items()}
    assert len(set(shapes.values())) == len(shapes)


def test_partial_tail_makes_every_last_block_a_requests_own():
    rows = synth.generate(500, 4, synth.PROFILES["chat"])
    lasts = [r["hash_ids"][-1] for r in rows]
    assert len(set(lasts)) == len(lasts)
    assert all(h not in r["hash_ids"] for r in rows for h in lasts if h != r["hash_ids"][-1])


@pytest.mark.parametrize("profile", sorted(synth.PROFILES))
def test_references_bound_lru_from_above(profile):
    """Knowing which blocks return can only help LRU (a returning block it holds, LRU told
    the future holds too), and on these traces the clairvoyant bound is above both; the
    replay's lru is exactly a plain LRU."""
    requests = _trace(profile)
    for capacity in (40, 200):
        lru = table.policy_hits(requests, capacity, "lru")
        returning = table.returning_lru_hits(requests, capacity)
        assert lru <= returning <= table.belady_hits(requests, capacity)
        assert lru == common.bare_lru_hits(requests, capacity)


@pytest.mark.parametrize("profile", ["chat", "scan", "mixed"])
def test_knowing_the_kinds_lies_between_lru_and_knowing_every_block(profile):
    """The reference told only where the kind of block decides its return: documents' blocks
    and, with partial tails, last blocks; it sits between LRU and LRU told every block."""
    raw = synth.generate(400, 3, synth.PROFILES[profile])
    requests = [parse_request(json.dumps(r), f"{profile}:{i}") for i, r in enumerate(raw)]
    told = table.dead_by_kind(raw, synth.PROFILES[profile].partial_tail)
    assert len(told) == sum(len(r.hash_ids) for r in requests)
    documents = sum(len(r["hash_ids"]) - r["shared_prefix"] for r in raw if r["kind"] == "document")
    assert all(0 < r["shared_prefix"] < len(r["hash_ids"]) for r in raw)
    tails = len(raw) if synth.PROFILES[profile].partial_tail else 0
    assert 0 < sum(told) <= documents + tails
    assert {r["kind"] for r in raw} <= {"conversation", "agent", "document", "question"}
    for capacity in (40, 200):
        lru = table.policy_hits(requests, capacity, "lru")
        kinds = table.returning_lru_hits(requests, capacity, told)
        assert lru <= kinds <= table.returning_lru_hits(requests, capacity)
    assert table.returning_lru_hits(requests, 40, [False] * len(told)) == \
        table.policy_hits(requests, 40, "lru")            # told nothing: plain LRU
