"""What reading another rank's G3 in place costs, against that rank reading its own.

An MLA model's latent is stored once per tensor-parallel group: the first rank writes its
durable G3, the others follow it read-only (``DiskStorage.follow``). A follower's read first
takes in what the writer journaled since (a ``stat`` of the journal, and its new records),
then reads and verifies the blocks as the writer would. This measures, in one run, on one
slab of ``--blocks`` blocks of ``--block-kib`` KiB written by a writer:

* the writer reading batches of ``--batch`` random blocks from its own G3 (the baseline);
* a follower reading the same batches from the writer's G3;
* the follower again while the writer keeps writing (every batch read first takes in the
  records of the writes since the last one).

Reads are verified (xxh3 against the record) in every case; the page cache is not dropped (both read the same file the same way), so this is
the follower's overhead, not the disk's speed. Run: ``.venv/bin/python
bench/bench_g3_follow.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_of, result_line  # noqa: E402

from kvstrata.physical import DiskStorage, LayoutConfig  # noqa: E402

FINGERPRINT = "0123456789abcdef"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.repeats = 512, 3
    inner = args.block_kib * 1024 // (2 * 16 * 2)        # 1 layer, K/V, 16 tokens, bf16
    config = LayoutConfig(num_blocks=args.blocks, num_layers=1, outer_dim=2, page_size=16,
                          inner_dim=inner, dtype="bfloat16")
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-follow-") as directory:
        writer = DiskStorage.durable(config, directory, fingerprint=FINGERPRINT)
        stride = writer.layout.block_stride
        data = np.random.default_rng(0).integers(0, 256, args.batch * stride, dtype=np.uint8)
        views = [data[i * stride:(i + 1) * stride] for i in range(args.batch)]
        for first in range(0, args.blocks, args.batch):
            n = min(args.batch, args.blocks - first)
            seqs = list(range(first + 1, first + n + 1))
            writer.write_blocks(list(range(first, first + n)), views[:n], seqs,
                                parent_hashes=[None] * n, local_hashes=seqs)
        follower = DiskStorage.follow(config, directory, fingerprint=FINGERPRINT)
        rng = np.random.default_rng(1)
        batches = [rng.choice(args.blocks - 1, args.batch, replace=False).tolist()
                   for _ in range(16)]
        out = np.empty(args.batch * stride, dtype=np.uint8)
        dests = [out[i * stride:(i + 1) * stride] for i in range(args.batch)]
        moved = 16 * args.batch * config.block_bytes

        def read_all(disk) -> None:
            for slots in batches:
                disk.read_blocks(slots, dests, [s + 1 for s in slots])

        own = best_of(args.repeats, lambda: read_all(writer))
        followed = best_of(args.repeats, lambda: read_all(follower))
        spare = args.blocks - 1                     # a slot no batch reads, rewritten meanwhile

        def reads_while_written(repeat: int) -> float:
            """Seconds the follower's reads took, a write of the writer before each."""
            spent = 0.0
            for n, slots in enumerate(batches):
                seq = args.blocks + 1 + repeat * len(batches) + n
                writer.write_blocks([spare], views[:1], [seq], parent_hashes=[None],
                                    local_hashes=[seq])
                start = time.perf_counter()
                follower.read_blocks(slots, dests, [s + 1 for s in slots])
                spent += time.perf_counter() - start
            return spent

        busy = min(reads_while_written(r) for r in range(args.repeats))
        print(f"{args.blocks} blocks of {args.block_kib} KiB, {len(batches)} batches of "
              f"{args.batch} random blocks, best of {args.repeats}")
        for name, seconds in (("writer reads its own G3", own),
                              ("follower reads the writer's G3", followed),
                              ("follower, writer writing", busy)):
            print(f"  {name:34s} {moved / seconds / 1e9:6.2f} GB/s")
        print(result_line("g3_follow_read_MBps", moved / followed / 1e6, moved / own / 1e6,
                          " MB/s"))
        print(result_line("g3_follow_read_while_written_MBps",
                          moved / busy / 1e6, moved / own / 1e6, " MB/s"))
        follower.close()
        writer.close()


if __name__ == "__main__":
    main()
