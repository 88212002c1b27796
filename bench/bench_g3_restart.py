"""What a durable G3 costs at start and what it saves after a restart.

1. **Recovery time.** A durable G3 of ``--blocks`` blocks (default 100,000 of 4 KiB) is
   filled with real blocks and closed; then a ``KvBlockManager`` is started on it (index
   replayed and compacted, checksums loaded, every block restored into the G3 pool and
   announced) and timed against, in the same run, a manager started on an empty directory
   and a bare read of the index file. Verification is lazy (each block is checked when first
   read), so nothing here reads the slab.
2. **What a restart saves.** The shipped trace is replayed with real bytes (KvBlockManager,
   512-token trace blocks): ``--warm`` requests, then the process "restarts" (G1 and G2 are
   gone) and the next ``--after`` requests are replayed twice -- on the recovered G3, and on
   an empty one (a restart without kvstrata's durable tier, what peers do). The figure is the
   hit rate of those requests in each case.

Run: ``.venv/bin/python bench/bench_g3_restart.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_line  # noqa: E402

from kvstrata import KvBlockManager  # noqa: E402
from kvstrata.compat import compatibility_of  # noqa: E402
from kvstrata.config import KvConfig, ModelGeometry, TierConfig  # noqa: E402
from kvstrata.data_replay import run_data_replay  # noqa: E402
from kvstrata.kinds.base import layout_config_for  # noqa: E402
from kvstrata.physical import DiskStorage  # noqa: E402
from kvstrata.replay import default_trace_path, load_trace  # noqa: E402


def recovery(blocks: int, workdir: Path) -> None:
    config = KvConfig(block_size=16, tiers={"G1": TierConfig(blocks=64),
                                            "G2": TierConfig(blocks=64),
                                            "G3": TierConfig(blocks=blocks)},
                      model=ModelGeometry(num_layers=1, kv_heads=1, head_dim=64, dtype="fp16"))
    full, empty = workdir / "full", workdir / "empty"
    full.mkdir()
    empty.mkdir()
    layout = layout_config_for(config, blocks)
    started = time.perf_counter()
    disk = DiskStorage.durable(layout, full, fingerprint=compatibility_of(config).fingerprint)
    stride = disk.layout.block_stride
    batch = 512
    buf = np.random.default_rng(0).integers(0, 256, batch * stride, dtype=np.uint8)
    views = [buf[i * stride:(i + 1) * stride] for i in range(batch)]
    for first in range(0, blocks, batch):
        n = min(batch, blocks - first)
        seqs = list(range(first + 1, first + n + 1))
        disk.write_blocks(list(range(first, first + n)), views[:n], seqs,
                          parent_hashes=[s - 1 if s > 1 else None for s in seqs],
                          local_hashes=[s * 7 for s in seqs])
    index_path = disk.index.path
    disk.close()
    print(f"filled {blocks:,} blocks ({blocks * stride / 2**20:,.0f} MiB) in "
          f"{time.perf_counter() - started:.1f} s")

    def start(directory: Path) -> tuple[float, int]:
        t0 = time.perf_counter()
        with KvBlockManager(config, disk_dir=str(directory)) as mgr:
            elapsed = time.perf_counter() - t0
            held = mgr.pools["G3"].status().inactive
        return elapsed, held

    t0 = time.perf_counter()
    raw = index_path.read_bytes()
    read_index = time.perf_counter() - t0
    fresh, _ = start(empty)
    fresh2, _ = start(empty)
    recovered, held = start(full)
    assert held == blocks, f"recovered {held} of {blocks}"
    fresh = min(fresh, fresh2)
    extra = recovered - fresh
    print(f"index: {len(raw) / 2**20:.1f} MiB, read in {read_index * 1e3:.0f} ms")
    print(f"manager start: empty G3 {fresh * 1e3:.0f} ms, with {held:,} recovered blocks "
          f"{recovered * 1e3:.0f} ms (recovery adds {extra * 1e3:.0f} ms; goal < 2,000 ms)")
    print(result_line("g3_recovery_ms", recovered * 1e3, fresh * 1e3, "ms", goal="<2000ms"))


def restart_saves(warm: int, after: int, workdir: Path) -> None:
    requests = load_trace(default_trace_path())
    if warm + after > len(requests):
        raise SystemExit(f"the trace has {len(requests)} requests, fewer than {warm + after}")
    config = KvConfig(block_size=16, tiers={"G1": TierConfig(blocks=200),
                                            "G2": TierConfig(blocks=800),
                                            "G3": TierConfig(blocks=6000)},
                      model=ModelGeometry(num_layers=2, kv_heads=2, head_dim=16, dtype="bf16"))
    disk = workdir / "restart"
    disk.mkdir()
    common = dict(granularity="trace", verify="loaded")
    t0 = time.perf_counter()
    first = run_data_replay(requests[:warm], config, disk_dir=str(disk), durable_disk=True,
                            **common)
    print(f"warm-up: {warm} requests, hit rate {first['hit_rate']:.1%}, "
          f"{time.perf_counter() - t0:.0f} s")
    kept = run_data_replay(requests[warm:warm + after], config, disk_dir=str(disk),
                           durable_disk=True, **common)
    cold = run_data_replay(requests[warm:warm + after], config, **common)
    for name, report in (("recovered G3", kept), ("empty G3", cold)):
        tiers = ", ".join(f"{t} {s['blocks_hit']}" for t, s in report["tiers"].items())
        print(f"after restart, {name}: hit rate {report['hit_rate']:.1%} "
              f"({report['blocks_hit']:,} of {report['blocks']:,} blocks; {tiers}); "
              f"wrong blocks {report['mismatches']}, load failures {report['load_failures']}")
    assert kept["mismatches"] == 0 and cold["mismatches"] == 0
    print(result_line("restart_hit_rate_pct", kept["hit_rate"] * 100,
                      max(cold["hit_rate"] * 100, 1e-9), "%"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--warm", type=int, default=2000)
    parser.add_argument("--after", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="20K blocks, 500 + 300 requests")
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.warm, args.after = 20_000, 500, 300
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-g3-", dir=args.dir))
    try:
        recovery(args.blocks, workdir)
        restart_saves(args.warm, args.after, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
