"""KvBlockManager with a G4 shared through a real S3 server (SeaweedFS): a manager that starts
empty finds and loads, byte-exact, the blocks another one put; other models and tenants see
nothing; an object deleted behind kvstrata's back is a miss, never wrong bytes; a store that
is down costs stores and loads, not the manager."""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.manager import KvBlockManager
from kvstrata.physical.storage.s3client import S3Client, S3Config

from test_manager import (HANG_GUARD, assert_g1_bytes, chain, g3_journal_full, hashes_of,
                          payloads, put)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BS = 4




def g4_config(g3: int = 0, **kw) -> KvConfig:
    tiers = {"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8)}
    if g3:
        tiers["G3"] = TierConfig(blocks=g3)
    tiers["G4"] = TierConfig(blocks=256)
    return KvConfig(block_size=BS, tiers=tiers,
                    model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype="fp16"),
                    **kw)


@pytest.fixture
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"          # each test its own corner of the bucket


def _manager(weed, config, **kw) -> KvBlockManager:
    return KvBlockManager(config, object_store=weed.s3_config(), list_interval=None, **kw)


def _store_all(mgr, records, data) -> None:
    for start in range(0, len(records), 4):
        put(mgr, records[start:start + 4], data)
        mgr.wait_idle(HANG_GUARD)


def test_a_manager_that_starts_empty_loads_what_another_put(weed, tenant):
    config = g4_config(tenant=tenant)
    records = chain(12)
    with _manager(weed, config) as first:
        data = payloads(first, records)
        _store_all(first, records, data)
        assert first.locate(hashes_of(records)).result(HANG_GUARD) != []
    with _manager(weed, config) as second:            # a new worker: G1, G2 empty
        assert second.locate(hashes_of(records)).result(HANG_GUARD) == ["G4"] * 12
        with second.onboard(hashes_of(records[:8])).result(HANG_GUARD) as loaded:
            assert loaded.sources == ("G4",) * 8 and not loaded.failures
            assert_g1_bytes(second, loaded, data)


def test_blocks_stored_later_are_found_by_the_next_listing(weed, tenant):
    config = g4_config(tenant=tenant)
    records = chain(4, start=100)
    with _manager(weed, config) as reader, _manager(weed, config) as writer:
        data = payloads(writer, records)
        _store_all(writer, records, data)
        assert reader.locate(hashes_of(records)).result(HANG_GUARD) == []
        assert reader.refresh_catalogs() >= 4
        with reader.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert len(loaded) == 4
            assert_g1_bytes(reader, loaded, data)


def test_other_models_and_tenants_never_see_the_blocks(weed, tenant):
    records = chain(4, start=200)
    with _manager(weed, g4_config(tenant=tenant)) as mgr:
        _store_all(mgr, records, payloads(mgr, records))
    for other in (g4_config(tenant=tenant + "x"),
                  dataclasses.replace(g4_config(tenant=tenant), model_id="another/model")):
        with _manager(weed, other) as mgr:
            assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == []


def test_a_prompt_stored_under_one_cache_salt_is_no_hit_for_another_in_g4(weed, tenant):
    """One tenant namespace, requests of two salts (vLLM's cache_salt): the same tokens
    hashed under another salt, or none, find nothing in the shared store."""
    from kvstrata.tokens import hash_blocks, isolation_seed
    from kvstrata.types import BlockRecord

    tokens = list(range(300, 300 + 4 * BS))

    def salted(salt):
        local, seqs = hash_blocks(tokens, BS, isolation_seed(cache_salt=salt))
        return [BlockRecord(q, lh, par, BS) for q, lh, par in zip(seqs, local,
                                                                  [None, *seqs[:-1]])]

    mine = salted("alice")
    config = g4_config(tenant=tenant)
    with _manager(weed, config) as mgr:
        _store_all(mgr, mine, payloads(mgr, mine))
    with _manager(weed, config) as mgr:                   # a fresh worker: G4 only
        assert mgr.locate(hashes_of(mine)).result(HANG_GUARD) == ["G4"] * 4
        for other in (salted("bob"), salted(None)):
            assert mgr.locate(hashes_of(other)).result(HANG_GUARD) == []


