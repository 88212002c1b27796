"""Reading and writing the bytes of G1 blocks as flat payloads: what an engine's forward pass
writes, and what a test or the data replay compares.

A payload is ``block_bytes`` of uint8 in layer-major order (layer, K/V, tokens, elements),
whatever the G1 layout. CPU regions are written through numpy views (no copy); device regions
through one host-to-device copy per chunk. These run on the caller's thread (bytes, not pool
state); the pool checks they need are done by the caller (see ``KvBlockManager.write_g1``).
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..physical import DeviceStorage
from .errors import InvalidBlockError, ManagerClosedError

__all__ = ["G1Bytes"]


class G1Bytes:
    """Flat-payload access to the blocks of one device storage."""

    def __init__(self, storage: DeviceStorage) -> None:
        self.storage = storage
        layout, cfg = storage.layout, storage.config
        self.num_blocks = cfg.num_blocks
        self._regions = [r.numpy() if r.device.type == "cpu" else r
                         for r in storage.memory.regions]
        self._chunk = cfg.chunk_bytes
        spans: list[tuple[int, Callable[[int], int]]] = []
        for layer in range(cfg.num_layers):
            for outer in range(cfg.outer_dim):
                first = layout.region_of(0, layer, outer)
                step = (layout.region_of(1, layer, outer).offset - first.offset
                        if cfg.num_blocks > 1 else 0)
                spans.append((first.index, lambda b, o=first.offset, s=step: o + b * s))
        self._spans = spans
        self.block_bytes = len(spans) * self._chunk
        self._gate = threading.Condition()
        self._users = 0
        self._closed = False

    @contextlib.contextmanager
    def in_use(self, what: str) -> Iterator[None]:
        """Hold G1's memory open for one read or write (any number at once);
        ``ManagerClosedError`` once :meth:`close` began."""
        with self._gate:
            if self._closed:
                raise ManagerClosedError(f"{what}: the manager is closed")
            self._users += 1
        try:
            yield
        finally:
            with self._gate:
                self._users -= 1
                if not self._users:
                    self._gate.notify_all()

    def close(self) -> None:
        """Drop the views of G1's memory (they would keep it alive after the storage
        closed), once the reads and writes under way have ended."""
        with self._gate:
            self._closed = True
            while self._users:
                self._gate.wait()
            self._regions = []
            self.num_blocks = 0

    def check_ids(self, block_ids: Sequence[int], what: str) -> list[int]:
        """``block_ids`` as ints, each a G1 block id (``InvalidBlockError`` otherwise)."""
        ids = list(block_ids)
        for i, block_id in enumerate(ids):
            if isinstance(block_id, bool) or not isinstance(block_id, numbers.Integral) \
                    or not 0 <= block_id < self.num_blocks:
                raise InvalidBlockError(f"{what}: block_ids[{i}] = {block_id!r} is not a G1 "
                                        f"block id (0 <= id < {self.num_blocks})")
        return [int(b) for b in ids]

    def check_payloads(self, ids: Sequence[int], payloads: Sequence[np.ndarray], what: str
                       ) -> list[np.ndarray]:
        """Each payload as flat uint8 of exactly one block (``InvalidBlockError`` otherwise)."""
        payloads = list(payloads)
        if len(payloads) != len(ids):
            raise InvalidBlockError(f"{what}: {len(ids)} block ids but {len(payloads)} "
                                    f"payloads")
        flat = []
        for i, payload in enumerate(payloads):
            data = np.asarray(payload).reshape(-1).view(np.uint8)
            if data.size != self.block_bytes:
                raise InvalidBlockError(f"{what}: payload {i} (block {ids[i]}) has "
                                        f"{data.size} bytes, a block has {self.block_bytes}")
            flat.append(data)
        return flat

    def write(self, ids: Sequence[int], flat: Sequence[np.ndarray]) -> None:
        """Write checked payloads into checked block ids."""
        chunk = self._chunk
        for block_id, data in zip(ids, flat):
            for i, (region, offset_of) in enumerate(self._spans):
                start = offset_of(block_id)
                part = data[i * chunk:(i + 1) * chunk]
                dst = self._regions[region]
                if isinstance(dst, np.ndarray):
                    dst[start:start + chunk] = part
                else:   # device memory: one host-to-device copy
                    dst[start:start + chunk].copy_(torch.from_numpy(np.array(part)))

    def read(self, ids: Sequence[int]) -> list[np.ndarray]:
        """Copies of the payloads of checked block ids."""
        chunk = self._chunk
        out = []
        for block_id in ids:
            data = np.empty(self.block_bytes, dtype=np.uint8)
            for i, (region, offset_of) in enumerate(self._spans):
                start = offset_of(block_id)
                src = self._regions[region]
                part = src[start:start + chunk]
                data[i * chunk:(i + 1) * chunk] = (part if isinstance(src, np.ndarray)
                                                   else part.cpu().numpy())
            out.append(data)
        return out
