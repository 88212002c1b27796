"""Layouts: config validation, stride formulas, addressing, compatibility."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.physical import (FullyContiguousLayout, Granularity, LayerOrder,
                               LayerSeparateLayout, LayoutConfig, LayoutConfigError,
                               LayoutMismatchError)
from kvstrata.protocol.layout import align_up

from .conftest import DTYPES, small_config


def test_fully_contiguous_strides_follow_reference_formulas():
    cfg = LayoutConfig(num_blocks=4, num_layers=32, outer_dim=2, page_size=16, inner_dim=1024,
                       dtype="bf16", alignment=4096)
    layout = FullyContiguousLayout(cfg)
    assert layout.outer_stride == 16 * 1024 * 2
    assert layout.layer_stride == layout.outer_stride * 2
    assert layout.natural_block_stride == 32 * layout.layer_stride == 2 << 20   # 2 MiB
    assert layout.block_stride == align_up(layout.natural_block_stride, 4096)
    assert layout.region_bytes(0) == 4 * layout.block_stride
    assert layout.region_of(2, 3, 1) == (0, 2 * layout.block_stride + 3 * layout.layer_stride
                                         + layout.outer_stride, layout.outer_stride)


def test_alignment_pads_block_stride():
    cfg = small_config(num_blocks=3, alignment=1024)       # payload 3*2*4*8*2 = 384 bytes
    assert cfg.block_bytes == 384
    assert FullyContiguousLayout(cfg).block_stride == 1024


def test_layer_separate_orders():
    cfg = small_config(num_blocks=5)
    chunk = cfg.chunk_bytes
    outer = LayerSeparateLayout(cfg, LayerOrder.OUTER_CONTIGUOUS)
    assert outer.num_regions == 3 and outer.region_bytes(0) == 2 * 5 * chunk
    assert outer.region_of(4, 2, 1) == (2, (5 + 4) * chunk, chunk)
    assert outer.contiguous_granularity is Granularity.CHUNK
    block = LayerSeparateLayout(cfg, "block_contiguous")
    assert block.region_of(4, 2, 1) == (2, (4 * 2 + 1) * chunk, chunk)
    assert block.contiguous_granularity is Granularity.LAYER
    mla = LayerSeparateLayout(small_config(outer_dim=1), LayerOrder.OUTER_CONTIGUOUS)
    assert mla.contiguous_granularity is Granularity.LAYER


@pytest.mark.parametrize("field,value", [("num_blocks", 0), ("num_layers", -1),
                                         ("outer_dim", 3), ("page_size", 1.5),
                                         ("alignment", 3), ("dtype", "int8"),
                                         ("inner_dim", True)])
def test_invalid_config_rejected(field, value):
    with pytest.raises(LayoutConfigError, match=field if field != "dtype" else "dtype"):
        small_config(**{field: value})


def test_unknown_layer_order_rejected():
    with pytest.raises(LayoutConfigError, match="layer order"):
        LayerSeparateLayout(small_config(), "diagonal")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_aliases(dtype):
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
             "float8_e4m3fn": "fp8"}[dtype]
    assert small_config(dtype=short).dtype == dtype


def test_region_of_bounds_checked():
    layout = FullyContiguousLayout(small_config(num_blocks=2))
    with pytest.raises(IndexError):
        layout.region_of(2, 0, 0)
    with pytest.raises(IndexError):
        layout.pieces([0, 5], Granularity.BLOCK)


def test_mismatch_names_the_fields():
    a = FullyContiguousLayout(small_config())
    b = LayerSeparateLayout(small_config(num_blocks=99, page_size=8, dtype="fp32"))
    with pytest.raises(LayoutMismatchError, match="page_size.*dtype"):
        a.require_compatible(b)
    a.require_compatible(LayerSeparateLayout(small_config(num_blocks=99, alignment=64)))


def test_config_dict_round_trip():
    cfg = small_config(alignment=256, dtype="fp16")
    assert LayoutConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(LayoutConfigError, match="unknown keys"):
        LayoutConfig.from_dict({**cfg.to_dict(), "extra": 1})


layouts = st.builds(
    lambda nb, nl, od, ps, inner, align, kind: (
        FullyContiguousLayout if kind == "fc" else
        (lambda c: LayerSeparateLayout(c, kind)))(
        LayoutConfig(nb, nl, od, ps, inner, "fp16", align)),
    st.integers(1, 6), st.integers(1, 4), st.sampled_from([1, 2]), st.integers(1, 5),
    st.integers(1, 7), st.sampled_from([1, 2, 16, 512]),
    st.sampled_from(["fc", "outer_contiguous", "block_contiguous"]))


@settings(max_examples=150, deadline=None)
@given(layouts)
def test_chunks_never_overlap_and_stay_in_bounds(layout):
    cfg = layout.config
    seen: dict[int, list[tuple[int, int]]] = {}
    for b in range(cfg.num_blocks):
        for l in range(cfg.num_layers):
            for o in range(cfg.outer_dim):
                region, offset, length = layout.region_of(b, l, o)
                assert 0 <= offset and offset + length <= layout.region_bytes(region)
                seen.setdefault(region, []).append((offset, offset + length))
    for spans in seen.values():
        spans.sort()
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert e0 <= s1, "chunks overlap"


@settings(max_examples=100, deadline=None)
@given(layouts, st.data())
def test_pieces_agree_with_region_of(layout, data):
    cfg = layout.config
    ids = data.draw(st.lists(st.integers(0, cfg.num_blocks - 1), min_size=1, max_size=4))
    regions, offsets = layout.pieces(ids, Granularity.CHUNK)
    for i, b in enumerate(ids):
        for l in range(cfg.num_layers):
            for o in range(cfg.outer_dim):
                k = l * cfg.outer_dim + o
                assert (regions[i, k], offsets[i, k]) == layout.region_of(b, l, o)[:2]
    gran = layout.contiguous_granularity
    r, off = layout.pieces(ids, gran)
    assert r.shape == off.shape == (len(ids), {Granularity.BLOCK: 1,
                                               Granularity.LAYER: cfg.num_layers,
                                               Granularity.CHUNK: cfg.num_layers
                                               * cfg.outer_dim}[gran])
    assert np.all(off[:, 0] == offsets[:, 0])
