"""Device (G1) storage: wrapping engine KV tensors zero-copy, allocation, stand-in status."""

from __future__ import annotations

import pytest
import torch

from kvstrata.physical import DeviceStorage, LayerOrder, LayoutError

from .conftest import fill_random, small_config

NB, BS, H, D = 6, 4, 2, 8


def _vllm_caches(shape, layers=3, dtype=torch.bfloat16, permute=None):
    caches = {}
    for i in range(layers):
        t = torch.zeros(shape, dtype=dtype)
        if permute is not None:   # same logical shape, other physical order (HND)
            t = torch.zeros([shape[p] for p in permute], dtype=dtype).permute(
                *[permute.index(i) for i in range(len(shape))])
        caches[f"model.layers.{i}.self_attn"] = t
    return caches


@pytest.mark.parametrize("shape,order", [((2, NB, BS, H, D), LayerOrder.OUTER_CONTIGUOUS),
                                         ((NB, 2, BS, H, D), LayerOrder.BLOCK_CONTIGUOUS)])
def test_wrap_vllm_shapes_zero_copy(shape, order):
    caches = _vllm_caches(shape)
    dev = DeviceStorage.wrap(caches)
    cfg = dev.config
    assert (cfg.num_blocks, cfg.num_layers, cfg.outer_dim, cfg.page_size, cfg.inner_dim) == \
        (NB, 3, 2, BS, H * D)
    assert dev.layout.order is order and dev.names == list(caches)
    # zero-copy: writing through the engine tensor shows in our block view
    t = caches["model.layers.1.self_attn"]
    k_block = t[0, 4] if order is LayerOrder.OUTER_CONTIGUOUS else t[4, 0]
    v_block = t[1, 4] if order is LayerOrder.OUTER_CONTIGUOUS else t[4, 1]
    fill_random([k_block, v_block])
    view = dev.block_view(4)
    assert torch.equal(view[1, 0].view(torch.uint8), k_block.reshape(BS, H * D).view(torch.uint8))
    assert torch.equal(view[1, 1].view(torch.uint8), v_block.reshape(BS, H * D).view(torch.uint8))
    assert dev.memory.regions[1].data_ptr() == t.data_ptr()


def test_wrap_hnd_stride_order():
    dev = DeviceStorage.wrap(_vllm_caches((NB, 2, BS, H, D), permute=(0, 1, 3, 2, 4)))
    assert dev.layout.order is LayerOrder.BLOCK_CONTIGUOUS and dev.config.inner_dim == H * D


def test_wrap_mla():
    dev = DeviceStorage.wrap([torch.zeros(NB, BS, 64, dtype=torch.float16) for _ in range(2)])
    assert (dev.config.outer_dim, dev.config.inner_dim, dev.config.dtype) == (1, 64, "float16")


def test_wrap_ambiguous_needs_explicit_layout():
    caches = _vllm_caches((2, 2, BS, H, D))
    with pytest.raises(LayoutError, match="kv_layout"):
        DeviceStorage.wrap(caches)
    assert DeviceStorage.wrap(caches, kv_layout="block_contiguous").config.num_blocks == 2


@pytest.mark.parametrize("bad", [
    lambda: [torch.zeros(2, NB, BS, H, D), torch.zeros(2, NB + 1, BS, H, D)],
    lambda: [torch.zeros(2, NB, BS, H, D), torch.zeros(2, NB, BS, H, D, dtype=torch.float16)],
    lambda: [torch.zeros(2, NB, BS, H, D * 2)[..., :D]],        # page not contiguous
    lambda: [torch.zeros(3, NB, BS, H, D)],                     # no K/V dimension
    lambda: [torch.zeros(2, NB, BS, H, D, dtype=torch.int32)],  # unsupported dtype
    lambda: [],
])
def test_wrap_rejects_bad_tensors(bad):
    with pytest.raises(LayoutError):
        DeviceStorage.wrap(bad())


@pytest.mark.parametrize("kv_layout", ["outer_contiguous", "block_contiguous", "fully_contiguous"])
def test_allocate_stand_in(kv_layout):
    dev = DeviceStorage.allocate(small_config(), kv_layout=kv_layout, device="cpu")
    status = dev.status()
    assert status.stand_in and status.kind == "device" and status.device == "cpu"
    assert status.bytes == dev.layout.total_bytes
    assert dev.share()["layout"]["kind"] == dev.layout.kind
