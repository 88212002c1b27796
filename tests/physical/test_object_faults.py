"""G4 fault injection without a real server: a misbehaving S3 endpoint (timeouts, stalls, 5xx,
throttling, resets, denial, no conditional PUT) and a client that outlives the batch deadline.
Every fault is a typed error at the client and an ``IO_ERROR`` per block in a batch: never a
hang, never bytes handed out."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstrata.physical import (BlockIOError, FailureKind, HostStorage, ObjectStorage,
                               StorageIOError, TransferEngine, TransferPlan)
from kvstrata.physical.storage.object_format import ObjectGeometry, encode_header
from kvstrata.physical.checksum import block_checksum
from kvstrata.physical.storage.s3client import (ObjectStoreRequestError,
                                                ObjectStoreTransientError, S3Client, S3Config)
from kvstrata.protocol import Endpoint

from .conftest import random_block_arrays, small_config
from .s3fault import FaultyS3

pytestmark = pytest.mark.timeout(60)

CFG = small_config(num_blocks=4)
BB = CFG.block_bytes
FP = "fp"
FAST = dict(connect_timeout=0.3, read_timeout=0.3, request_timeout=0.4, retries=1)
TRANSIENT = ["503", "500", "reset", "hang", "stall"]


def config_for(server: FaultyS3, **overrides) -> S3Config:
    return S3Config(endpoint_url=server.endpoint_url, bucket="bkt", access_key="a",
                    secret_key="b", **{**FAST, **overrides})


def storage_for(server: FaultyS3, **overrides) -> ObjectStorage:
    return ObjectStorage(CFG, config_for(server, **overrides), namespace="ns",
                         fingerprint=FP, max_concurrency=4, ensure_bucket=False)


@pytest.fixture(params=TRANSIENT)
def faulty(request):
    with FaultyS3(request.param) as server:
        yield server


def test_client_classifies_transient_faults(faulty):
    client = S3Client(config_for(faulty))
    start = time.monotonic()
    for call in (lambda: client.get("k"), lambda: client.put_if_absent("k", b"x"),
                 lambda: client.head("k"), lambda: list(client.list_keys("ns"))):
        try:
            call()
        except ObjectStoreTransientError:
            continue
        if faulty.mode == "stall":   # a HEAD or PUT may finish on the headers alone
            continue
        pytest.fail(f"{faulty.mode}: no transient error")
    assert time.monotonic() - start < 8.0


@pytest.mark.parametrize("mode, status", [("503", 503), ("500", 500)])
def test_transient_errors_carry_the_status(mode, status):
    with FaultyS3(mode) as server:
        with pytest.raises(ObjectStoreTransientError) as err:
            S3Client(config_for(server)).get("k")
        assert err.value.status == status
        assert server.requests == 2                       # one retry, then it gives up


def test_client_missing_and_denied():
    with FaultyS3("404") as server:
        client = S3Client(config_for(server))
        assert client.get("k") is None and client.head("k") is False
        assert client.exists(["a", "b"]) == [False, False]
        client.delete("k")
    with FaultyS3("403") as server:
        with pytest.raises(ObjectStoreRequestError):
            S3Client(config_for(server)).get("k")


def test_conditional_put_falls_back_to_head_then_put():
    with FaultyS3("no-conditional") as server:
        client = S3Client(config_for(server))
        assert client.conditional_put is True
        assert client.put_if_absent("k", b"one") is True
        assert client.conditional_put is False            # remembered
        assert client.put_if_absent("k", b"two") is False
        assert bytes(client.get("k")) == b"one"
        store = storage_for(server)
        blocks = random_block_arrays(2, BB, seed=1)
        store.write_blocks(["a", "b"], blocks, [1, 2])
        store.write_blocks(["a", "b"], blocks, [1, 2])
        assert (store.counters.puts, store.counters.puts_skipped_existing) == (2, 2)
        out = [np.zeros(BB, np.uint8) for _ in range(2)]
        store.read_blocks(["a", "b"], out, [1, 2])
        assert all(np.array_equal(a, b) for a, b in zip(blocks, out))
        store.close()


def test_every_fault_is_an_io_error_per_block(faulty):
    store = storage_for(faulty)
    blocks = random_block_arrays(6, BB, seed=2)
    start = time.monotonic()
    with pytest.raises(StorageIOError) as err:
        store.write_blocks([f"k{i}" for i in range(6)], blocks, list(range(6)))
    if faulty.mode != "stall":     # a stalled reply to a PUT has no ETag: also an error
        assert [f.kind for f in err.value.failures] == [FailureKind.IO_ERROR] * 6
    assert err.value.checksums is not None and set(err.value.checksums) == {None}
    out = [np.full(BB, 7, np.uint8) for _ in range(6)]
    with pytest.raises(StorageIOError) as err:
        store.read_blocks([f"k{i}" for i in range(6)], out, list(range(6)))
    assert [f.position for f in err.value.failures] == list(range(6))
    assert {f.kind for f in err.value.failures} == {FailureKind.IO_ERROR}
    assert all((o == 7).all() for o in out)                 # no bytes handed out
    assert time.monotonic() - start < 15.0
    assert store.counters.failures == 12 and store.counters.gets == 0
    store.close()


def test_engine_reports_faults_per_block():
    with FaultyS3("503") as server:
        host = HostStorage(CFG.with_blocks(4))
        host.seal([0, 1], [5, 6], defer=True)
        store = storage_for(server)
        with TransferEngine({"G2": host, "G4": store}) as engine:
            plan = TransferPlan(1, Endpoint("G2"), Endpoint("G4"), [5, 6],
                                src_block_ids=[0, 1], dst_keys=["a", "b"])
            r = engine.submit(plan).result(30)
            assert r.ok == (False, False) and {f.kind for f in r.failures} == {
                FailureKind.IO_ERROR}
            plan = TransferPlan(2, Endpoint("G4"), Endpoint("G2"), [5, 6],
                                src_keys=["a", "b"], dst_block_ids=[2, 3])
            r = engine.submit(plan).result(30)
            assert r.ok == (False, False) and r.bytes_moved == 0
            assert host.checksums.get(2) is None and host.checksums.get(3) is None
        store.close()


class _SlowClient:
    """A client whose GETs and PUTs ignore every timeout and return late (valid objects):
    the batch deadline must fail them, and their late bytes must not reach the caller."""

    def __init__(self, delay: float) -> None:
        self.config = S3Config(**{**FAST, "retries": 0})
        self.delay = delay
        self.finished = threading.Event()
        self.geometry = ObjectGeometry.of(CFG)

    def get(self, key, *, max_bytes=None):
        time.sleep(self.delay)
        payload = bytes(range(256)) * (BB // 256)
        data = encode_header(fingerprint=FP, geometry=self.geometry, sequence_hash=1,
                             checksum=block_checksum(payload)) + payload
        self.finished.set()
        return data

    def put_if_absent(self, key, body):
        time.sleep(self.delay)
        self.finished.set()
        return True

    def head(self, key):
        return False


def test_batch_deadline_bounds_a_stuck_client():
    client = _SlowClient(delay=3.0)
    store = ObjectStorage(CFG, client, namespace="ns", fingerprint=FP, max_concurrency=2,
                          ensure_bucket=False)
    out = np.full(BB, 9, np.uint8)
    start = time.monotonic()
    with pytest.raises(StorageIOError) as err:
        store.read_blocks(["k"], [out], [1])
    took = time.monotonic() - start
    assert 1.0 < took < 2.9                                   # the deadline, not the client
    assert err.value.failures[0].kind is FailureKind.IO_ERROR
    assert "deadline" in err.value.failures[0].detail
    assert client.finished.wait(5)
    time.sleep(0.1)
    assert (out == 9).all()                                   # the late reply was dropped
    store.close()


class _BrokenClient(_SlowClient):
    def get(self, key, *, max_bytes=None):
        raise RuntimeError("bug in a client")


def test_unexpected_client_exception_is_internal():
    store = ObjectStorage(CFG, _BrokenClient(0), namespace="ns", fingerprint=FP,
                          ensure_bucket=False)
    with pytest.raises(BlockIOError) as err:
        store.read_blocks(["k"], [np.zeros(BB, np.uint8)], [1])
    assert err.value.failures[0].kind is FailureKind.INTERNAL
    store.close()


def test_config_is_validated():
    from kvstrata.physical import StorageConfigError
    for bad in (dict(bucket=""), dict(endpoint_url="ftp://x"), dict(request_timeout=0),
                dict(retries=-1), dict(retries=True)):
        with pytest.raises(StorageConfigError):
            S3Config(**bad)
    with FaultyS3("404") as server:
        for kw in (dict(namespace="a//b"), dict(namespace=""), dict(fingerprint="x" * 65),
                   dict(max_concurrency=0)):
            args = dict(namespace="ns", fingerprint=FP, ensure_bucket=False)
            args.update(kw)
            with pytest.raises(StorageConfigError):
                ObjectStorage(CFG, config_for(server), **args)
