"""Data replay: real bytes through G1 (stand-in), G2 and a disk G3, verified end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import torch
import pytest

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.manager import ManagerConfigError
from kvstrata.data_replay import DataReplayError, DataRun, block_payload, run_data_replay
from kvstrata.manager import KvBlockManager
from kvstrata.replay import RequestHasher, TraceRequest, iter_trace, replay

SMALL_MODEL = ModelGeometry(num_layers=2, kv_heads=2, head_dim=16, dtype="fp16")  # 4 KiB blocks


def config(g1: int, g2: int, g3: int, **kw) -> KvConfig:
    return KvConfig(tiers={"G1": TierConfig(blocks=g1), "G2": TierConfig(blocks=g2),
                           "G3": TierConfig(blocks=g3)}, model=SMALL_MODEL, **kw)


def request(*ids: int) -> TraceRequest:
    return TraceRequest(0, 512 * len(ids), 10, tuple(ids))


def test_block_payload_is_deterministic_and_distinct():
    a = block_payload(123, 4096)
    assert a.dtype == np.uint8 and a.size == 4096
    assert np.array_equal(a, block_payload(123, 4096))
    assert (a != block_payload(124, 4096)).mean() > 0.9
    assert block_payload(5, 1001).size == 1001


def test_bytes_survive_every_path_and_report_is_json(tmp_path):
    # A: ids 1,2 (64 blocks); B pushes A out of G1 and G2 (A stays on disk); C reuses A.
    requests = [request(1, 2), request(3, 4), request(1, 2, 5), request(3, 4), request(3, 4)]
    progress = []
    doc = run_data_replay(requests, config(64, 64, 1024), disk_dir=str(tmp_path),
                          progress=progress.append)
    json.dumps(doc)
    assert progress == [1, 2, 3, 4, 5]
    assert doc["mismatches"] == 0 and doc["load_failures"] == 0
    assert doc["checksum_failures"] == 0
    assert doc["verified_blocks"] == doc["blocks_hit"] > 0
    assert doc["tiers"]["G3"]["blocks_hit"] > 0
    paths = doc["paths"]
    assert {"G1->G2", "G2->G3", "G3->G1"} <= set(paths)
    assert doc["bytes_moved"] == sum(p["bytes"] for p in paths.values())
    assert paths["G1->G2"]["bytes"] == paths["G1->G2"]["blocks"] * doc["block_bytes"]
    assert all(p["gb_per_s"] > 0 for p in paths.values())
    assert doc["computed_blocks"] == doc["blocks"] - doc["blocks_hit"]
    assert doc["stand_in"] is (not torch.cuda.is_available())   # CPU G1 only without a GPU
    assert list(tmp_path.iterdir()) == []            # the slab file is gone afterwards


@pytest.mark.parametrize("n, sizes", [(12, (300, 900, 4000)), (40, (64, 128, 400))])
def test_hits_and_moves_equal_the_metadata_replay(n, sizes):
    """Both replays drive the same planner: moving real bytes changes no decision, so every
    hit and every copy per path is the same, block for block."""
    requests = list(itertools.islice(iter_trace(), n))
    cfg = config(*sizes)
    data = run_data_replay(requests, cfg)
    meta = replay(requests, cfg).as_dict()
    assert data["mismatches"] == 0
    assert (data["blocks"], data["blocks_hit"]) == (meta["blocks"], meta["blocks_hit"])
    assert meta["tiers"]["G3"]["blocks_hit"] > 0
    assert set(data["tiers"]) == set(meta["tiers"])
    for name, tier in data["tiers"].items():
        assert set(meta["tiers"][name]) == set(tier)
        assert tier["blocks_hit"] == meta["tiers"][name]["blocks_hit"]
        assert tier["evictions"] == meta["tiers"][name]["evictions"]
    assert {p: s["blocks"] for p, s in data["paths"].items()} == meta["moves"]


def test_trace_granularity_moves_512_token_blocks():
    doc = run_data_replay([request(7, 8), request(7, 8, 9)], config(4, 4, 16),
                          granularity="trace", verify="loaded")
    assert doc["block_size"] == 512 and doc["block_bytes"] == 2 * 2 * 512 * 32 * 2
    assert doc["blocks_hit"] == 2 and doc["mismatches"] == 0


def test_refuses_tiers_too_big_for_the_limits(tmp_path):
    with pytest.raises(DataReplayError, match="RAM"):
        run_data_replay([], config(10, 10_000_000, 10), max_host_bytes=1 << 30)
    with pytest.raises(DataReplayError, match="disk"):
        run_data_replay([], config(10, 10, 10_000_000), disk_dir=str(tmp_path),
                        max_disk_bytes=1 << 30)
    with pytest.raises(ManagerConfigError, match="G4 .* needs a url"):
        run_data_replay([], KvConfig(tiers={"G1": TierConfig(blocks=4), "G2": TierConfig(blocks=4),
                                            "G3": TierConfig(blocks=4),
                                            "G4": TierConfig(blocks=4)}, model=SMALL_MODEL))


def test_verifier_catches_corrupted_blocks(tmp_path):
    """The replay's checks must be able to fail: a block corrupted in G1 (no checksum there)
    is caught by the byte comparison, one corrupted on disk by the G3 checksum."""
    cfg = config(64, 64, 1024)
    with KvBlockManager(cfg, disk_dir=str(tmp_path)) as mgr:
        run = DataRun(mgr, cfg, RequestHasher(cfg.block_size, "engine"), "all", True)
        first, second = request(1), request(2)
        run.request(first)
        run.request(second)
        assert run.report(0.0)["mismatches"] == 0
        hashes = [r.sequence_hash for r in run.hasher.records(first)[0]]
        hashes2 = [r.sequence_hash for r in run.hasher.records(second)[0]]
        # Flip a byte of a G1 block of request 1: served from G1, compared, mismatch.
        g1 = mgr.storage("G1")
        region, offset, _ = g1.layout.region_of(mgr.pools["G1"].lookup(hashes[3]).block_id,
                                                0, 0)
        g1.memory.regions[region][offset] ^= 0xFF
        run.request(first)
        doc = run.report(0.0)
        assert doc["mismatches"] == 1 and doc["checksum_failures"] == 0
        # Flip a byte of request 2's copy on disk and serve it from there: checksum failure.
        mgr.evict("G1", list(reversed(hashes2))).result(30)
        mgr.evict("G2", list(reversed(hashes2))).result(30)
        slot = mgr.pools["G3"].lookup(hashes2[5]).block_id
        g3 = mgr.storage("G3")
        with open(g3.path, "r+b") as f:
            f.seek(slot * g3.layout.block_stride + 10)
            byte = f.read(1)
            f.seek(slot * g3.layout.block_stride + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        run.request(second)
        doc = run.report(0.0)
        assert doc["checksum_failures"] == 1 and doc["load_failures"] == 1
        assert doc["mismatches"] == 1          # the corrupt disk bytes were never served


# -- config read and used (the slab goes where the config says) -----------------------------

def _slab_dirs_seen(monkeypatch):
    """Record the directory every G3 slab is created in."""
    from kvstrata.physical.storage import disk as disk_module

    seen = []
    real = disk_module.DiskStorage.__init__

    def spy(self, config, directory, *a, **kw):
        seen.append(str(directory))
        return real(self, config, directory, *a, **kw)

    monkeypatch.setattr(disk_module.DiskStorage, "__init__", spy)
    return seen


@pytest.mark.parametrize("how", ["disk_dir", "tier_path"])
def test_the_configured_disk_dir_is_where_the_slab_goes(tmp_path, monkeypatch, how):
    from dataclasses import replace

    seen = _slab_dirs_seen(monkeypatch)
    cfg = config(64, 64, 256)
    if how == "disk_dir":
        cfg = replace(cfg, disk_dir=str(tmp_path))
    else:
        tiers = dict(cfg.tiers)
        tiers["G3"] = replace(tiers["G3"], path=str(tmp_path))
        cfg = replace(cfg, tiers=tiers)
    run_data_replay([request(1, 2), request(1, 2)], cfg)
    assert seen == [str(tmp_path)]


def test_a_disk_dir_that_is_a_file_or_missing_is_refused_before_anything(tmp_path):
    from dataclasses import replace

    afile = tmp_path / "file"
    afile.write_text("x")
    for bad in (str(afile), str(tmp_path / "missing")):
        with pytest.raises(DataReplayError, match="not a directory|does not exist"):
            run_data_replay([request(1)], replace(config(64, 64, 256), disk_dir=bad))


def test_free_space_is_measured_where_the_slab_goes(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    measured = []
    usage = namedtuple("usage", "total used free")

    def fake_usage(path):
        measured.append(str(path))
        return usage(1 << 20, 0, 1 << 20)          # 1 MiB free there

    monkeypatch.setattr(shutil, "disk_usage", fake_usage)
    with pytest.raises(DataReplayError, match="disk"):
        run_data_replay([request(1)], config(64, 64, 4096), disk_dir=str(tmp_path))
    assert measured == [str(tmp_path)]


def test_report_says_what_the_cost_model_would_load_and_save():
    cfg = config(64, 64, 1024)
    requests = [request(1, 2), request(3, 4), request(1, 2, 5), request(3, 4), request(3, 4)]
    slow_engine = run_data_replay(requests, cfg, prefill_tokens_per_s=10.0)
    model = slow_engine["cost_model"]
    held = slow_engine["blocks_hit"]
    assert held > 0 and sum(model["would_load"].values()) == held
    assert set(model["would_load"]) - {"G1"}                 # loads from below G1 too
    assert not model["would_recompute"] and model["estimated_seconds_saved"] > 0
    assert model["prefill_tokens_per_s"] == 10.0
    assert model["paths"]["G1->G2"]["samples"] >= 1
    instant_engine = run_data_replay(requests, cfg, prefill_tokens_per_s=1e12)
    model = instant_engine["cost_model"]
    assert not any(t != "G1" for t in model["would_load"])     # only what is already in G1
    assert sum(model["would_recompute"].values()) + sum(model["would_load"].values()) == held
    with pytest.raises(ValueError):
        run_data_replay(requests, cfg, prefill_tokens_per_s=0)
