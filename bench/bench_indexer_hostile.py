"""The indexer's cost under input a publisher with publish rights could send on purpose.

Two operations whose cost once grew with the whole index instead of with what they touch:

* linking a placeholder (a block stored before its parent, with children) under a node
  ``--depth`` blocks deep: the cycle check walked to the root each time;
* clearing a holder, or listing its hashes, after storing one block: the native core
  scanned every node record.

For each core (native, python) it prints the time per operation beside its baseline measured
in the same run (a link under a root-level node; removing the one block by hash) and the
ratio, which should stay near 1 whatever ``--depth``:

    .venv/bin/python bench/bench_indexer_hostile.py [--depth 300000] [--ops 1000]
"""

from __future__ import annotations

import argparse
import random
import time

from kvstrata.events.indexer import NATIVE_CORE, PrefixIndex
from kvstrata.events.model import ClearedEvent, RemovedEvent, StoredBlock, StoredEvent


def chain_of(index: PrefixIndex, rng: random.Random, depth: int) -> int:
    """A chain ``depth`` blocks deep for worker 1, stored from the root; its last hash."""
    parent = None
    for start in range(0, depth, 10_000):
        hashes = [rng.getrandbits(64) for _ in range(min(10_000, depth - start))]
        index.apply_event(1, StoredEvent(1, "G1", parent, 4,
                                         tuple(StoredBlock(h, h) for h in hashes)))
        parent = hashes[-1]
    return parent


def per_op(run, ops: int) -> float:
    start = time.perf_counter()
    run(ops)
    return (time.perf_counter() - start) / ops


def measure(native: bool, depth: int, ops: int) -> None:
    rng = random.Random(1)
    index = PrefixIndex(native=native)
    deep = chain_of(index, rng, depth)
    shallow = rng.getrandbits(64)
    index.apply_event(1, StoredEvent(1, "G1", None, 4, (StoredBlock(shallow, shallow),)))

    def links(under: int):
        def run(n: int) -> None:
            for _ in range(n):
                placeholder, kid = rng.getrandbits(64), rng.getrandbits(64)
                index.apply_event(2, StoredEvent(1, "G1", placeholder, 4,
                                                 (StoredBlock(kid, kid),)))
                index.apply_event(2, StoredEvent(1, "G1", under, 4,
                                                 (StoredBlock(placeholder, placeholder),)))
        return run

    def store_then(then):
        def run(n: int) -> None:
            for _ in range(n):
                h = rng.getrandbits(64)
                index.apply_event(9, StoredEvent(1, "G2", None, 4, (StoredBlock(h, h),)))
                then(h)
        return run

    def remove(h: int) -> None:
        index.apply_event(9, RemovedEvent(1, "G2", (h,)))

    def clear(_h: int) -> None:
        index.apply_event(9, ClearedEvent(1, "G2"))

    def listing(h: int) -> None:
        index.hashes_in(9, "G2")
        remove(h)

    core = "native" if native else "python"
    near, far = per_op(links(shallow), ops), per_op(links(deep), ops)
    print(f"RESULT {core} link under a node {depth:,} deep: {far * 1e6:.1f} us/op, under a "
          f"root-level node {near * 1e6:.1f} us/op, ratio {far / near:.2f}")
    removing = per_op(store_then(remove), ops)
    for name, then in (("clear", clear), ("list + remove", listing)):
        took = per_op(store_then(then), ops)
        print(f"RESULT {core} store 1 + {name} beside {depth:,} nodes: {took * 1e6:.1f} us/op, "
              f"store 1 + remove {removing * 1e6:.1f} us/op, ratio {took / removing:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=300_000)
    parser.add_argument("--ops", type=int, default=1000)
    args = parser.parse_args()
    for native in ([True] if NATIVE_CORE is not None else []) + [False]:
        measure(native, args.depth, args.ops)


if __name__ == "__main__":
    main()
