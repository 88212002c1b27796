"""SGLang's host KV pool (HiCache's L2) as kvstrata's G1, without copying.

SGLang keeps a host pool's pages in one ``kv_buffer`` whose shape depends on the model and
the layout (``--hicache-mem-layout``):

* MHA: ``layer_first`` ``[2, layers, tokens, heads, dim]``; the page-major layouts
  (``page_first`` ``[2, tokens, layers, heads, dim]``, ``page_first_direct`` ``[2, pages,
  layers, page, heads, dim]``, ``page_head`` ``[2, pages, heads, page, layers, dim]``) keep
  all of a page's K (and all of its V) in one run of memory;
* MLA: ``layer_first`` ``[layers, tokens, 1, latent]``; page-major ``[tokens, layers, 1,
  latent]`` (and the other page-major ones): one run per page.

kvstrata moves a block as opaque runs of bytes, so each run is one "layer" of a block-page
layout (:func:`wrap_host_pool`): a page-major MHA pool is two runs per page (K, V), a
layer-first one two per layer, an MLA pool one per page or per layer. The bytes stored are the
pool's own, in its own order: the layout and the run sizes are part of the stored blocks'
compatibility fingerprint, so a pool of another layout never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import ModelGeometry
from ...physical.dtypes import dtype_name

__all__ = ["HostPoolView", "HostPoolError", "wrap_host_pool", "PAGE_MAJOR_LAYOUTS"]

PAGE_MAJOR_LAYOUTS = ("page_first", "page_first_direct", "page_head")
"""Layouts whose buffer holds each page's K (and V) in one run (MLA: its latent)."""

SIDE_BUFFERS = ("k_scale_host", "v_scale_host", "index_k_buffer", "index_k_scale_buffer",
                "index_k_with_scale_buffer")
"""Host pool attributes that hold part of a page outside ``kv_buffer`` (an MXFP8 pool's
scales, a sparse-attention indexer's keys): such a pool is refused, since storing
``kv_buffer`` alone would load pages without them."""


class HostPoolError(ValueError):
    """A host pool kvstrata cannot hold: its layout or buffer is not one it knows."""


@dataclass(frozen=True)
class HostPoolView:
    """The host pool as kvstrata sees it: ``runs`` (one tensor ``[pages, page, n]`` per run
    of a page's bytes), the block geometry they make, and the pool's page count and size."""

    runs: list[torch.Tensor]
    geometry: ModelGeometry
    page_size: int
    pages: int
    layout: str


def wrap_host_pool(host, is_mla: bool) -> HostPoolView:
    """Views of ``host.kv_buffer`` (an SGLang ``HostKVCache``: ``layout``, ``page_size``,
    ``size`` in tokens, ``kv_buffer``) as runs of whole pages; :class:`HostPoolError` if it
    cannot be held so. A ``HostPoolGroup`` stands for its anchor (KV) pool."""
    anchor = getattr(host, "anchor_entry", None)
    if anchor is not None:
        host = anchor.host_pool
    layout = getattr(host, "layout", None)
    page = getattr(host, "page_size", None)
    tokens = getattr(host, "size", None)
    buf = getattr(host, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or not _positive(page) or not _positive(tokens):
        raise HostPoolError(f"host pool {type(host).__name__} has no kv_buffer tensor, page "
                            f"size and size kvstrata can read")
    side = [a for a in SIDE_BUFFERS if getattr(host, a, None) is not None]
    tag = getattr(host, "storage_format_tag", None)
    if side or tag is not None:
        raise HostPoolError(f"host pool {type(host).__name__} keeps part of each page outside "
                            f"its kv_buffer ({', '.join(side) or f'format {tag!r}'}): not held "
                            f"by kvstrata yet")
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise HostPoolError(f"host pool buffer on {buf.device} (contiguous: "
                            f"{buf.is_contiguous()}): kvstrata holds a contiguous host buffer")
    if not is_mla and (buf.dim() < 3 or buf.shape[0] != 2):
        raise HostPoolError(f"an MHA host buffer starts with K and V (2), got shape "
                            f"{tuple(buf.shape)}; is the model MLA?")
    if layout == "layer_first":
        regions = list(buf) if is_mla else [buf[kv, layer] for layer in range(buf.shape[1])
                                            for kv in range(2)]
    elif layout in PAGE_MAJOR_LAYOUTS:
        regions = [buf] if is_mla else [buf[0], buf[1]]
    else:
        raise HostPoolError(f"host pool layout {layout!r} is not one kvstrata holds (it holds "
                            f"layer_first, {', '.join(PAGE_MAJOR_LAYOUTS)})")
    if tokens % page or regions[0].numel() % tokens:
        raise HostPoolError(f"host pool of {tokens} tokens in runs of {regions[0].numel()} "
                            f"elements is not whole pages of {page} tokens")
    pages, per_token = tokens // page, regions[0].numel() // tokens
    runs = [r.view(pages, page, per_token) for r in regions]
    geometry = ModelGeometry(num_layers=len(runs), kv_heads=1, head_dim=per_token,
                             dtype=dtype_name(buf.dtype), outer_dim=1)
    return HostPoolView(runs, geometry, page, pages, layout)


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
