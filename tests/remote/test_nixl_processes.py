"""Remote reads over NIXL between real OS processes (UCX on loopback): a prefill-shaped
exporter process holds blocks in its G2; this process imports its block set and reads leased
blocks byte-exact into every layout kvstrata uses; bad block sets are refused before a byte
moves; leases pin and expire; a dead exporter is a load error, never wrong bytes; a dead
reader's leases expire."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
import torch

from kvstrata.remote.nixl_agent import nixl_available

if not nixl_available():
    pytest.skip("NIXL is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from kvstrata.physical.storage.device import DeviceStorage  # noqa: E402
from kvstrata.physical.storage.host import HostStorage  # noqa: E402
from kvstrata.protocol.layout import LayoutConfig  # noqa: E402
from kvstrata.protocol.layout_codec import SharedLayout  # noqa: E402
from kvstrata.remote.blockset import byte_ranges  # noqa: E402
from kvstrata.remote.errors import (BlockSetMismatchError, LeaseError,  # noqa: E402
                                    RemoteReadError)
from kvstrata.remote.importer import BlockSetImporter  # noqa: E402
from kvstrata.testing.exporter import (payload_of, start_exporter,  # noqa: E402
                                       start_lease_holder)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GEOMETRY = dict(num_layers=4, outer_dim=2, page_size=16, inner_dim=128, dtype="bfloat16")


@pytest.fixture(scope="module")
def exporter():
    ex = start_exporter(chains=4, chain_blocks=8, g2_blocks=64)
    yield ex
    ex.stop()


def host_storage(blocks=32, alignment=4096, **overrides) -> HostStorage:
    return HostStorage(LayoutConfig(num_blocks=blocks, alignment=alignment,
                                    **{**GEOMETRY, **overrides}))


def vllm_like_g1(blocks=32) -> DeviceStorage:
    """vLLM's CPU KV cache: one [2, blocks, page, heads, head_dim] tensor per layer."""
    tensors = [torch.zeros(2, blocks, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    return DeviceStorage.wrap(tensors)


def local_bytes(storage, slot: int) -> bytes:
    shared = SharedLayout(storage.layout, storage.descriptors())
    return b"".join(bytes((ctypes.c_char * n).from_address(a))
                    for a, n in byte_ranges(shared, [slot], _chunk()))


def _chunk():
    from kvstrata.protocol.layout import Granularity
    return Granularity.CHUNK


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("make_local", [
    lambda: host_storage(alignment=4096),
    lambda: host_storage(blocks=9, alignment=1),
    vllm_like_g1,
], ids=["host-aligned", "host-packed", "vllm-layer-separate"])
def test_leased_blocks_read_byte_exact_into_every_layout(exporter, make_local):
    local = make_local()
    importer = BlockSetImporter(local)
    try:
        peer = importer.connect(exporter.control)
        chain = exporter.chains[1]
        lease = peer.lease(chain + [12345, 678])            # more than it holds: a prefix
        assert lease.sequence_hashes == chain
        slots = list(range(len(chain)))[::-1]               # scattered into reversed slots
        slots = [s % local.layout.config.num_blocks for s in slots]
        checksums = peer.read(lease, slots)
        assert len(checksums) == len(chain)
        for slot, h in zip(slots, chain):
            assert local_bytes(local, slot) == payload_of(h, exporter.block_bytes).tobytes()
        if isinstance(local, HostStorage):                  # sealed: readable under its hash
            assert not local.check_readable(slots, chain)
        assert exporter.status()["leases"] == 1
        assert peer.release(lease, wait=True)
        assert not peer.release(lease, wait=True)           # twice: already gone
        assert exporter.status()["leases"] == 0 and exporter.status()["g2_active"] == 0
    finally:
        importer.close()


@pytest.mark.parametrize("override", [{"page_size": 32}, {"dtype": "float16"},
                                      {"num_layers": 2}, {"inner_dim": 64}])
def test_a_block_set_laid_out_differently_is_refused_before_any_byte_moves(exporter, override):
    before = exporter.status()["requests"]
    importer = BlockSetImporter(host_storage(**override))
    try:
        with pytest.raises(BlockSetMismatchError):
            importer.connect(exporter.control)
    finally:
        importer.close()
    assert exporter.status()["requests"] == before + 1   # the block set only, no lease
    assert exporter.status()["leases"] == 0


def test_a_fingerprint_mismatch_is_refused(exporter):
    importer = BlockSetImporter(host_storage(), fingerprint="another-model")
    try:
        with pytest.raises(BlockSetMismatchError, match="made for"):
            importer.connect(exporter.control)
    finally:
        importer.close()


def test_an_unreleased_lease_pins_until_it_expires(exporter):
    importer = BlockSetImporter(host_storage())
    try:
        peer = importer.connect(exporter.control)
        expired = exporter.status()["expired"]
        lease = peer.lease(exporter.chains[2], ttl=0.6)
        assert len(lease.blocks) == 8
        status = exporter.status()
        assert status["leases"] == 1 and status["g2_active"] == 8
        assert wait_for(lambda: exporter.status()["leases"] == 0)
        status = exporter.status()
        assert status["expired"] == expired + 1 and status["g2_active"] == 0
        with pytest.raises(LeaseError, match="expired"):
            peer.read(lease, list(range(8)))
        assert not peer.release(lease, wait=True)
        nothing = peer.lease([42, 43])                       # not held: an empty lease
        assert nothing.blocks == () and nothing.lease_id == 0
    finally:
        importer.close()


def test_a_reader_that_dies_holding_a_lease_pins_nothing_after_its_deadline(exporter):
    """Its connection closes as it dies: the lease goes then, before its deadline (60 s)."""
    process, granted = start_lease_holder(exporter.control, exporter.chains[3], ttl=60.0)
    try:
        assert granted == 8
        assert exporter.status()["g2_active"] == 8
        process.kill()
        process.join(10)
        assert wait_for(lambda: exporter.status()["leases"] == 0)
        assert exporter.status()["g2_active"] == 0
    finally:
        if process.is_alive():
            process.kill()


def test_an_exporter_that_dies_before_the_read_is_a_load_error_not_bytes():
    ex = start_exporter(chains=1, chain_blocks=8, g2_blocks=16)
    local = host_storage()
    importer = BlockSetImporter(local)
    try:
        peer = importer.connect(ex.control)
        lease = peer.lease(ex.chains[0])
        ex.kill()
        with pytest.raises(RemoteReadError):
            peer.read(lease, list(range(8)), timeout=10)
        assert local.check_readable(list(range(8)), lease.sequence_hashes)  # nothing sealed
    finally:
        importer.close()
        ex.stop()


def test_an_exporter_killed_mid_read_never_hands_over_wrong_bytes():
    """A large read with the exporter killed while it runs: either the read fails with a
    load error (and nothing is sealed), or it completed before the kill and every block
    verified. Repeated to land the kill inside the read at least sometimes."""
    outcomes = []
    for attempt in range(3):
        ex = start_exporter(chains=1, chain_blocks=48, g2_blocks=96,
                            geometry=dict(layers=8, kv_heads=4, head_dim=128))
        local = HostStorage(LayoutConfig(num_blocks=64, num_layers=8, outer_dim=2,
                                         page_size=16, inner_dim=512, dtype="bfloat16",
                                         alignment=4096))
        importer = BlockSetImporter(local)
        try:
            peer = importer.connect(ex.control)
            lease = peer.lease(ex.chains[0])
            killer = threading.Timer(0.001 * attempt, ex.kill)
            killer.start()
            try:
                peer.read(lease, list(range(48)), timeout=10)
                outcomes.append("completed")
                for slot, h in enumerate(lease.sequence_hashes):
                    assert np.array_equal(local.payload(slot), payload_of(h, ex.block_bytes))
            except RemoteReadError:
                outcomes.append("failed")
                assert local.check_readable(list(range(48)), lease.sequence_hashes)
            killer.join()
        finally:
            importer.close()
            ex.stop()
    print("mid-read outcomes", outcomes)
    assert len(outcomes) == 3


def test_a_lease_naming_slots_outside_the_block_set_is_refused_before_reading(exporter):
    from kvstrata.remote.errors import BlockSetFormatError
    from kvstrata.remote.importer import RemoteLease

    local = host_storage()
    importer = BlockSetImporter(local)
    try:
        peer = importer.connect(exporter.control)
        chain = exporter.chains[0]
        forged = RemoteLease(1, ((chain[0], 10**9, 0),), time.monotonic() + 30)
        with pytest.raises(BlockSetFormatError):
            peer.read(forged, [0])
    finally:
        importer.close()


def test_a_block_set_pointing_outside_what_the_exporter_registered_reads_nothing(exporter):
    """A tampered block set (its region moved by a page) passes validation, but the read
    never hands over bytes: NIXL refuses memory the exporter did not register, or the bytes
    fail their checksums; nothing is sealed."""
    import json

    from kvstrata.remote.importer import ask

    data = ask(exporter.control, {"op": "blockset"}, 5)["blockset"]
    raw = json.loads(data)
    raw["layout"]["regions"][0]["address"] += 4096
    local = host_storage()
    importer = BlockSetImporter(local)
    try:
        peer = importer.import_blockset(json.dumps(raw).encode())
        lease = peer.lease(exporter.chains[0])
        with pytest.raises(RemoteReadError):
            peer.read(lease, list(range(len(lease.blocks))))
        assert local.check_readable(list(range(len(lease.blocks))), lease.sequence_hashes)
        peer.release(lease, wait=True)
    finally:
        importer.close()


def test_an_unverified_read_seals_with_the_exporters_checksums(exporter):
    local = host_storage()
    importer = BlockSetImporter(local)
    try:
        peer = importer.connect(exporter.control)
        lease = peer.lease(exporter.chains[0])
        checksums = peer.read(lease, list(range(8)), verify=False)
        assert checksums == [b[2] for b in lease.blocks]
        assert not local.check_readable(list(range(8)), lease.sequence_hashes, verify=True)
        for slot, h in enumerate(lease.sequence_hashes):
            assert np.array_equal(local.payload(slot), payload_of(h, exporter.block_bytes))
        peer.release(lease, wait=True)
    finally:
        importer.close()


@pytest.mark.parametrize("hashing", ["pipelined", "native", "python"])
@pytest.mark.parametrize("verifier", ["running", "starved"])
def test_a_block_failing_its_checksum_in_a_later_batch_fails_the_whole_read(exporter,
                                                                             monkeypatch,
                                                                             verifier,
                                                                             hashing):
    """Batches are hashed on the importer's verifying thread while the next one is copied
    (or, when that thread gets no CPU, by the reading thread itself): a bad block in any
    batch fails the read, nothing is sealed, and later reads are served."""
    import kvstrata.remote.importer as importer_module
    from kvstrata.remote.importer import RemoteLease

    monkeypatch.setattr(importer_module, "BATCH_BYTES", 1)     # one block a batch
    local = host_storage()
    importer = BlockSetImporter(local)
    if verifier == "starved":                                   # never woken: never runs
        monkeypatch.setattr(importer._verifier, "wake", lambda job: None)
    use_hashing(monkeypatch, hashing)
    try:
        peer = importer.connect(exporter.control)
        chain = exporter.chains[2]
        lease = peer.lease(chain)
        slots = list(range(len(chain)))
        forged = RemoteLease(lease.lease_id, tuple(
            (h, slot, checksum ^ (i == 5)) for i, (h, slot, checksum) in
            enumerate(lease.blocks)), lease.expires)
        with pytest.raises(RemoteReadError, match="1 block.*position 5"):
            peer.read(forged, slots)
        assert local.check_readable(slots, chain)            # failures: nothing sealed
        assert peer.read(lease, slots) == [b[2] for b in lease.blocks]
        for slot, h in zip(slots, chain):
            assert local_bytes(local, slot) == payload_of(h, exporter.block_bytes).tobytes()
        peer.release(lease, wait=True)
    finally:
        importer.close()


def use_hashing(monkeypatch, hashing: str) -> None:
    """Pick how a verified read hashes: ``pipelined`` (batches handed over in C, the default
    where built), ``native`` (handed over in Python, hashed in C), ``python``."""
    import kvstrata.physical.checksum as checksum_module
    import kvstrata.remote.importer as importer_module

    if hashing == "pipelined":
        if checksum_module.BATCH_VERIFIER is None:
            pytest.skip("the native batch verifier is not built")
        return
    monkeypatch.setattr(checksum_module, "BATCH_VERIFIER", None)
    if hashing == "python":
        monkeypatch.setattr(importer_module, "native_range_checksums", lambda *a: None)
    elif importer_module.native_range_checksums(*[np.zeros(1, np.uint64)] * 2, 1) is None:
        pytest.skip("the native checksum path is not built")


@pytest.mark.parametrize("hashing", ["pipelined", "native"])
def test_a_verifying_thread_that_fails_is_a_read_error_not_a_pass(exporter, monkeypatch,
                                                                 hashing):
    import kvstrata.physical.checksum as checksum_module
    import kvstrata.remote.importer as importer_module

    monkeypatch.setattr(importer_module, "BATCH_BYTES", 1)
    use_hashing(monkeypatch, hashing)
    local = host_storage()
    importer = BlockSetImporter(local)
    try:
        peer = importer.connect(exporter.control)
        lease = peer.lease(exporter.chains[3])
        slots = list(range(len(lease.blocks)))
        calls = []
        if hashing == "pipelined":
            verify, report = checksum_module.BATCH_VERIFIER

            def failing_verify(*args):
                calls.append(args[7])
                if args[7] == 2:     # the last call, which waits for the verifying thread
                    raise MemoryError("injected")
                return verify(*args)

            monkeypatch.setattr(checksum_module, "BATCH_VERIFIER", (failing_verify, report))
        else:
            honest = importer._memory.checksums

            def failing(addresses, lengths, per_block):
                calls.append(addresses)
                if len(calls) == 3:
                    raise MemoryError("injected")
                return honest(addresses, lengths, per_block)

            monkeypatch.setattr(importer._memory, "checksums", failing)
        with pytest.raises(RemoteReadError, match="verifying.*MemoryError"):
            peer.read(lease, slots)
        assert local.check_readable(slots, lease.sequence_hashes)
        peer.release(lease, wait=True)
    finally:
        importer.close()
