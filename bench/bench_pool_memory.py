"""Pool metadata memory: bytes of RSS per registered block, and what an empty pool costs.

Each figure is measured in its own fresh subprocess (``--child``): the resident set size
(/proc/self/statm) just before the pool is made, and after N blocks were registered through
the public API (allocate, apply_token_blocks, register, release, in batches of 1,024; one
chain, so a leaf-first pool links every block to its parent) and a full garbage collection;
the difference over N is what each registered block costs: the pool's slot objects, its
hash index and eviction order, the shared ``BlockRegistry``'s map, the records it keeps.
Hashes are realistic 64-bit values (xxh3 of a counter), local hashes distinct from
sequence hashes.

The baseline, vLLM's v1 ``BlockPool`` in the same way: ``BlockPool(N + 1)`` (it makes every
slot's object up front), ``get_new_blocks`` + ``cache_full_blocks`` with 32-byte
``BlockHash`` values (the length of vLLM's sha256 hashes) + ``free_blocks``. Skipped with a
message where vLLM is absent.

A policy ``eviction+admission`` measures the tier's admission filter with it; one that
learns from requests (``default+predicted-reuse``) is shown and offered every block, then
as many fresh ones again four times over (its history fills up, as in a tier that has run a
while), so its tables count in full.

Also: an *empty* pool of ``--empty`` slots (default 10 million; kvstrata makes slots on
first use, vLLM up front). Goals: <= 150 B per registered block at 10 million blocks; an
empty 10-million-slot pool next to nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
HERE = Path(__file__).resolve()
BATCH = 1024
HISTORY_FILL = 5
"""A filter that learns from requests (``predicted-reuse``) is shown this many times the
tier's blocks in all, so its history table is touched throughout."""


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def child_kvstrata(policy: str, blocks: int, empty: bool) -> dict:
    import xxhash

    from kvstrata.logical.policy import make_tier_policies
    from kvstrata.logical.pool import BlockPool
    from kvstrata.logical.registry import BlockRegistry
    from kvstrata.types import BlockRecord

    xxh = xxhash.xxh3_64_intdigest
    eviction, _, admission = policy.partition("+")
    gc.collect()
    before = rss()
    policies = make_tier_policies(eviction, admission or "always", blocks)
    pool = BlockPool("G2", blocks, 16, eviction=policies.eviction, registry=BlockRegistry())
    learns = policies.admission.learns_from_requests    # (not the adaptive duel: as before)
    observe, admit = (policies.observe_request, policies.admission.admit) if learns else (None, None)
    if empty:
        gc.collect()
        return {"bytes": rss() - before}
    parent = None
    for start in range(0, blocks, BATCH):
        n = min(BATCH, blocks - start)
        records = []
        for i in range(start, start + n):
            seq = xxh(i.to_bytes(8, "little"))
            records.append(BlockRecord(seq, xxh(i.to_bytes(8, "little"), seed=1), parent, 16))
            parent = seq
        if observe is not None:       # a filter that learns: shown and offered each block
            observe([r.sequence_hash for r in records])
            for r in records:
                admit(r.sequence_hash)
        handle = pool.allocate(n)
        handle.apply_token_blocks(records)
        pool.release(pool.register(handle))
    del records, handle
    if observe is not None:           # a tier that has run a while: its history is full
        for start in range(blocks, HISTORY_FILL * blocks, BATCH):
            hashes = [xxh(i.to_bytes(8, "little")) for i in range(start, start + BATCH)]
            observe(hashes)
            for h in hashes:
                admit(h)
    gc.collect()
    assert pool.status().inactive == blocks
    return {"bytes": rss() - before}


def child_vllm(blocks: int, empty: bool) -> dict:
    import random

    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    class Req:
        __slots__ = ("block_hashes",)

        def __init__(self, block_hashes):
            self.block_hashes = block_hashes

    rng = random.Random(0)
    gc.collect()
    before = rss()
    pool = VllmBlockPool(blocks + 1, enable_caching=True, hash_block_size=16)
    if empty:
        gc.collect()
        return {"bytes": rss() - before}
    for start in range(0, blocks, BATCH):
        n = min(BATCH, blocks - start)
        hashes = [rng.randbytes(32) for _ in range(n)]
        new = pool.get_new_blocks(n)
        pool.cache_full_blocks(Req(hashes), new, 0, n, 16, 0)
        pool.free_blocks(new)
    del hashes, new
    gc.collect()
    return {"bytes": rss() - before}


def run_child(*args: str) -> dict | str:
    src = HERE.parent.parent / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(HERE), "--child", *args], capture_output=True,
                         text=True, env=env, timeout=1800)
    if out.returncode != 0:
        return out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", default="1000000,10000000",
                        help="registered-block counts, comma-separated")
    parser.add_argument("--policies", default="default,lru,lfu,default+predicted-reuse")
    parser.add_argument("--empty", type=int, default=10_000_000, help="slots of the empty pool")
    parser.add_argument("--quick", action="store_true", help="100,000 blocks only")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, policy, n, empty = args.child[0], args.child[1], int(args.child[2]), args.child[3] == "1"
        got = child_vllm(n, empty) if kind == "vllm" else child_kvstrata(policy, n, empty)
        print(json.dumps(got))
        return
    counts = [100_000] if args.quick else [int(x) for x in args.blocks.split(",")]
    policies = args.policies.split(",")
    print("RSS growth per registered block, each in its own process:")
    for n in counts:
        base = run_child("vllm", "-", str(n), "0")
        if isinstance(base, str):
            print(f"  vLLM BlockPool: skipped ({base})")
            base_b = None
        else:
            base_b = base["bytes"] / n
            print(f"  {n:>11,} blocks  vLLM v1 BlockPool, 32-byte hashes  {base_b:7.0f} B/block")
        for policy in policies:
            got = run_child("kvstrata", policy, str(n), "0")
            if isinstance(got, str):
                print(f"  {n:>11,} blocks  kvstrata ({policy}): failed: {got}")
                continue
            ours = got["bytes"] / n
            ratio = f"  {ours / base_b:4.2f}x vLLM's" if base_b else ""
            print(f"  {n:>11,} blocks  kvstrata BlockPool ({policy:<24}) {ours:7.0f} B/block{ratio}")
            if base_b:
                print(f"RESULT name=pool_bytes_per_block_{policy}_{n} ours={ours:.0f}B "
                      f"baseline={base_b:.0f}B ratio={ours / base_b:.2f} goal=<=150B")
    print(f"Empty pool of {args.empty:,} slots:")
    base = run_child("vllm", "-", str(args.empty), "1")
    if not isinstance(base, str):
        print(f"  vLLM v1 BlockPool                   {base['bytes'] / 2**20:9.1f} MiB")
    for policy in policies:
        got = run_child("kvstrata", policy, str(args.empty), "1")
        if not isinstance(got, str):
            print(f"  kvstrata BlockPool ({policy:<24}) {got['bytes'] / 2**20:9.1f} MiB")
            if not isinstance(base, str):
                print(f"RESULT name=pool_empty_{policy}_{args.empty} ours={got['bytes'] / 2**20:.1f}MiB "
                      f"baseline={base['bytes'] / 2**20:.1f}MiB goal=next-to-nothing")


if __name__ == "__main__":
    main()