def test_an_object_deleted_behind_our_back_is_a_miss_never_wrong_bytes(weed, tenant):
    config = g4_config(tenant=tenant)
    records = chain(6, start=300)
    with _manager(weed, config) as writer:
        data = payloads(writer, records)
        _store_all(writer, records, data)
        namespace = writer.storage("G4").namespace
    with _manager(weed, config) as reader:
        assert reader.locate(hashes_of(records)).result(HANG_GUARD) == ["G4"] * 6
        client = S3Client(weed.s3_config())
        gone = [k for k in reader.storage("G4").list_keys()
                if k.startswith(f"{records[3].sequence_hash:016x}.")]
        assert len(gone) == 1
        client.delete(namespace + gone[0])           # a bucket lifecycle rule, say
        with reader.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert len(loaded) == 3 and [f.kind for f in loaded.failures] == ["not_found"]
            assert_g1_bytes(reader, loaded, data)
        held = reader.locate(hashes_of(records)).result(HANG_GUARD)
        assert held == ["G1"] * 3                     # the missing block left the catalog


def test_g3_to_g4_cascade_through_the_disk(weed, tenant, tmp_path):
    config = g4_config(g3=16, tenant=tenant)
    records = chain(8, start=400)
    with _manager(weed, config, disk_dir=str(tmp_path)) as mgr:
        data = payloads(mgr, records)
        _store_all(mgr, records, data)
        assert mgr.transfer_stats()["G3->G4"]["blocks"] == 8
    with _manager(weed, g4_config(tenant=tenant)) as other:
        with other.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert loaded.sources == ("G4",) * 8
            assert_g1_bytes(other, loaded, data)


def test_a_store_that_is_down_costs_stores_not_the_manager(tenant, caplog):
    config = g4_config(tenant=tenant)
    down = S3Config(endpoint_url="http://127.0.0.1:9", bucket="kvstrata", connect_timeout=0.2,
                    request_timeout=0.5, retries=0)
    records = chain(4, start=500)
    with caplog.at_level(logging.WARNING):
        mgr = KvBlockManager(config, object_store=down, list_interval=None)
    with mgr:
        assert any("cannot list G4" in r.getMessage() for r in caplog.records)
        data = payloads(mgr, records)
        _store_all(mgr, records, data)
        stats = mgr.transfer_stats()["G2->G4"]
        assert stats["failed_blocks"] == 4 and stats["blocks"] == 0
        with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert len(loaded) == 4                    # still in G1 / G2
            assert_g1_bytes(mgr, loaded, data)


def test_g4_events_are_on_the_external_tier_and_the_indexer_shows_who_holds_what(
        weed, tenant, tmp_path):
    from kvstrata.events import make_publisher
    from kvstrata.events.indexer import PrefixIndex
    from kvstrata.events.formats import decode_dynamo

    config = g4_config(tenant=tenant)
    records = chain(4, start=600)
    paths = [tmp_path / f"w{i}.jsonl" for i in (1, 2)]
    publishers = [make_publisher(f"dynamo-json:{p}", worker_id=i + 1)
                  for i, p in enumerate(paths)]
    with _manager(weed, config, observers=[publishers[0]]) as writer:
        _store_all(writer, records, payloads(writer, records))
    with _manager(weed, config, observers=[publishers[1]]):
        pass                                           # learns them from the listing
    for publisher in publishers:
        publisher.close()
    index = PrefixIndex()
    tiers_seen = set()
    for path in paths:
        for line in path.read_text().splitlines():
            worker, event = decode_dynamo(line)
            tiers_seen.add(event.tier)
            index.apply_event(worker, event)
    assert "G4" in tiers_seen and '"storage_tier":"external"' in paths[0].read_text()
    assert index.match(hashes_of(records)) == {1: {"G4": 4, "G1": 4, "G2": 4}, 2: {"G4": 4}}


# -- issue 27: keyed tags (what someone with the bucket's credentials cannot do) -------------

def _stored_objects(weed, config, records):
    """Store ``records`` through one manager: their payloads, the G4 namespace, and each
    block's object key (by sequence hash)."""
    with _manager(weed, config) as writer:
        data = payloads(writer, records)
        _store_all(writer, records, data)
        storage = writer.storage("G4")
        keys = {r.sequence_hash: storage.namespace + k for r in records
                for k in storage.list_keys() if k.startswith(f"{r.sequence_hash:016x}.")}
    return data, storage.namespace, keys


