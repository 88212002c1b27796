"""Host (G2) storage: allocation, status, typed views, integrity protocol."""

from __future__ import annotations

import pytest
import torch

from kvstrata.physical import FailureKind, HostStorage, StorageClosedError
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
    assert view.dtype == host.config.torch_dtype and tuple(view.shape) == (3, 2, 4, 8)
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
