"""Helpers for the hostile tests: crafted index journals, small geometries, fd counting."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.physical import DiskStorage, LayoutConfig
from kvstrata.physical.buffers import AlignedBuffer
from kvstrata.physical.storage import disk_index as di

FP = "0123456789abcdef"
OTHER_FP = "fedcba9876543210"
BS = 4
PUT, FREE = 1, 2


def layout(num_blocks: int = 16) -> LayoutConfig:
    return LayoutConfig(num_blocks=num_blocks, num_layers=3, outer_dim=2, page_size=4,
                        inner_dim=8, dtype="bfloat16")


def open_durable(directory, num_blocks: int = 16, fingerprint: str = FP, rank: int = 0,
                 **kw) -> DiskStorage:
    return DiskStorage.durable(layout(num_blocks), directory, fingerprint=fingerprint,
                               rank=rank, **kw)


def payload_of(seq: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seq % (1 << 63)).integers(0, 256, nbytes, dtype=np.uint8)


def blocks_for(disk: DiskStorage, seqs) -> tuple[AlignedBuffer, list[np.ndarray]]:
    """Aligned stride-sized buffers whose payloads are a function of their hash (the
    buffer that owns them comes first: keep it alive)."""
    stride = disk.layout.block_stride
    buf = AlignedBuffer(max(1, len(seqs)) * stride)
    views = []
    for i, s in enumerate(seqs):
        view = buf.array[i * stride:(i + 1) * stride]
        view[:disk.config.block_bytes] = payload_of(s, disk.config.block_bytes)
        views.append(view)
    return buf, views


def write(disk: DiskStorage, slots, seqs, parents=None) -> list[int]:
    _keep, views = blocks_for(disk, seqs)
    parents = parents if parents is not None else [None] + list(seqs[:-1])
    return disk.write_blocks(list(slots), views, list(seqs), parent_hashes=parents,
                             local_hashes=[s ^ 0xABCD for s in seqs])


def read_ok(disk: DiskStorage, slot: int, seq: int) -> bool:
    """True if the slot serves ``seq`` with exactly its bytes; False on a typed refusal.
    Wrong bytes served are an AssertionError."""
    from kvstrata.physical.errors import BlockIOError
    stride = disk.layout.block_stride
    buf = AlignedBuffer(stride)
    buf.array[:] = 0x5A
    try:
        disk.read_blocks([slot], [buf.array[:stride]], [seq])
    except BlockIOError:
        return False
    got = buf.array[:disk.config.block_bytes]
    assert np.array_equal(got, payload_of(seq, disk.config.block_bytes)), \
        f"slot {slot} served WRONG BYTES for {seq:#x}"
    return True


def record(op: int, slot: int, seq: int, parent: int | None = None, local: int = 0,
           checksum: int = 0, flags: int | None = None, pad: int = 0, tag: int = 0,
           seal: bytes = bytes(32)) -> bytes:
    """One journal record with a valid per-record xxh3 (what the writer would produce)."""
    if flags is None:
        flags = 1 if parent is not None else 0
    body = di._BODY.pack(op, flags, pad, slot, seq, parent or 0, local, checksum, tag, seal)
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def header(fingerprint: str = FP, stride: int = 4096, version: int = di.INDEX_VERSION,
           key_id: int = 0) -> bytes:
    raw = di._HEADER.pack(di._MAGIC, version, fingerprint.encode("ascii")[:16], stride, key_id,
                          0)
    return raw[:-8] + xxhash.xxh3_64_intdigest(raw[:-8]).to_bytes(8, "little")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_fd_count() -> int:
    """:func:`fd_count` once what earlier tests left to finalizers is collected: a leak
    check's baseline (files such garbage holds would close mid-check, one fewer after)."""
    import gc
    gc.collect()
    return fd_count()


def home_of(directory, fingerprint: str = FP, rank: int = 0) -> Path:
    return Path(directory) / f"kvstrata-g3-r{rank}-{fingerprint}"


def small_manager_config(g1=8, g2=8, g3=16, g4=0, **kw) -> KvConfig:
    tiers = {"G1": TierConfig(blocks=g1)}
    if g2:
        tiers["G2"] = TierConfig(blocks=g2)
    if g3:
        tiers["G3"] = TierConfig(blocks=g3)
    if g4:
        tiers["G4"] = TierConfig(blocks=g4)
    return KvConfig(block_size=BS, tiers=tiers,
                    model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype="fp16"),
                    **kw)
