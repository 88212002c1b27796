"""Block sets are validated before any byte moves: malformed, truncated, other-version,
overflowing and out-of-range block sets are typed errors; one whose blocks are laid out
differently from the importer's is refused by name of the difference."""

from __future__ import annotations

import base64
import json

import pytest

from kvstrata.protocol.layout import (FullyContiguousLayout, align_up, LayerSeparateLayout, LayerOrder,
                                      LayoutConfig)
from kvstrata.protocol.layout_codec import SharedLayout, StorageDescriptor
from kvstrata.remote.blockset import MAX_BYTES, BlockSet, byte_ranges, decode
from kvstrata.remote.errors import (BlockSetError, BlockSetFormatError, BlockSetMismatchError,
                                    BlockSetVersionError)

CFG = LayoutConfig(num_blocks=16, num_layers=4, outer_dim=2, page_size=16, inner_dim=128,
                   dtype="bfloat16", alignment=4096)
BASE = 0x7F00_0000_0000


def blockset(config=CFG, address=BASE, size=None, kind="host", **kw) -> BlockSet:
    layout = FullyContiguousLayout(config)
    size = layout.total_bytes if size is None else size
    fields = dict(name="worker-a", tier="G2", agent_metadata=b"\x01meta",
                  control="tcp://127.0.0.1:5555", fingerprint="fp")
    fields.update(kw)
    return BlockSet(shared=SharedLayout(layout, (StorageDescriptor(kind, size, address=address),)),
                    **fields)


def raw(bs: BlockSet | None = None) -> dict:
    return json.loads((bs or blockset()).encode())


def encoded(d: dict) -> bytes:
    return json.dumps(d).encode()


def test_round_trip_and_ranges():
    bs = blockset()
    back = decode(bs.encode())
    assert back == bs
    ranges = back.block_ranges([0, 3])
    stride = align_up(CFG.block_bytes, CFG.alignment)
    assert ranges == [(BASE, CFG.block_bytes), (BASE + 3 * stride, CFG.block_bytes)]


@pytest.mark.parametrize("mutate, error", [
    (lambda d: d.update(version=2), BlockSetVersionError),
    (lambda d: d.update(version=True), BlockSetVersionError),
    (lambda d: d["layout"].update(version=7), BlockSetVersionError),
    (lambda d: d.update(format="other"), BlockSetFormatError),
    (lambda d: d.pop("control"), BlockSetFormatError),
    (lambda d: d.update(extra=1), BlockSetFormatError),
    (lambda d: d.update(name=""), BlockSetFormatError),
    (lambda d: d.update(name="a" * 300), BlockSetFormatError),
    (lambda d: d.update(tier="G9"), BlockSetFormatError),
    (lambda d: d.update(control="http://x:1"), BlockSetFormatError),
    (lambda d: d.update(control="tcp://h:70000"), BlockSetFormatError),
    (lambda d: d.update(agent_metadata="not base64!"), BlockSetFormatError),
    (lambda d: d.update(agent_metadata=""), BlockSetFormatError),
    (lambda d: d.update(fingerprint=5), BlockSetFormatError),
    (lambda d: d["layout"]["regions"][0].update(size=10), BlockSetFormatError),       # too small
    (lambda d: d["layout"]["regions"][0].update(address=2**64 - 4096), BlockSetFormatError),
    (lambda d: d["layout"]["regions"][0].update(address=0), BlockSetFormatError),
    (lambda d: d["layout"]["regions"][0].update(address=-1), BlockSetFormatError),
    (lambda d: d["layout"]["regions"][0].update(memory_kind="disk", address=None, path="/x"),
     BlockSetFormatError),
    (lambda d: d["layout"]["layout"]["config"].update(num_blocks=2**62), BlockSetFormatError),
    (lambda d: d["layout"]["layout"]["config"].update(page_size=0), BlockSetFormatError),
    (lambda d: d["layout"].update(regions=[]), BlockSetFormatError),
])
def test_hostile_block_sets_are_typed_errors(mutate, error):
    d = raw()
    mutate(d)
    with pytest.raises(error):
        decode(encoded(d))


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[]", b"null", b"7",
                                  b"x" * (MAX_BYTES + 1),
                                  b"[" * min(MAX_BYTES, 200_000)])   # nested past the parser
def test_garbage_and_truncation_are_format_errors(data):
    with pytest.raises(BlockSetFormatError):
        decode(data)
    whole = blockset().encode()
    for cut in range(0, len(whole) - 1, max(1, len(whole) // 40)):
        with pytest.raises(BlockSetFormatError):
            decode(whole[:cut])


@pytest.mark.parametrize("field, value", [("page_size", 32), ("num_layers", 2),
                                          ("inner_dim", 64), ("dtype", "float16"),
                                          ("outer_dim", 1)])
def test_other_geometry_is_refused_before_any_byte_moves(field, value):
    bs = blockset()
    other = LayoutConfig(**{**CFG.to_dict(), field: value})
    with pytest.raises(BlockSetMismatchError, match=field):
        bs.require_compatible(FullyContiguousLayout(other))


def test_block_counts_alignment_and_layout_kind_may_differ_fingerprints_may_not():
    bs = blockset()
    bs.require_compatible(FullyContiguousLayout(LayoutConfig(**{**CFG.to_dict(),
                                                               "num_blocks": 3,
                                                               "alignment": 1})))
    bs.require_compatible(LayerSeparateLayout(CFG, LayerOrder.OUTER_CONTIGUOUS))
    bs.require_compatible(FullyContiguousLayout(CFG), fingerprint="fp")
    with pytest.raises(BlockSetMismatchError, match="made for"):
        bs.require_compatible(FullyContiguousLayout(CFG), fingerprint="other model")
    assert issubclass(BlockSetMismatchError, BlockSetError)


def test_ranges_stay_inside_the_exported_region():
    bs = blockset()
    region = bs.shared.regions[0]
    ranges = bs.block_ranges(list(range(CFG.num_blocks)))
    assert all(region.address <= a and a + n <= region.address + region.size for a, n in ranges)
    with pytest.raises(BlockSetFormatError):
        bs.block_ranges([CFG.num_blocks])
    with pytest.raises(BlockSetFormatError):
        bs.block_ranges([-1])


def test_layer_separate_pieces_pair_with_contiguous_ones():
    """A block's pieces in a LayerSeparate layout, in payload order, add up to the block."""
    layout = LayerSeparateLayout(CFG, LayerOrder.OUTER_CONTIGUOUS)
    regions = tuple(StorageDescriptor("host", layout.region_bytes(i), address=BASE + i * (1 << 30))
                    for i in range(layout.num_regions))
    pieces = byte_ranges(SharedLayout(layout, regions), [5])
    assert sum(n for _, n in pieces) == CFG.block_bytes
    assert len(pieces) == CFG.num_layers * CFG.outer_dim
    from kvstrata.protocol.layout import Granularity
    fine = blockset().block_ranges([5], Granularity.CHUNK)
    assert [n for _, n in fine] == [n for _, n in pieces]
    assert fine[0][0] + CFG.block_bytes == fine[-1][0] + fine[-1][1]
    assert base64.b64decode(raw()["agent_metadata"]) == b"\x01meta"
