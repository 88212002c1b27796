"""A process that stores KV blocks into a durable G3 as fast as it can, until it is killed.

Run as ``python writer.py DISK_DIR SEED``. Every block's payload is a function of its
sequence hash (:func:`payload_of`), so whoever recovers the tier can tell a right block from a
wrong one without knowing what was written. Small tiers make G3 overwrite its slots and
compact its index journal many times a second.
"""

from __future__ import annotations

import sys

import numpy as np

from kvstrata import KvBlockManager
from kvstrata.config import KvConfig, ModelGeometry, TierConfig
from kvstrata.logical.registry import BlockRecord
from kvstrata.tokens import hash_blocks

BLOCK_SIZE = 4


def crash_config() -> KvConfig:
    return KvConfig(block_size=BLOCK_SIZE,
                    tiers={"G1": TierConfig(blocks=16), "G2": TierConfig(blocks=16),
                           "G3": TierConfig(blocks=48)},
                    model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=64, dtype="fp16"))


def payload_of(sequence_hash: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(sequence_hash).integers(0, 256, nbytes, dtype=np.uint8)


def chain(index: int) -> list[BlockRecord]:
    tokens = [(index * 7919 + t) % 50_000 for t in range(4 * BLOCK_SIZE)]
    local, seqs = hash_blocks(tokens, BLOCK_SIZE)
    return [BlockRecord(s, l, p, BLOCK_SIZE) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


def main(disk_dir: str, seed: int) -> None:
    with KvBlockManager(crash_config(), disk_dir=disk_dir) as mgr:
        nbytes = mgr.storage("G1").config.block_bytes
        print("ready", flush=True)
        index = seed * 1_000_000
        while True:
            records = chain(index)
            index += 1
            blocks = mgr.allocate(len(records)).result(30)
            mgr.write_g1(blocks.block_ids, [payload_of(r.sequence_hash, nbytes) for r in records])
            blocks.apply_token_blocks(records)
            mgr.release(mgr.register(blocks).result(30)).result(30)
            mgr.wait_idle(30)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
