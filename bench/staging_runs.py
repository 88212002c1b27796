"""How long the runs of consecutive G2 slots are in the G1 <-> G2 plans of a replay, which
decides what the GPU's ``staged`` transport costs (CPU only: it measures slot ids, no copy).

The staged transport (``kvstrata.physical.device_staging``) moves each run of consecutive G2
slots of a slice as one DMA copy; ``auto`` stages a slice whose runs average at least
``staged_run_bytes`` (512 KiB) and leaves the rest to the copy kernel. Which slots a plan
names is the pool's doing: it hands out slots it freed together last-freed first, and a
returning prefix comes back in request order. This runs ``kvstrata replay --data`` (real
bytes through ``KvBlockManager``, default tiers and geometry) on the packaged trace (or
``--trace``), records every G1 -> G2 and G2 -> G1 plan, and prints, per path:

* blocks per DMA copy with the staging buffer in batch order (before 2026-11-28) and in slot
  order (:func:`~kvstrata.physical.device_staging.staging_order`, now), slice by slice as
  ``DeviceCopyEngine`` cuts a batch (``--slice-mib``);
* for each block size in ``--block-kib``, the share of the bytes ``auto`` would stage in
  each order.

The replay runs once, at the data replay's own geometry (128 KiB blocks, no ``KVSTRATA_*``
setting from the environment), one request at a time; its slot lists are then cut into
slices as for each block size. Another block size or concurrent requests give the pool other
slot patterns: this is the single-stream case.

Usage: ``python bench/staging_runs.py [--limit N] [--trace FILE] [--block-kib 64,2048]``.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np

from kvstrata.config import load_config
from kvstrata.data_replay import run_data_replay
from kvstrata.physical import TransferEngine
from kvstrata.physical.device_copy import slice_bounds
from kvstrata.physical.device_staging import host_runs, staged_runs
from kvstrata.trace import load_trace

PATHS = ("G1->G2", "G2->G1")


def record_plans(limit: int, trace: str | None) -> dict[str, list[np.ndarray]]:
    """The G2 slots of every G1 <-> G2 plan of ``kvstrata replay --data --limit N``'s run."""
    plans: dict[str, list[np.ndarray]] = defaultdict(list)
    submit = TransferEngine.submit

    def observed(engine, plan, *args, **kwargs):
        path = f"{plan.source.tier}->{plan.target.tier}"
        if path in PATHS:
            slots = plan.dst_block_ids if path == "G1->G2" else plan.src_block_ids
            plans[path].append(np.asarray(slots, dtype=np.int64))
        return submit(engine, plan, *args, **kwargs)

    TransferEngine.submit = observed          # for this replay only
    try:
        run_data_replay(load_trace(trace)[:limit], load_config(None, env={}), verify="none")
    finally:
        TransferEngine.submit = submit
    return plans


def measure(plans: list[np.ndarray], block_bytes: int, slice_bytes: int,
            staged_run_bytes: int) -> dict:
    """Blocks per DMA copy and the share of bytes ``auto`` stages, in batch and slot order."""
    blocks = copies_batch = copies_slot = staged_batch = staged_slot = 0
    for slots in plans:
        for lo, hi in slice_bounds(slots.size, block_bytes, slice_bytes):
            part = slots[lo:hi]
            blocks += part.size
            batch_runs = host_runs(part, 1, 1)[0].size
            copies_batch += batch_runs
            if part.size * block_bytes >= staged_run_bytes * batch_runs:
                staged_batch += part.size
            staging = staged_runs(part, 1, 1)
            copies_slot += staging[1][0].size
            if staged_runs(part, block_bytes, block_bytes, staged_run_bytes) is not None:
                staged_slot += part.size
    return {"plans": len(plans), "blocks": blocks,
            "blocks_per_copy_batch_order": blocks / max(1, copies_batch),
            "blocks_per_copy_slot_order": blocks / max(1, copies_slot),
            "staged_share_batch_order": staged_batch / max(1, blocks),
            "staged_share_slot_order": staged_slot / max(1, blocks)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=300, help="requests replayed")
    parser.add_argument("--trace", default=None, help="Mooncake-format trace (default: packaged)")
    parser.add_argument("--block-kib", default="64,2048",
                        help="block sizes to judge auto's choice for (comma-separated KiB)")
    parser.add_argument("--slice-mib", type=int, default=32)
    parser.add_argument("--staged-run-kib", type=int, default=512)
    args = parser.parse_args()
    plans = record_plans(args.limit, args.trace)
    print(f"{args.limit} requests; slices of {args.slice_mib} MiB; auto stages runs averaging "
          f">= {args.staged_run_kib} KiB")
    for path in PATHS:
        for kib in (int(k) for k in args.block_kib.split(",") if k):
            m = measure(plans[path], kib << 10, args.slice_mib << 20, args.staged_run_kib << 10)
            print(f"{path} {kib:>5} KiB blocks: {m['plans']} plans, {m['blocks']} blocks; "
                  f"blocks per DMA copy {m['blocks_per_copy_batch_order']:.1f} in batch order, "
                  f"{m['blocks_per_copy_slot_order']:.1f} in slot order; auto stages "
                  f"{m['staged_share_batch_order']:.0%} / {m['staged_share_slot_order']:.0%} "
                  f"of the blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
