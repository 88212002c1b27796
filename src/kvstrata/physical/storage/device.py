"""G1 device storage: the engine's KV tensors, wrapped zero-copy, or tensors we allocate.

* ``DeviceStorage.wrap(kv_caches)`` takes the engine's per-layer tensors (vLLM passes
  ``dict[layer_name, Tensor]`` to ``register_kv_caches``) and builds a
  :class:`~kvstrata.protocol.layout.LayerSeparateLayout` over them without copying:

  - ``[2, num_blocks, ...]`` → ``OUTER_CONTIGUOUS`` (e.g. vLLM FlashAttention),
  - ``[num_blocks, 2, ...]`` → ``BLOCK_CONTIGUOUS`` (e.g. vLLM FlashInfer),
  - 3-D ``[num_blocks, block_size, head_size]`` → MLA (``outer_dim`` 1);
  - ``kv_layout="block_page"``: any ``[num_blocks, ...]`` tensor whose block is one dense
    page per layer, moved as opaque bytes with ``outer_dim`` 1 (vLLM's CPU backend,
    ``[num_blocks, kv_heads, block_size, 2 * head_size]``, K rows before V rows per head).

  The trailing dimensions may be in any dense stride order (HND/NHD): a chunk is moved as
  opaque bytes. ``kv_layout`` overrides the guess (needed when ``num_blocks == 2``);
  ``page_size`` defaults to the first trailing dimension (vLLM's ``block_size``).
* ``DeviceStorage.allocate(config)`` allocates on ``device`` (CUDA when available, else CPU).

Without a GPU the tensors are CPU tensors and ``status().stand_in`` is ``True``: every code
path runs, but no device copy is measured.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ..buffers import AlignedBuffer
from ..dtypes import dtype_name, torch_dtype
from ..errors import LayoutError
from ...protocol.layout import (FullyContiguousLayout, LayerOrder, LayerSeparateLayout, Layout,
                      LayoutConfig)
from ...protocol.layout_codec import StorageDescriptor
from .base import BlockMemory, MemoryStorage, StorageStatus, byte_alias

__all__ = ["DeviceStorage"]

KV_LAYOUTS = ("auto", "outer_contiguous", "block_contiguous", "mla", "block_page")


class DeviceStorage(MemoryStorage):
    """Device KV memory (G1). Build with :meth:`wrap` or :meth:`allocate`."""

    kind = "device"

    def __init__(self, layout: Layout, tensors: Sequence[torch.Tensor],
                 names: Sequence[str] | None = None) -> None:
        """Low-level constructor: ``tensors`` hold the layout's regions in order (their memory
        must already match ``layout``). Prefer :meth:`wrap` / :meth:`allocate`."""
        regions = tuple(byte_alias(t, layout.region_bytes(i)) for i, t in enumerate(tensors))
        super().__init__(BlockMemory(layout, regions))
        self._tensors = list(tensors)
        self.names = list(names) if names is not None else [f"region{i}"
                                                            for i in range(len(tensors))]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def wrap(cls, kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *,
             kv_layout: str = "auto", page_size: int | None = None) -> "DeviceStorage":
        """Wrap per-layer KV tensors (in layer order) without copying."""
        if isinstance(kv_caches, Mapping):
            names, tensors = list(kv_caches.keys()), list(kv_caches.values())
        else:
            tensors = list(kv_caches)
            names = [f"layer{i}" for i in range(len(tensors))]
        if not tensors:
            raise LayoutError("no KV tensors to wrap")
        first = tensors[0]
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if (t.shape, t.stride(), t.dtype, t.device) != (first.shape, first.stride(),
                                                            first.dtype, first.device):
                raise LayoutError(f"{name}: shape/stride/dtype/device {tuple(t.shape)} "
                                  f"{t.stride()} {t.dtype} {t.device} differs from layer "
                                  f"{names[0]}'s {tuple(first.shape)} {first.stride()} "
                                  f"{first.dtype} {first.device}")
        config, order = _infer_config(first, len(tensors), kv_layout, page_size)
        return cls(LayerSeparateLayout(config, order), tensors, names)

    @classmethod
    def allocate(cls, config: LayoutConfig, *, device: torch.device | str | None = None,
                 kv_layout: str = "outer_contiguous") -> "DeviceStorage":
        """Allocate zeroed KV memory for ``config``; ``kv_layout`` is ``outer_contiguous``,
        ``block_contiguous`` or ``fully_contiguous``."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if kv_layout == "fully_contiguous":
            layout: Layout = FullyContiguousLayout(config)
        elif kv_layout in ("outer_contiguous", "block_contiguous"):
            layout = LayerSeparateLayout(config, kv_layout)
        else:
            raise LayoutError(f"kv_layout must be outer_contiguous, block_contiguous or "
                              f"fully_contiguous, got {kv_layout!r}")
        if torch.device(device).type == "cpu":
            # Stand-in memory: page-aligned, zeroed, pre-touched, transparent huge pages
            # (see buffers.AlignedBuffer); the tensor keeps its mmap alive.
            tensors = [AlignedBuffer(layout.region_bytes(i)).tensor
                       for i in range(layout.num_regions)]
        else:
            tensors = [torch.zeros(layout.region_bytes(i), dtype=torch.uint8, device=device)
                       for i in range(layout.num_regions)]
        return cls(layout, tensors)

    # ------------------------------------------------------------------ access
    @property
    def tensors(self) -> list[torch.Tensor]:
        """The wrapped (or allocated) tensors, one per region."""
        self._check_open()
        return self._tensors

    @property
    def device(self) -> torch.device:
        return self.memory.device

    def block_view(self, block_id: int) -> torch.Tensor:
        """A copy of block ``block_id`` as ``[num_layers, outer_dim, page_size, inner_dim]``
        (gathered from the layout, for tests and debugging)."""
        cfg = self.config
        out = torch.empty((cfg.num_layers, cfg.outer_dim, cfg.chunk_bytes), dtype=torch.uint8,
                          device=self.device)
        for layer in range(cfg.num_layers):
            for outer in range(cfg.outer_dim):
                region, offset, length = self.layout.region_of(block_id, layer, outer)
                out[layer, outer] = self.memory.regions[region][offset:offset + length]
        return out.view(torch_dtype(cfg.dtype)).view(cfg.num_layers, cfg.outer_dim, cfg.page_size,
                                              cfg.inner_dim)

    def status(self) -> StorageStatus:
        cfg = self.config
        stand_in = self.device.type != "cuda"
        return StorageStatus(kind=self.kind, blocks=cfg.num_blocks, block_bytes=cfg.block_bytes,
                             bytes=self.layout.total_bytes, stand_in=stand_in,
                             device=str(self.device),
                             notes=("CPU tensor standing in for device memory",)
                             if stand_in else ())

    def descriptors(self) -> tuple[StorageDescriptor, ...]:
        cuda = self.device.type == "cuda"
        return tuple(StorageDescriptor("device" if cuda else "host", r.numel(),
                                       address=r.data_ptr(),
                                       device_id=self.device.index if cuda else None)
                     for r in self.memory.regions)

    def close(self) -> None:
        """Drop references to the tensors (the engine still owns wrapped ones)."""
        if not self.closed:
            super().close()
            self._tensors = []


