"""Checksums of memory ranges: the native path (one call, GIL let go) against xxhash over
the same bytes, for blocks of one range and of many; the importer's bounds check."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvstrata.physical.checksum import native_range_checksums

pytestmark = pytest.mark.skipif(
    native_range_checksums(np.zeros(0, np.uint64), np.zeros(0, np.uint64), 1) is None,
    reason="the native checksum path (kvstrata._tokenhash) is not built")


@pytest.mark.parametrize("per_block", [1, 2, 7])
def test_native_range_checksums_equal_xxh3_of_the_concatenated_ranges(per_block):
    rng = np.random.default_rng(per_block)
    memory = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    base = memory.ctypes.data
    blocks = 40
    starts = rng.integers(0, memory.size - 5000, blocks * per_block)
    lengths = rng.integers(0, 5000, blocks * per_block)          # empty ranges included
    lengths[::5] = 0
    sums = native_range_checksums((starts + base).astype(np.uint64),
                                  lengths.astype(np.uint64), per_block)
    expected = []
    for b in range(blocks):
        h = xxhash.xxh3_64()
        for r in range(b * per_block, (b + 1) * per_block):
            h.update(memory[starts[r]:starts[r] + lengths[r]].tobytes())
        expected.append(h.intdigest())
    assert sums.tolist() == expected


def test_inputs_it_cannot_take_fall_back_rather_than_guess():
    ok = np.zeros(4, np.uint64)
    assert native_range_checksums(ok, np.zeros(3, np.uint64), 1) is None      # sizes differ
    assert native_range_checksums(ok, ok, 3) is None                          # 4 % 3
    assert native_range_checksums(ok.astype(np.uint32), ok.astype(np.uint32), 1) is None
    assert native_range_checksums(ok, ok, 0) is None


def test_the_importer_refuses_to_hash_outside_its_registered_memory():
    from kvstrata.physical.storage.host import HostStorage
    from kvstrata.protocol.layout import LayoutConfig
    from kvstrata.protocol.layout_codec import SharedLayout
    from kvstrata.remote.importer import _LocalMemory

    storage = HostStorage(LayoutConfig(num_blocks=4, num_layers=2, outer_dim=2, page_size=16,
                                       inner_dim=64, dtype="bfloat16", alignment=4096))
    memory = _LocalMemory(SharedLayout(storage.layout, storage.descriptors()))
    region = storage.descriptors()[0]
    inside = [(region.address, 4096), (region.address + region.size - 100, 100)]
    addresses, lengths = memory.arrays(inside)
    assert memory.checksums(addresses, lengths, 1).tolist() == [memory.checksum([r])
                                                                for r in inside]
    assert memory.checksums(addresses, lengths, 2).tolist() == [memory.checksum(inside)]
    for bad in ([(region.address - 1, 10)], [(region.address + region.size - 100, 101)],
                [(region.address, 2**63)], [(0, 8)]):
        with pytest.raises(ValueError, match="outside the registered memory"):
            memory.arrays(bad)
