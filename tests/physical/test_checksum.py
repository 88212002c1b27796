"""Checksum table: the record/invalidate/check protocol."""

from __future__ import annotations

import numpy as np
import xxhash

from kvstrata.physical import ChecksumTable, FailureKind, block_checksum


def test_block_checksum_is_xxh3_64_of_the_bytes():
    data = np.arange(1000, dtype=np.uint8)
    assert block_checksum(data) == xxhash.xxh3_64_intdigest(data.tobytes())


def test_table_protocol():
    table = ChecksumTable(4)
    data = np.ones(64, dtype=np.uint8)
    assert table.check_identity(0, 1, 7).kind is FailureKind.NOT_WRITTEN
    table.record(1, block_checksum(data), 7)
    assert table.check_identity(0, 1, 7) is None
    assert table.check_identity(0, 1, 8).kind is FailureKind.HASH_MISMATCH
    assert table.check_bytes(0, 1, data) is None
    data[3] ^= 0xFF
    assert table.check_bytes(0, 1, data).kind is FailureKind.CHECKSUM_MISMATCH
    table.invalidate([1])
    assert table.get(1) is None


def test_full_u64_sequence_hash_survives():
    table = ChecksumTable(1)
    table.record(0, 2**64 - 1, 2**64 - 2)
    assert table.get(0) == (2**64 - 1, 2**64 - 2)
