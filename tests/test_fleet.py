"""``replay --workers N``: N planners over a shared G4, requests spread by a routing rule."""

from __future__ import annotations

import json

import pytest

from kvstrata.config import KvConfig, TierConfig
from kvstrata.fleet import replay_fleet
from kvstrata.replay import TraceRequest, default_trace_path, load_trace, replay

from test_cli import _cli


def run(*argv):
    code, out, err = _cli(*argv)
    return code, out.decode(), err


def req(*ids: int) -> TraceRequest:
    return TraceRequest(0, 512 * len(ids), 10, tuple(ids))


def small(g4: int | None = 1000) -> KvConfig:
    tiers = {"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=16)}
    if g4:
        tiers["G4"] = TierConfig(blocks=g4)
    return KvConfig(tiers=tiers)


def test_a_prefix_another_worker_computed_is_served_from_the_shared_tier():
    requests = [req(1, 2, 3, 4), req(1, 2, 3, 4, 5)]        # worker 0, then worker 1
    shared = replay_fleet(requests, small(), workers=2)
    alone = replay_fleet(requests, small(), workers=2, shared=False)
    assert shared.workers[1].tiers["G4"].blocks_hit == 4 and shared.from_others == [0, 4]
    assert alone.workers[1].blocks_hit == 0 and alone.from_others == [0, 0]
    assert shared.blocks_hit == 4 and alone.blocks_hit == 0


def test_one_worker_is_the_single_replay():
    requests = load_trace(default_trace_path())[:400]
    config = KvConfig(tiers={"G1": TierConfig(blocks=100), "G2": TierConfig(blocks=400),
                             "G4": TierConfig(blocks=2000)})
    fleet = replay_fleet(requests, config, workers=1, granularity="trace")
    single = replay(requests, config, granularity="trace")
    assert fleet.blocks_hit == single.blocks_hit and fleet.blocks == single.blocks
    assert fleet.workers[0].tiers["G4"].blocks_hit == single.tiers["G4"].blocks_hit


def test_shared_never_worse_than_isolated_on_the_shipped_trace_and_round_robin_balances():
    requests = load_trace(default_trace_path())[:1500]
    shared = replay_fleet(requests, KvConfig(), workers=3)
    alone = replay_fleet(requests, KvConfig(), workers=3, shared=False)
    assert [w.requests for w in shared.workers] == [500, 500, 500]
    assert shared.blocks_hit > alone.blocks_hit
    assert sum(shared.from_others) > 0 and sum(alone.from_others) == 0
    assert "G4" in shared.workers[0].tiers          # added when the config has none


def test_prefix_route_sends_a_returning_prompt_to_the_worker_holding_it():
    requests = [req(1, 2, 3), req(7, 8, 9), req(7, 8, 9, 10), req(1, 2, 3, 4)]
    fleet = replay_fleet(requests, small(g4=None), workers=2, route="prefix", shared=False)
    assert [w.requests for w in fleet.workers] == [2, 2]
    assert [w.blocks_hit for w in fleet.workers] == [3, 3]    # each return found at home
    rr = replay_fleet(requests, small(g4=None), workers=2, shared=False)
    assert rr.blocks_hit == 0                                 # round robin sends them away


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="workers"):
        replay_fleet([], small(), workers=0)
    with pytest.raises(ValueError, match="route"):
        replay_fleet([], small(), workers=2, route="random")


def test_cli_workers_json_and_errors(tmp_path):
    code, out, err = run("replay", "--workers", "3", "--limit", "300", "--json", "--no-progress")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["shared"]["workers"] == 3 and len(doc["shared"]["per_worker"]) == 3
    assert doc["gain"]["blocks_not_recomputed"] == \
        doc["shared"]["blocks_hit"] - doc["isolated"]["blocks_hit"]
    code, out, err = run("replay", "--workers", "2", "--route", "prefix", "--limit", "200",
                         "--plot", str(tmp_path / "f.png"))
    assert code == 0 and "sharing G4" in out, err
    assert (tmp_path / "f.png").stat().st_size > 1000
    for argv in (["--workers", "0"], ["--workers", "x"], ["--workers", "2", "--route", "r"],
                 ["--workers", "2", "--events", "jsonl:/dev/null"]):
        code, _, err = run("replay", *argv)
        lines = [line for line in err.splitlines() if line.strip() and "Triton" not in line]
        assert code == 2 and len(lines) == 1, err


def test_the_added_shared_tier_leaves_the_filter_where_one_worker_has_it():
    """A fleet adds G4 under each worker's tiers; the global admission filter, the bottom
    tier's, must stay on the tier that was the bottom, as in a one-worker replay."""
    from kvstrata.fleet import with_shared_tier

    config = KvConfig(tiers={"G1": TierConfig(blocks=10), "G2": TierConfig(blocks=20),
                             "G3": TierConfig(blocks=40)}, admission="second-offer")
    fleet = with_shared_tier(config)
    assert [fleet.tier_admission(t) for t in ("G1", "G2", "G3", "G4")] == \
        ["always", "always", "second-offer", "always"]