def _infer_config(t: torch.Tensor, num_layers: int, kv_layout: str,
                  page_size: int | None) -> tuple[LayoutConfig, LayerOrder]:
    if kv_layout not in KV_LAYOUTS:
        raise LayoutError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    shape = tuple(t.shape)
    if kv_layout == "auto":
        if t.dim() == 3:
            kv_layout = "mla"
        elif t.dim() >= 4 and shape[0] == 2 and shape[1] != 2:
            kv_layout = "outer_contiguous"
        elif t.dim() >= 4 and shape[1] == 2 and shape[0] != 2:
            kv_layout = "block_contiguous"
        else:
            raise LayoutError(f"cannot tell the KV layout of shape {shape}; pass kv_layout="
                              f"'outer_contiguous' | 'block_contiguous' | 'mla'")
    if kv_layout in ("mla", "block_page"):
        block_dim, outer_dim_index, outer_dim = 0, None, 1
    elif kv_layout == "outer_contiguous":
        block_dim, outer_dim_index, outer_dim = 1, 0, 2
    else:
        block_dim, outer_dim_index, outer_dim = 0, 1, 2
    if t.dim() < (2 if outer_dim_index is None else 3):
        raise LayoutError(f"KV tensor of shape {shape} has too few dimensions for {kv_layout}")
    if outer_dim_index is not None and shape[outer_dim_index] != 2:
        raise LayoutError(f"{kv_layout}: dimension {outer_dim_index} of {shape} must be 2 (K,V)")
    num_blocks = shape[block_dim]
    rest = [d for d in range(t.dim()) if d not in (block_dim, outer_dim_index)]
    chunk_elems = math.prod(shape[d] for d in rest)
    # The trailing dimensions must tile one chunk densely, in any stride order.
    expected = 1
    for d in sorted(rest, key=lambda d: t.stride(d)):
        if shape[d] != 1 and t.stride(d) != expected:
            raise LayoutError(f"KV tensor {shape} with strides {t.stride()}: a block's "
                              f"page is not contiguous (dimension {d})")
        expected *= shape[d]
    if kv_layout == "outer_contiguous":
        ok = t.stride(block_dim) == chunk_elems and t.stride(0) == num_blocks * chunk_elems
    elif kv_layout == "block_contiguous":
        ok = t.stride(1) == chunk_elems and t.stride(0) == 2 * chunk_elems
    else:                       # mla / block_page: one dense page per block
        ok = t.stride(0) == chunk_elems
    if not ok and num_blocks > 1:
        raise LayoutError(f"KV tensor {shape} with strides {t.stride()} is not a packed "
                          f"{kv_layout} layout")
    page = page_size if page_size is not None else shape[rest[0]]
    if page < 1 or chunk_elems % page:
        raise LayoutError(f"page_size {page} does not divide the {chunk_elems} elements of a page")
    config = LayoutConfig(num_blocks=num_blocks, num_layers=num_layers, outer_dim=outer_dim,
                          page_size=page, inner_dim=chunk_elems // page,
                          dtype=dtype_name(t.dtype))
    order = LayerOrder.BLOCK_CONTIGUOUS if kv_layout != "outer_contiguous" \
        else LayerOrder.OUTER_CONTIGUOUS
    return config, order
