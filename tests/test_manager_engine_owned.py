"""EngineOwnedManager: the block manager over an engine's own KV memory (the engine allocates
G1's blocks and hands their ids over): store and load by engine block ids, with and without a
G2 between the engine's host memory and G3, the engine's blocks free to reuse once a store
returns, bad ids refused before anything is planned, an owned G1's verbs refused."""

from __future__ import annotations

import pytest
import torch

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.manager import EngineOwnedManager, InvalidBlockError, ManagerError

from test_manager import HANG_GUARD, chain, hashes_of

BS, BLOCKS = 4, 16


def engine_kv(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, BS, 2, 8, generator=gen).half() for _ in range(2)]


def config(g2: int | None = None) -> KvConfig:
    tiers = {"G1": TierConfig(blocks=BLOCKS), "G3": TierConfig(blocks=64)}
    if g2:
        tiers["G2"] = TierConfig(blocks=g2)
    return KvConfig(block_size=BS, tiers=tiers,
                    model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype="fp16"))


def blocks_of(layers, ids) -> list[torch.Tensor]:
    return [torch.stack([layer[:, b] for layer in layers]).clone() for b in ids]


@pytest.mark.parametrize("g2", [None, 8])
def test_stored_blocks_load_back_into_other_engine_blocks(tmp_path, g2):
    layers = engine_kv()
    with EngineOwnedManager(config(g2), kv_caches=layers, disk_dir=tmp_path) as mgr:
        records = chain(6)
        want = blocks_of(layers, range(6))
        mgr.store(records, list(range(6))).result(HANG_GUARD)
        for layer in layers:                      # the engine reuses its blocks at once
            layer[:, :6] = 0
        mgr.wait_idle(HANG_GUARD)
        assert mgr.held(hashes_of(records)).result() == 6
        assert mgr.locate(hashes_of(records)).result() == ["G2" if g2 else "G3"] * 6
        assert all(h in mgr.pools["G3"] for h in hashes_of(records))   # written through
        result = mgr.load(hashes_of(records), [10, 11, 12, 13, 14, 15]).result(HANG_GUARD)
        assert len(result) == 6 and result.failed == [] and result.blocks is None
        assert result.block_ids == [10, 11, 12, 13, 14, 15]
        got = blocks_of(layers, range(10, 16))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_load_fills_only_the_held_prefix(tmp_path):
    layers = engine_kv()
    with EngineOwnedManager(config(), kv_caches=layers, disk_dir=tmp_path) as mgr:
        records = chain(4)
        mgr.store(records[:2], [0, 1]).result(HANG_GUARD)
        untouched = blocks_of(layers, [12, 13])
        result = mgr.load(hashes_of(records), [10, 11, 12, 13]).result(HANG_GUARD)
        assert len(result) == 2 and result.requested == 4
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(layers, [12, 13]), untouched))


@pytest.mark.parametrize("ids", [[0, 0], [0, BLOCKS], [-1, 1], [0]])
def test_bad_engine_block_ids_are_refused_before_anything_is_planned(tmp_path, ids):
    with EngineOwnedManager(config(), kv_caches=engine_kv(), disk_dir=tmp_path) as mgr:
        with pytest.raises(InvalidBlockError, match="engine block ids"):
            mgr.store(chain(2), ids)
        with pytest.raises(InvalidBlockError, match="engine block ids"):
            mgr.load(hashes_of(chain(2)), ids)
        assert mgr.status()["transfers_pending"] == 0


def test_an_owned_g1s_verbs_are_refused(tmp_path):
    with EngineOwnedManager(config(), kv_caches=engine_kv(), disk_dir=tmp_path) as mgr:
        for call in (lambda: mgr.allocate(1), lambda: mgr.match([1]),
                     lambda: mgr.onboard([1]), lambda: mgr.register(None)):
            with pytest.raises(ManagerError, match="engine owns G1"):
                call()
    with pytest.raises(ManagerError, match="kv_caches"):
        EngineOwnedManager(config(), kv_caches=None)
