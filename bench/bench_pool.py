"""Pool lifecycle throughput: allocate + register + match + release, vs a bare dict-and-list pool.

Each round takes a batch of new blocks (a fresh chain, so the full pool must evict), fills and
registers them, releases them, then matches the same hashes and releases again: the life of
a prompt's blocks. The baseline does the same work with a free list, a hash dict and an
OrderedDict LRU and nothing else (no states, handles, events or invariants). Goals: >= 500K
blocks/s and >= 30 % of the baseline.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from _common import best_of, result_line

from kvstrata.logical.policy import make_eviction
from kvstrata.logical.pool import BlockPool
from kvstrata.logical.registry import BlockRecord
from kvstrata.tokens import chain_hashes


class BarePool:
    """The least a prefix cache can do: free list, hash -> slot, LRU of idle slots."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity))
        self.by_hash: dict[int, int] = {}
        self.hash_of = [0] * capacity
        self.refs = [0] * capacity
        self.idle: OrderedDict[int, None] = OrderedDict()

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.pop())
            else:
                slot, _ = self.idle.popitem(last=False)
                del self.by_hash[self.hash_of[slot]]
                out.append(slot)
        for slot in out:
            self.refs[slot] = 1
        return out

    def register(self, slots: list[int], hashes: list[int]) -> list[int]:
        for slot, h in zip(slots, hashes):
            self.by_hash[h] = slot
            self.hash_of[slot] = h
        return slots

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            slot = self.by_hash.get(h)
            if slot is None:
                break
            if self.refs[slot] == 0:
                del self.idle[slot]
            self.refs[slot] += 1
            out.append(slot)
        return out

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self.refs[slot] -= 1
            if self.refs[slot] == 0:
                self.idle[slot] = None


def make_batches(rounds: int, batch: int) -> list[list[BlockRecord]]:
    batches = []
    for r in range(rounds):
        locals_ = range(r * batch + 1, (r + 1) * batch + 1)
        seqs = chain_hashes(locals_)
        parents = [None, *seqs[:-1]]
        batches.append([BlockRecord(s, l, p, 16) for s, l, p in zip(seqs, locals_, parents)])
    return batches


def run_kvstrata(batches, pool: BlockPool) -> None:
    for records in batches:
        handle = pool.allocate(len(records))
        handle.apply_token_blocks(records)
        pool.register(handle).release()
        pool.match([r.sequence_hash for r in records]).release()


def run_bare(batches, pool: BarePool) -> None:
    for records in batches:
        hashes = [r.sequence_hash for r in records]
        pool.release(pool.register(pool.allocate(len(records)), hashes))
        pool.release(pool.match(hashes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32, help="blocks per allocate/match call")
    parser.add_argument("--blocks", type=int, default=400_000, help="blocks per run")
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    blocks = args.blocks // 8 if args.quick else args.blocks
    if args.quick:
        args.capacity //= 8  # keep the pool 8x smaller than the stream, so it evicts
    batches = make_batches(blocks // args.batch, args.batch)
    total = len(batches) * args.batch
    repeats = 3 if args.quick else 5
    # Pools are built outside the timed region: only the lifecycle is measured.
    t_bare = best_of(repeats, lambda pool: run_bare(batches, pool), lambda: BarePool(args.capacity))
    print(f"{total:,} blocks in batches of {args.batch}, pool of {args.capacity:,} (evicting), best of {repeats}")
    print(f"  bare dict-and-list pool           {total / t_bare:>12,.0f} blocks/s")
    for policy in ("lru", "default", "lfu"):
        t_ours = best_of(
            repeats,
            lambda pool: run_kvstrata(batches, pool),
            lambda: BlockPool("G1", args.capacity, 16, eviction=make_eviction(policy, args.capacity)),
        )
        print(f"  kvstrata BlockPool ({policy:<7})     {total / t_ours:>12,.0f} blocks/s")
        print(result_line(f"pool_lifecycle_{policy}", total / t_ours, total / t_bare, " blocks/s",
                          ">=500K and >=0.30"))


if __name__ == "__main__":
    main()
