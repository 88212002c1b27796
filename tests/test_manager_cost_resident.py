"""KvBlockManager.onboard(cost_aware=True) with a prefix already in G1: nothing to load, so
it is always worth it (the reviewer's repro_cost_resident.py: resident blocks were charged a
made-up G1->G1 copy, the device prior's 50 us a plan, and with a fast engine the whole
resident prefix was refused and recomputed)."""

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.manager import KvBlockManager
from kvstrata.types import BlockRecord

BS = 16


def test_a_cost_aware_onboard_takes_blocks_already_in_g1():
    cfg = KvConfig(block_size=BS, tiers={"G1": TierConfig(blocks=16),
                                         "G2": TierConfig(blocks=16)},
                   model=ModelGeometry(num_layers=1, kv_heads=1, head_dim=8, dtype="fp16"),
                   admission="always")
    records = [BlockRecord(1000 + i, 1, None if i == 0 else 999 + i, BS) for i in range(4)]
    hashes = [r.sequence_hash for r in records]
    with KvBlockManager(cfg) as mgr:
        blocks = mgr.allocate(4).result()
        blocks.apply_token_blocks(records)
        handle = mgr.register(blocks).result()
        mgr.flush().result()
        assert mgr.locate(hashes).result() == ["G1"] * 4
        mgr.assume_prefill(2e6).result()          # a fast engine: 16 tokens in 8 us
        count, saved = mgr.worth_loading(["G1"] * 4).result()
        assert count == 4 and saved > 0
        result = mgr.onboard(hashes, cost_aware=True).result()
        try:
            assert len(result) == 4 and list(result.sources) == ["G1"] * 4
            assert "G1->G1" not in mgr.planner.costs.snapshot()["paths"]
        finally:
            result.release()
            mgr.release(handle).result()
