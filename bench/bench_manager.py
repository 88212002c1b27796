"""Manager overhead: offload and onboard through KvBlockManager vs the bare TransferEngine.

The same batch of N blocks (default geometry: 4 layers x 8 KV heads x 64 dims bf16, 16-token
blocks = 128 KiB) is (a) registered in G1 through the manager and written through to G2 and G3
(register -> flush), then onboarded back from G2; (b) moved with the same plans submitted
directly to a TransferEngine over storages of the same geometry (the baseline: bytes only, no
pools, no owner thread; G2 verified on both sides, as the manager's is by default). The ratio
is the manager's cost on top of the data path.
Prints figures, never asserts timing. Usage: ``python bench/bench_manager.py [--quick]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from _common import result_line

from kvstrata.config import KvConfig, TierConfig
from kvstrata.data_replay import block_payload
from kvstrata.logical.registry import BlockRecord
from kvstrata.kinds.base import layout_config_for
from kvstrata.manager import KvBlockManager
from kvstrata.physical import (DeviceStorage, DiskStorage, HostStorage, TransferEngine,
                               TransferPlan)


def records(n: int, base: int) -> list[BlockRecord]:
    hashes = [base + i for i in range(n)]
    return [BlockRecord(h, h, hashes[i - 1] if i else None, 16) for i, h in enumerate(hashes)]


def through_manager(cfg: KvConfig, n: int, reps: int) -> tuple[float, float]:
    best_off = best_on = float("inf")
    with KvBlockManager(cfg) as mgr:
        size = mgr.status()["block_bytes"]
        for rep in range(reps):
            recs = records(n, 1 << 40 | rep << 20)
            blocks = mgr.allocate(n).result()
            mgr.write_g1(blocks.block_ids, [block_payload(r.sequence_hash, size) for r in recs])
            blocks.apply_token_blocks(recs)
            start = time.perf_counter()
            mgr.release(mgr.register(blocks).result())
            mgr.wait_idle()
            best_off = min(best_off, time.perf_counter() - start)
            mgr.release(mgr.allocate(mgr.pools["G1"].capacity).result()).result()  # empty G1
            start = time.perf_counter()
            mgr.onboard([r.sequence_hash for r in recs]).result().release().result()
            best_on = min(best_on, time.perf_counter() - start)
    return best_off, best_on


def bare_engine(cfg: KvConfig, n: int, reps: int) -> tuple[float, float]:
    geometry = layout_config_for(cfg, cfg.tier_blocks("G1"))
    best_off = best_on = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        g1 = DeviceStorage.allocate(geometry, device="cpu")
        # G2 verified as the manager's is by default (verify_host_reads): the same work
        g2 = HostStorage(geometry.with_blocks(cfg.tier_blocks("G2")).with_alignment(4096),
                         verify_reads=True)
        g3 = DiskStorage(geometry.with_blocks(cfg.tier_blocks("G3")), tmp)
        with TransferEngine({"G1": g1, "G2": g2, "G3": g3}) as engine:
            ids = list(range(n))
            for rep in range(reps):
                seq = [(1 << 40 | rep << 20) + i for i in ids]
                start = time.perf_counter()
                engine.submit(TransferPlan.for_path("G1->G2", ids, ids, seq, job_id=0)).result()
                engine.submit(TransferPlan.for_path("G2->G3", ids, ids, seq, job_id=0)).result()
                best_off = min(best_off, time.perf_counter() - start)
                start = time.perf_counter()
                engine.submit(TransferPlan.for_path("G2->G1", ids, ids, seq, job_id=0)).result()
                best_on = min(best_on, time.perf_counter() - start)
        for s in (g1, g2, g3):
            s.close()
    return best_off, best_on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    args = parser.parse_args()
    n, reps = (128, 3) if args.quick else (512, 5)
    cfg = KvConfig(tiers={"G1": TierConfig(blocks=n), "G2": TierConfig(blocks=n * reps),
                          "G3": TierConfig(blocks=n * reps)})
    gb = n * cfg.bytes_per_block / 1e9
    ours = through_manager(cfg, n, reps)
    base = bare_engine(cfg, n, reps)
    print(f"{n} blocks of {cfg.bytes_per_block} B ({gb:.2f} GB) per batch, best of {reps}")
    for label, o, b in (("offload G1->G2->G3", ours[0], base[0]),
                        ("onboard G2->G1", ours[1], base[1])):
        print(f"  {label}: manager {gb / o:5.2f} GB/s, bare engine {gb / b:5.2f} GB/s")
    print(result_line("manager_offload_mb_per_s", gb * 1e3 / ours[0], gb * 1e3 / base[0],
                      "MB/s"))
    print(result_line("manager_onboard_mb_per_s", gb * 1e3 / ours[1], gb * 1e3 / base[1],
                      "MB/s"))


if __name__ == "__main__":
    main()