def test_an_object_forged_by_a_holder_of_the_bucket_credentials_is_never_served(
        weed, tenant, monkeypatch):
    """Someone who can write the bucket but does not hold the deployment's secret replaces
    a block's object with other bytes and a correct header (xxh3 and all): the next worker
    refuses it (a failed load, recomputed) and loads the blocks before it byte-exact. The
    genuine object copied into another tenant's namespace is refused there; a deployment
    with another secret keeps its objects apart and sees none of these."""
    from kvstrata.physical.checksum import block_checksum
    from kvstrata.physical.storage.object_format import (HEADER_SIZE, decode_header,
                                                          encode_header)

    config = g4_config(tenant=tenant)
    records = chain(4, start=700)
    data, namespace, keys = _stored_objects(weed, config, records)
    client = S3Client(weed.s3_config())
    victim = keys[records[2].sequence_hash]
    with _manager(weed, config) as reader:
        real = client.get(victim)
        header = decode_header(real)
        zeros = bytes(len(real) - HEADER_SIZE)
        client.put(victim, encode_header(fingerprint=header.fingerprint,
                                         geometry=header.geometry,
                                         sequence_hash=header.sequence_hash,
                                         checksum=block_checksum(zeros)) + zeros)
        with reader.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert len(loaded) == 2
            assert [f.kind for f in loaded.failures] == ["checksum_mismatch"]
            assert_g1_bytes(reader, loaded, data)
    # the genuine object copied into another tenant's corner of the bucket is refused there
    other_tenant = dataclasses.replace(config, tenant=tenant + "b")
    with _manager(weed, other_tenant) as thief:
        copy = thief.storage("G4").namespace + victim[len(namespace):]
        client.put(copy, real)
        assert thief.refresh_catalogs() == 1
        with thief.onboard(hashes_of(records[2:3])).result(HANG_GUARD) as loaded:
            assert len(loaded) == 0
            assert [f.kind for f in loaded.failures] == ["checksum_mismatch"]
    # a deployment with another secret has a namespace of its own: it sees none of these
    client.put(victim, real)
    monkeypatch.setenv("KVSTRATA_SHARING_SECRET", "another deployment's secret, 32 bytes")
    with _manager(weed, config) as other:
        assert other.storage("G4").namespace != namespace
        assert other.locate(hashes_of(records)).result(HANG_GUARD) == []


def test_a_g4_without_the_deployments_secret_is_refused_at_start(weed, tenant, monkeypatch):
    from kvstrata.manager import KvBlockManager
    from kvstrata.kinds.base import TierSetupError

    monkeypatch.delenv("KVSTRATA_SHARING_SECRET", raising=False)
    monkeypatch.delenv("KVSTRATA_SHARING_SECRET_FILE", raising=False)
    with pytest.raises((TierSetupError, ValueError), match="needs the deployment's secret"):
        KvBlockManager(g4_config(tenant=tenant), object_store=weed.s3_config(),
                       list_interval=None)


def test_encrypt_at_rest_stores_no_block_in_clear_and_loads_them_back(weed, tenant):
    """``encrypt_at_rest``: the bucket holds ciphertext only; another worker decrypts and
    loads every block byte-exact; a flipped ciphertext byte is a failed load, never bytes."""
    config = g4_config(tenant=tenant, encrypt_at_rest=True)
    records = chain(4, start=900)
    data, _, keys = _stored_objects(weed, config, records)
    client = S3Client(weed.s3_config())
    with _manager(weed, config) as reader:
        for record in records:
            stored = client.get(keys[record.sequence_hash])
            plain = data[record.sequence_hash].tobytes()
            assert plain[:64] not in stored and plain[-64:] not in stored
        with reader.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert loaded.sources == ("G4",) * 4 and not loaded.failures
            assert_g1_bytes(reader, loaded, data)
    # encryption turned off: another namespace, so nothing stored encrypted is seen (nor
    # fails), and the blocks are stored again in clear there
    with _manager(weed, dataclasses.replace(config, encrypt_at_rest=False)) as clear:
        assert clear.locate(hashes_of(records)).result(HANG_GUARD) == []
    victim = keys[records[1].sequence_hash]
    stored = bytearray(client.get(victim))
    stored[-10] ^= 1
    client.put(victim, bytes(stored))
    with _manager(weed, config) as reader:
        with reader.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
            assert len(loaded) == 1
            assert [f.kind for f in loaded.failures] == ["checksum_mismatch"]


def test_a_clear_the_g3_journal_cannot_record_still_clears_g4(weed, tenant, tmp_path):
    """A clear whose G3 journal write failed (a full disk) stopped at G3: the future failed,
    and G4, cleared after G3, kept serving the old model's blocks."""
    config = g4_config(g3=32, tenant=tenant)
    records = chain(8)
    with _manager(weed, config, disk_dir=str(tmp_path)) as mgr:
        _store_all(mgr, records, payloads(mgr, records))
        assert all(h in mgr.pools["G4"] for h in hashes_of(records))
        with g3_journal_full(), pytest.raises(OSError):
            mgr.clear().result(HANG_GUARD)
        assert not any(h in mgr.pools["G4"] for h in hashes_of(records))
