"""The G4 on-object format: header round trip, and every damaged or foreign object refused."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, strategies as st

from kvstrata.physical.checksum import block_checksum
from kvstrata.physical.errors import FailureKind
from kvstrata.physical.storage.object_format import (
    FORMAT_VERSION, HEADER_SIZE, MAGIC, ForeignObjectError, ObjectCorruptError,
    ObjectFormatError, ObjectGeometry, ObjectMagicError, ObjectTruncatedError,
    ObjectVersionError, decode_header, encode_header, open_object)

from .conftest import small_config

GEOMETRY = ObjectGeometry.of(small_config())
FP = "model-abc/tp1/bf16"
SEQ = 0xFEDC_BA98_7654_3210


def make_object(payload: bytes | None = None, *, fingerprint: str = FP,
                geometry: ObjectGeometry = GEOMETRY, seq: int = SEQ) -> bytes:
    payload = os.urandom(geometry.block_bytes) if payload is None else payload
    return encode_header(fingerprint=fingerprint, geometry=geometry, sequence_hash=seq,
                         checksum=block_checksum(payload)) + payload


def opened(data: bytes) -> bytes:
    return bytes(open_object(data, fingerprint=FP, geometry=GEOMETRY, sequence_hash=SEQ)[1])


def test_round_trip():
    payload = os.urandom(GEOMETRY.block_bytes)
    data = make_object(payload)
    assert len(data) == HEADER_SIZE + GEOMETRY.block_bytes and data[:8] == MAGIC
    header = decode_header(data)
    assert (header.version, header.header_size, header.fingerprint) == (FORMAT_VERSION,
                                                                        HEADER_SIZE, FP)
    assert header.geometry == GEOMETRY and header.sequence_hash == SEQ
    assert header.checksum == block_checksum(payload)
    assert header.payload_length == GEOMETRY.block_bytes
    assert opened(data) == payload
    header, view = open_object(memoryview(data), fingerprint=FP, geometry=GEOMETRY,
                               sequence_hash=SEQ)
    assert isinstance(view, memoryview) and bytes(view) == payload


def test_longest_fingerprint_and_unicode():
    fp = "é" * 32                                   # 64 bytes of UTF-8
    data = make_object(fingerprint=fp)
    assert decode_header(data).fingerprint == fp
    with pytest.raises(ValueError, match="at most 64"):
        make_object(fingerprint=fp + "x")


@pytest.mark.parametrize("data, error", [
    (b"", ObjectMagicError), (b"garbage!" * 40, ObjectMagicError),
    (b"KVSTRAT", ObjectTruncatedError), (MAGIC, ObjectTruncatedError),
    (MAGIC + b"\x01\x00" + b"\0" * 300, ObjectVersionError),   # the unkeyed format
])
def test_bad_headers(data, error):
    with pytest.raises(error):
        decode_header(data)


def test_failure_kinds():
    """Not this block -> HASH_MISMATCH; this block damaged -> CHECKSUM_MISMATCH."""
    for cls in (ObjectMagicError, ObjectVersionError, ForeignObjectError):
        assert cls.failure_kind is FailureKind.HASH_MISMATCH
    for cls in (ObjectTruncatedError, ObjectCorruptError):
        assert cls.failure_kind is FailureKind.CHECKSUM_MISMATCH


def test_foreign_objects():
    with pytest.raises(ForeignObjectError, match="fingerprint"):
        opened(make_object(fingerprint="another-model"))
    other = ObjectGeometry.of(small_config(page_size=8, inner_dim=4))   # same block_bytes
    assert other.block_bytes == GEOMETRY.block_bytes
    with pytest.raises(ForeignObjectError, match="geometry"):
        opened(make_object(geometry=other))
    with pytest.raises(ForeignObjectError, match="geometry"):
        opened(make_object(geometry=ObjectGeometry.of(small_config(dtype="float16"))))
    with pytest.raises(ForeignObjectError, match="sequence hash"):
        opened(make_object(seq=SEQ + 1))


def test_damaged_objects():
    data = make_object()
    with pytest.raises(ObjectTruncatedError):
        opened(data[:-1])
    with pytest.raises(ObjectCorruptError, match="after its payload"):
        opened(data + b"\0")
    tampered = bytearray(data)
    tampered[HEADER_SIZE + 17] ^= 0x01
    with pytest.raises(ObjectCorruptError, match="xxh3"):
        opened(bytes(tampered))
    header = bytearray(data)
    header[120] ^= 0x80                              # inside the sequence hash field
    with pytest.raises(ObjectCorruptError, match="header"):
        opened(bytes(header))


def test_every_truncation_is_refused():
    data = make_object()
    for cut in range(len(data)):
        with pytest.raises(ObjectFormatError):
            opened(data[:cut])


@given(st.integers(0, HEADER_SIZE + GEOMETRY.block_bytes - 1), st.integers(1, 255))
def test_any_flipped_byte_is_refused(position, flip):
    data = bytearray(make_object(bytes(GEOMETRY.block_bytes)))
    data[position] ^= flip
    with pytest.raises(ObjectFormatError):
        opened(bytes(data))


@given(st.binary(max_size=HEADER_SIZE + 64))
def test_random_bytes_never_decode_as_a_block(data):
    with pytest.raises(ObjectFormatError):
        opened(data)
