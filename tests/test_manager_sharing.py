"""KvBlockManager sharing memory with another manager over NIXL: an importer connects only
to an exporter of blocks computed for the same model and rank, and a fetch for a tenant
stays within the tenant's quota without evicting other tenants' blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstrata.manager import KvBlockManager
from kvstrata.remote.errors import BlockSetMismatchError
from kvstrata.remote.nixl_agent import nixl_available

from test_manager import HANG_GUARD, assert_g1_bytes, chain, hashes_of, make_config, payloads

pytestmark = pytest.mark.skipif(not nixl_available(),
                                reason="NIXL is not installed (scripts/setup.sh installs it)")


def put_for(mgr, records, data, tenant=None) -> None:
    blocks = mgr.allocate(len(records)).result(HANG_GUARD)
    mgr.write_g1(blocks.block_ids, [data[r.sequence_hash] for r in records])
    blocks.apply_token_blocks(records)
    mgr.release(mgr.register(blocks, tenant=tenant).result(HANG_GUARD)).result(HANG_GUARD)
    mgr.wait_idle(HANG_GUARD)


@pytest.mark.parametrize("theirs, ours", [
    ({"model_id": "org/model-a"}, {"model_id": "org/model-b"}),
    ({"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}),
])
def test_an_importer_refuses_blocks_computed_for_another_model_or_rank(theirs, ours):
    """Same geometry, same tokens: another model's or another rank's KV passes every
    checksum, so only the fingerprint tells it apart (it was empty unless given)."""
    def build(kw):
        config = make_config(g1=16, g2=16, g3=0)
        if "model_id" in kw:
            return KvBlockManager(replace(config, model_id=kw["model_id"]))
        return KvBlockManager(config, rank=kw["rank"], world_size=kw["world_size"])

    with build(theirs) as exporting, build(ours) as importing:
        records = chain(4)
        put_for(exporting, records, payloads(exporting, records))
        exporter = exporting.export("G2")
        try:
            with pytest.raises(BlockSetMismatchError):
                importing.importer().connect(exporter.control)
            assert importing.locate(hashes_of(records)).result(HANG_GUARD) == []
        finally:
            exporter.close()


def test_an_importer_of_the_same_model_and_rank_fetches_byte_for_byte():
    with KvBlockManager(make_config(g1=16, g2=16, g3=0)) as exporting, \
            KvBlockManager(make_config(g1=16, g2=16, g3=0)) as importing:
        records = chain(4)
        data = payloads(exporting, records)
        put_for(exporting, records, data)
        exporter = exporting.export("G2")
        try:
            peer = importing.importer().connect(exporter.control)
            assert importing.fetch_remote(peer, records).result(HANG_GUARD) == 4
            with importing.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
                assert len(loaded) == 4
                assert_g1_bytes(importing, loaded, data)
        finally:
            exporter.close()


def test_a_fetch_for_a_tenant_at_its_quota_evicts_its_own_blocks_not_anothers():
    """G2 of 8 at 50 % each: b and a hold 4 each; a fetches 4 more. The slots were taken
    before the quota was asked, so eviction took b's blocks, then the quota gave the
    fetched ones back: b lost its share and a gained nothing."""
    config = make_config(g1=16, g2=8, g3=0)
    tiers = dict(config.tiers)
    tiers["G2"] = replace(tiers["G2"], tenant_quota="50%")
    with KvBlockManager(make_config(g1=16, g2=32, g3=0)) as exporting, \
            KvBlockManager(replace(config, tiers=tiers)) as importing:
        remote = chain(4, 9000)
        put_for(exporting, remote, payloads(exporting, remote), tenant="a")
        bs, as_ = chain(4, 1000), chain(4, 2000)
        put_for(importing, bs, payloads(importing, bs), tenant="b")
        put_for(importing, as_, payloads(importing, as_), tenant="a")
        exporter = exporting.export("G2")
        try:
            peer = importing.importer().connect(exporter.control)
            assert importing.fetch_remote(peer, remote, tenant="a").result(HANG_GUARD) == 4
            importing.wait_idle(HANG_GUARD)
            in_g2 = importing.pools["G2"]
            assert all(h in in_g2 for h in hashes_of(bs) + hashes_of(remote))
            assert importing.status()["tenants"]["held"]["G2"] == {"a": 4, "b": 4}
        finally:
            exporter.close()
