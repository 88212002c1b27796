"""Shared fixtures and helpers for the physical-layer tests."""

from __future__ import annotations

import errno

import numpy as np
import pytest
import torch

from kvstrata.physical import SUPPORTED_DTYPES, FileOps, LayoutConfig

DTYPES = [d for d in ("float16", "bfloat16", "float32", "float8_e4m3fn") if d in SUPPORTED_DTYPES]


def small_config(num_blocks: int = 16, dtype: str = "bfloat16", **kw) -> LayoutConfig:
    """A tiny geometry: 3 layers, K/V, 4 tokens x 8 elements (chunk = 32 elements)."""
    params = dict(num_blocks=num_blocks, num_layers=3, outer_dim=2, page_size=4, inner_dim=8,
                  dtype=dtype)
    params.update(kw)
    return LayoutConfig(**params)


def fill_random(tensors, seed: int = 0) -> None:
    """Fill tensors with random bytes (any dtype, incl. fp8: bytes, not values)."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def block_bytes_of(storage, block_id: int) -> torch.Tensor:
    """The payload bytes of one block of a memory storage (device or host) as uint8."""
    return storage.block_view(block_id).contiguous().view(torch.uint8).reshape(-1).clone()


class FaultyFileOps(FileOps):
    """Fault injection: raise ``OSError(err)`` for reads/writes touching byte ``offsets``."""

    def __init__(self, *, write_errno: int | None = None, read_errno: int | None = None,
                 fallocate_errno: int | None = None, fail_offsets: set[int] | None = None,
                 short_writes: bool = False) -> None:
        self.write_errno, self.read_errno = write_errno, read_errno
        self.fallocate_errno = fallocate_errno
        self.fail_offsets = fail_offsets
        self.short_writes = short_writes
        self.armed = True

    def _hits(self, buffers, offset: int) -> bool:
        if not self.armed:
            return False
        if self.fail_offsets is None:
            return True
        end = offset + sum(len(memoryview(b)) for b in buffers)
        return any(offset <= o < end for o in self.fail_offsets)

    def pwritev(self, fd, buffers, offset):
        if self.write_errno is not None and self._hits(buffers, offset):
            raise OSError(self.write_errno, errno.errorcode[self.write_errno])
        if self.short_writes and len(buffers) > 1:   # write only the first buffer
            return super().pwritev(fd, buffers[:1], offset)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd, buffers, offset):
        if self.read_errno is not None and self._hits(buffers, offset):
            raise OSError(self.read_errno, errno.errorcode[self.read_errno])
        return super().preadv(fd, buffers, offset)

    def fallocate(self, fd, offset, length):
        if self.fallocate_errno is not None:
            raise OSError(self.fallocate_errno, errno.errorcode[self.fallocate_errno])
        return super().fallocate(fd, offset, length)


@pytest.fixture(params=DTYPES)
def dtype(request) -> str:
    return request.param


def random_block_arrays(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
