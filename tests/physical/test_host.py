"""Host (G2) storage: allocation, status, typed views, integrity protocol."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvstrata.physical.dtypes import torch_dtype
from kvstrata.physical import FailureKind, HostStorage, StorageClosedError, StorageConfigError
from kvstrata.physical.buffers import PAGE_SIZE

from .conftest import fill_random, small_config


def test_status_and_alignment():
    host = HostStorage(small_config(num_blocks=10, alignment=4096))
    status = host.status()
    assert (status.kind, status.blocks, status.pinned) == ("host", 10, torch.cuda.is_available())
    assert status.bytes == 10 * 4096 and status.block_bytes == host.config.block_bytes
    assert host.memory.regions[0].data_ptr() % PAGE_SIZE == 0
    assert host.block_array(3).ctypes.data == host.memory.regions[0].data_ptr() + 3 * 4096


def test_block_view_typed(dtype):
    host = HostStorage(small_config(dtype=dtype))
    view = host.block_view(2)
    assert view.dtype == torch_dtype(host.config.dtype) and tuple(view.shape) == (3, 2, 4, 8)
    fill_random([view])
    assert bytes(host.payload(2)) == view.contiguous().view(torch.uint8).numpy().tobytes()


def test_seal_and_check_readable():
    host = HostStorage(small_config(), verify_reads=True)
    fill_random([host.block_view(0), host.block_view(1)])
    host.begin_write([0, 1])
    sums = host.seal([0, 1], [100, 101])
    assert len(sums) == 2
    assert host.check_readable([0, 1], [100, 101]) == []
    assert host.check_readable([1], [999])[0].kind is FailureKind.HASH_MISMATCH
    assert host.check_readable([2], [5])[0].kind is FailureKind.NOT_WRITTEN
    host.payload(1)[5] ^= 1
    failures = host.check_readable([0, 1], [100, 101])
    assert [(f.position, f.kind) for f in failures] == [(1, FailureKind.CHECKSUM_MISMATCH)]
    assert host.check_readable([0, 1], [100, 101], verify=False) == []


def test_closed_storage_refuses_access():
    host = HostStorage(small_config())
    host.close()
    host.close()
    with pytest.raises(StorageClosedError):
        host.memory
    with pytest.raises(StorageClosedError):
        host.block_array(0)


def test_checksum_modes():
    assert not HostStorage(small_config()).eager_checksums                       # auto
    assert HostStorage(small_config(), verify_reads=True).eager_checksums         # auto
    assert HostStorage(small_config(), checksums="eager").eager_checksums
    assert not HostStorage(small_config(), checksums="deferred").eager_checksums
    with pytest.raises(StorageConfigError, match="checksums"):
        HostStorage(small_config(), checksums="sometimes")


def test_deferred_checksums_are_computed_on_first_need():
    host = HostStorage(small_config())
    fill_random([host.block_view(0), host.block_view(1)])
    host.begin_write([0, 1])
    assert host.seal([0, 1], [100, 101], defer=True) == [None, None]
    assert host.checksums.checksums_of([0, 1]) == [None, None]
    assert host.check_readable([0, 1], [100, 101]) == []       # identity still checked
    assert host.check_readable([0], [7])[0].kind is FailureKind.HASH_MISMATCH
    sums = host.ensure_checksums([0, 1])
    assert sums == [xxhash.xxh3_64_intdigest(host.payload(b)) for b in (0, 1)]
    assert host.checksums.checksums_of([0, 1]) == sums
    host.payload(1)[0] ^= 1                                     # now corruption is caught
    assert host.check_readable([1], [101], verify=True)[0].kind is FailureKind.CHECKSUM_MISMATCH


def test_verifying_a_deferred_block_records_its_checksum_first():
    host = HostStorage(small_config())
    fill_random([host.block_view(2)])
    host.begin_write([2])
    host.seal([2], [5], defer=True)
    assert host.check_readable([2], [5], verify=True) == []   # nothing to compare yet
    assert host.checksums.checksums_of([2]) == [xxhash.xxh3_64_intdigest(host.payload(2))]
    host.payload(2)[1] ^= 1
    assert host.check_readable([2], [5], verify=True)[0].kind is FailureKind.CHECKSUM_MISMATCH


def test_fill_ignores_slots_rewritten_since():
    host = HostStorage(small_config())
    host.seal([3], [9], defer=True)
    host.begin_write([3])
    host.seal([3], [10], defer=True)             # slot reused for another block
    host.checksums.fill([3], [1234], [9])        # late value for the old block: dropped
    assert host.checksums.checksums_of([3]) == [None]
