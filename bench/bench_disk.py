"""G2 <-> G3 through the TransferEngine vs a raw O_DIRECT ``os.pwritev``/``os.preadv`` loop.

Both sides move the same 2 MiB blocks between page-aligned host memory and the same
preallocated slab file, at the same offsets. Ours adds what the data path really does:
plan handling, coalescing runs of slots, xxh3-64 of every block written, and verification of
every block read. Goal: >= 80 % of the raw loop. Prints ratios, never asserts timing.
Usage: ``python bench/bench_disk.py [--quick] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from kvstrata.physical import (DiskStorage, HostStorage, LayoutConfig, TransferEngine,
                               TransferPlan)
from kvstrata.physical.buffers import AlignedBuffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    parser.add_argument("--dir", default=None, help="directory for the slab (default: a temp dir)")
    args = parser.parse_args()
    batch, pool, reps = (16, 64, 3) if args.quick else (64, 256, 5)   # blocks of 2 MiB
    cfg = LayoutConfig(num_blocks=pool, num_layers=32, outer_dim=2, page_size=16,
                       inner_dim=1024, dtype="bf16", alignment=4096)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        host = HostStorage(cfg)
        host.memory.regions[0].random_(0, 256)
        disk = DiskStorage(cfg, tmp, o_direct=None)
        status = disk.status()
        print(f"slab {status.path}  o_direct={status.o_direct}  {list(status.notes)}")
        ids = list(range(pool))
        host.seal(ids, ids)                       # host blocks are valid sources
        stride = disk.layout.block_stride
        raw_buf = AlignedBuffer(batch * stride)
        raw_buf.array[:] = host.memory.regions[0].numpy()[:batch * stride]
        flags = os.O_RDWR | (os.O_DIRECT if status.o_direct else 0)
        raw_fd = os.open(disk.path, flags)
        rng = random.Random(0)
        views = [raw_buf.array[i * stride:(i + 1) * stride] for i in range(batch)]

        def raw(write: bool, slots):
            for view, slot in zip(views, slots):
                (os.pwritev if write else os.preadv)(raw_fd, [view], slot * stride)

        t = {"raw_w": [], "raw_r": [], "ours_w": [], "ours_r": []}
        with TransferEngine({"G2": host, "G3": disk}) as engine:
            for rep in range(reps + 1):
                src = rng.sample(ids, batch)
                slots = rng.sample(ids, batch)
                seq = src
                for key, fn in (
                        ("raw_w", lambda: raw(True, slots)),
                        ("ours_w", lambda: engine.submit(
                            TransferPlan("G2->G3", src, slots, seq)).result()),
                        ("raw_r", lambda: raw(False, slots)),
                        ("ours_r", lambda: engine.submit(
                            TransferPlan("G3->G2", slots, src, seq)).result())):
                    start = time.perf_counter()
                    out = fn()
                    elapsed = time.perf_counter() - start
                    if out is not None:
                        assert out.all_ok, out.failures[:1]
                    if rep:                    # first round is warm-up
                        t[key].append(elapsed)
        os.close(raw_fd)
        disk.close()
    nbytes = batch * cfg.block_bytes
    gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in t.items()}
    print(f"batch {batch} x 2 MiB, {reps} reps (median), GB/s:")
    print(f"  write G2->G3: ours {gbs['ours_w']:.2f}  raw {gbs['raw_w']:.2f}  "
          f"ratio {gbs['ours_w'] / gbs['raw_w']:.2f}")
    print(f"  read  G3->G2: ours {gbs['ours_r']:.2f}  raw {gbs['raw_r']:.2f}  "
          f"ratio {gbs['ours_r'] / gbs['raw_r']:.2f}")
    ours = 2 / (1 / gbs["ours_w"] + 1 / gbs["ours_r"])
    base = 2 / (1 / gbs["raw_w"] + 1 / gbs["raw_r"])
    print(f"RESULT name=disk_g2_g3_2MiB ours={ours:.2f}GB/s baseline={base:.2f}GB/s "
          f"ratio={ours / base:.2f}")


if __name__ == "__main__":
    main()
