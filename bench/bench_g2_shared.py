"""What loading from a G2 another rank writes (shared memory) costs, against loading from a
G2 of one's own.

An MLA model's latent is the same on every tensor-parallel rank, so a group keeps one G2:
the first rank writes it in a shared-memory file (``PublishedHostStorage``), the others map
it read-only and verify every block they load against the writer's seals
(``FollowedHostStorage``). This measures, in one run, G2 -> G1 loads of ``--batch`` random
blocks (into a G1 on the GPU where there is one, else on the CPU, as vLLM's CPU build has)
through the transfer engine:

* a plain copy of the same bytes (``torch`` ``copy_`` of one contiguous tensor): the
  hardware's figure;
* a rank loading from its own G2, verified (``verify_host_reads``, the connector's default);
* a rank loading from the writer's shared G2 (always verified);

and what the group's G2 takes in RAM: one G2 instead of one per rank. Prints ratios, never
asserts timing. Run: ``.venv/bin/python bench/bench_g2_shared.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_line  # noqa: E402

from kvstrata.physical import (DeviceStorage, HostStorage, LayoutConfig,  # noqa: E402
                               TransferEngine, TransferPlan)
from kvstrata.physical.storage.host_shared import (FollowedHostStorage,  # noqa: E402
                                                   PublishedHostStorage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61,
                        help="layers of a block (DeepSeek-V3: 61 layers of a 576-value bf16 "
                             "latent per token, 16 tokens a block: 1.07 MiB)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where G1 is (default: the GPU where there is one); the plain "
                             "copy is then host (pinned) -> device")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.batch, args.reps = 64, 16, 5
    cfg = LayoutConfig(num_blocks=args.blocks, num_layers=args.layers, outer_dim=1,
                       page_size=16, inner_dim=576, dtype="bf16", alignment=4096)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-g2-", dir=base) as directory:
        path = Path(directory) / "kvstrata-g2-bench"
        own = HostStorage(cfg, verify_reads=True)
        writer = PublishedHostStorage(cfg, path, verify_reads=True)
        reader = FollowedHostStorage(cfg, path)
        g1s = [DeviceStorage.allocate(cfg, device=args.device) for _ in range(3)]
        for g1 in g1s:
            for region in g1.memory.regions:
                region.random_(0, 256)
        seqs = [1000 + b for b in range(args.blocks)]
        everything = list(range(args.blocks))
        engines = {"own": TransferEngine({"G1": g1s[0], "G2": own}),
                   "writer": TransferEngine({"G1": g1s[1], "G2": writer}),
                   "reader": TransferEngine({"G1": g1s[2], "G2": reader})}
        for name in ("own", "writer"):                      # fill both G2s from G1
            assert engines[name].submit(TransferPlan.for_path(
                "G1->G2", everything, everything, seqs, job_id=0)).result().all_ok
        nbytes = args.batch * cfg.block_bytes
        # the copy's bytes as far apart as the loads' (a window of a pool as big, in turn):
        # not the same few MB left in the cache by the run before
        src_t = torch.empty(args.blocks * cfg.block_bytes, dtype=torch.uint8,
                            pin_memory=args.device != "cpu").random_(0, 256)
        dst_t = torch.zeros_like(src_t, device=args.device)

        def sync() -> None:
            if args.device != "cpu":
                torch.cuda.synchronize()

        windows = args.blocks // args.batch
        rng = random.Random(0)
        best = {"copy": float("inf"), "own": float("inf"), "reader": float("inf")}
        for rep in range(args.reps + 1):                    # round 0 warms up
            slots = rng.sample(everything, args.batch)
            dest = rng.sample(everything, args.batch)
            plan = TransferPlan.for_path("G2->G1", slots, dest, [seqs[s] for s in slots],
                                         job_id=0)

            def load(name: str) -> None:
                assert engines[name].submit(plan).result().all_ok

            at = (rep % windows) * nbytes
            for key, fn in (("copy", lambda: dst_t[at:at + nbytes].copy_(src_t[at:at + nbytes])),
                            ("own", lambda: load("own")), ("reader", lambda: load("reader"))):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                if rep:
                    best[key] = min(best[key], time.perf_counter() - start)
        gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
        print(f"{args.blocks} blocks of {cfg.block_bytes >> 10} KiB, loads of {args.batch} "
              f"random blocks into G1 on {args.device}, best of {args.reps}, interleaved; "
              f"the writer's G2 in a memfd (pinned: own {own.pinned}, writer {writer.pinned}, "
              f"reader {reader.pinned})")
        print(f"  {'plain copy of the bytes':38s} {gbs['copy']:6.2f} GB/s")
        print(f"  {'load from its own G2 (verified)':38s} {gbs['own']:6.2f} GB/s "
              f"({gbs['own'] / gbs['copy']:.2f} of the copy)")
        print(f"  {'load from the shared G2 (verified)':38s} {gbs['reader']:6.2f} GB/s "
              f"({gbs['reader'] / gbs['copy']:.2f} of the copy, "
              f"{gbs['reader'] / gbs['own']:.2f} of its own G2)")
        print("  host RAM for G2 of a group of tp ranks: 1 G2 shared, tp G2s otherwise")
        print(result_line("g2_shared_load_MBps", gbs["reader"] * 1e3, gbs["own"] * 1e3,
                          " MB/s"))
        for engine in engines.values():
            engine.close()
        for storage in (reader, writer, own, *g1s):
            storage.close()


if __name__ == "__main__":
    main()
