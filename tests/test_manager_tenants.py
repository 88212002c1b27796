"""KvBlockManager with tenant quotas, moving real bytes: the tenant argument of ``register``
(default ``config.tenant``), its blocks kept in G2 while another tenant hammers, loaded back
byte for byte; blocks loaded up from G3 keep their tenant; ``status()["tenants"]``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstrata.config import TierConfig
from kvstrata.manager import InvalidBlockError, KvBlockManager

from test_manager import (HANG_GUARD, assert_baseline, assert_g1_bytes, chain, evict_g1,
                           hashes_of, make_config, payloads)


def tenant_config(**kw):
    config = make_config(g1=16, g2=8, g3=64, **kw)
    tiers = dict(config.tiers)
    tiers["G2"] = replace(tiers["G2"], tenant_quota="50%")
    return replace(config, tiers=tiers, tenant_quotas={"a": {"G3": "25%"}})


def put_for(mgr, records, data, tenant=None) -> None:
    blocks = mgr.allocate(len(records)).result(HANG_GUARD)
    mgr.write_g1(blocks.block_ids, [data[r.sequence_hash] for r in records])
    blocks.apply_token_blocks(records)
    mgr.release(mgr.register(blocks, tenant=tenant).result(HANG_GUARD)).result(HANG_GUARD)


def test_a_tenant_keeps_its_g2_share_while_another_hammers(tmp_path):
    with KvBlockManager(tenant_config(), disk_dir=tmp_path) as mgr:
        mine = chain(4)
        data = payloads(mgr, mine)
        put_for(mgr, mine, data, tenant="a")
        for i in range(5):
            other = chain(4, start=1000 * (i + 1))
            put_for(mgr, other, payloads(mgr, other, seed=i + 1), tenant="b")
            mgr.wait_idle(10)        # else blocks still on their way count: some refused
        status = mgr.status()["tenants"]
        assert status["held"]["G2"] == {"a": 4, "b": 4}
        assert status["evicted"]["G2:*"] == 16          # b's own, oldest first
        assert status["held"]["G3"]["a"] == 4
        evict_g1(mgr)
        assert mgr.locate(hashes_of(mine)).result() == ["G2"] * 4
        with mgr.onboard(hashes_of(mine)).result() as result:
            assert result.sources == ("G2",) * 4
            assert_g1_bytes(mgr, result, data)
        assert_baseline(mgr)


def test_blocks_loaded_up_from_g3_keep_their_tenant(tmp_path):
    with KvBlockManager(tenant_config(tenant="a"), disk_dir=tmp_path) as mgr:
        mine = chain(4)
        data = payloads(mgr, mine)
        put_for(mgr, mine, data)                        # config.tenant: "a"
        mgr.wait_idle(10)
        evict_g1(mgr)
        assert mgr.evict("G2", hashes_of(reversed(mine))).result()
        assert "G2" not in mgr.status()["tenants"]["held"] or \
            "a" not in mgr.status()["tenants"]["held"]["G2"]
        with mgr.onboard(hashes_of(mine)).result() as result:
            assert result.sources == ("G3",) * 4
            assert_g1_bytes(mgr, result, data)
        mgr.wait_idle(10)                               # written through to G2 again
        assert mgr.status()["tenants"]["held"]["G2"] == {"a": 4}
        assert_baseline(mgr)


def test_blocks_a_durable_g3_recovered_share_one_tenants_quota(tmp_path):
    """The G3 journal keeps no tenant: after a restart a's recovered blocks counted against
    no quota, and loaded back they took G2 from b (within its own quota of 4 of 8)."""
    first = [chain(4, 1000 * k) for k in range(4)]
    with KvBlockManager(tenant_config(), disk_dir=tmp_path) as mgr:
        for records in first:
            put_for(mgr, records, payloads(mgr, records), tenant="a")
            mgr.wait_idle(HANG_GUARD)
    with KvBlockManager(tenant_config(), disk_dir=tmp_path) as mgr:
        assert mgr.status()["tenants"]["held"]["G3"] == {"(recovered)": 16}
        mine = chain(4, 50000)
        put_for(mgr, mine, payloads(mgr, mine), tenant="b")
        mgr.wait_idle(HANG_GUARD)
        for records in first:                       # a loads its recovered blocks back
            evict_g1(mgr)
            with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
                assert len(loaded) == 4
            mgr.wait_idle(HANG_GUARD)
        assert all(r.sequence_hash in mgr.pools["G2"] for r in mine)
        held = mgr.status()["tenants"]["held"]["G2"]
        assert held["b"] == 4 and held["(recovered)"] <= 4


@pytest.mark.parametrize("bad", [None, 7, "x" * 300])
def test_register_refuses_a_tenant_that_is_not_a_short_string(tmp_path, bad):
    with KvBlockManager(tenant_config(), disk_dir=tmp_path) as mgr:
        records = chain(1)
        blocks = mgr.allocate(1).result(HANG_GUARD)
        blocks.apply_token_blocks(records)
        if bad is None:              # None is "the config's tenant": accepted
            mgr.release(mgr.register(blocks, tenant=bad).result(HANG_GUARD)).result()
            return
        with pytest.raises(InvalidBlockError, match="tenant"):
            mgr.register(blocks, tenant=bad)
        mgr.release(blocks).result(HANG_GUARD)
        assert_baseline(mgr)
