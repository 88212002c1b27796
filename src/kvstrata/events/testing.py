"""Helpers for tests and benchmarks of the event plane (synthetic chains, random registry traffic)."""

from __future__ import annotations

import random

from kvstrata.tiers import TIER_NAMES
from kvstrata.types import BlockRecord


def chain(seed: int, n: int, block_size: int = 16, parent: int | None = None, tokens: bool = False) -> list[BlockRecord]:
    """``n`` linked records with deterministic pseudo-random 64-bit hashes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        seq = rng.getrandbits(64)
        local = rng.getrandbits(64)
        toks = tuple(rng.randrange(1000) for _ in range(block_size)) if tokens else None
        out.append(BlockRecord(seq, local, parent, block_size, toks))
        parent = seq
    return out


def random_ops(registry, rng: random.Random, steps: int, tiers=TIER_NAMES[:3]) -> None:
    """Drive ``registry`` with a random mix of stores, removes and clears per tier."""
    pool = [chain(s, 6) for s in range(20)]
    for _ in range(steps):
        tier = rng.choice(tiers)
        op = rng.random()
        if op < 0.55:
            c = rng.choice(pool)
            start = rng.randrange(len(c))
            registry.record_stored(tier, c[start : start + rng.randrange(1, 4)])
        elif op < 0.95:
            held = sorted(registry.hashes_in(tier))
            if held:
                victims = rng.sample(held, min(rng.randrange(1, 4), len(held)))
                registry.record_removed(tier, victims)
        else:
            registry.record_cleared(tier, registry.hashes_in(tier))


def registry_state(registry, tiers=TIER_NAMES) -> dict[str, set[int]]:
    return {t: registry.hashes_in(t) for t in tiers}
