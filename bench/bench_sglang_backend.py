"""kvstrata as SGLang HiCache's storage backend vs SGLang's own ``file`` backend and raw I/O.

All three move the same pages of one host pool of SGLang's default layout (``page_first``,
pages of 2 MiB: 16 tokens x 32 layers x 8 KV heads x 128 x bf16, K and V) to and from disk,
``--batch`` pages per call (SGLang batches at most 128):

* **kvstrata** -- ``batch_set_v1`` / ``batch_get_v1`` (SGLang's zero-copy interface): pages
  staged into its G3 slab (O_DIRECT where the filesystem allows), every page verified on
  read;
* **SGLang file** -- ``HiCacheFile`` (sglang 0.5.23), driven as SGLang's cache controller
  drives a backend without ``interface_v1``: each page copied out flat (``get_data_page``),
  ``batch_set`` writes one file per page; ``batch_get`` reads into flat pages copied back
  (``set_from_flat_data_page``). Its files go through the page cache: reads are timed after
  the files were dropped from it (``posix_fadvise(DONTNEED)``, "cold") and as they are
  ("warm");
* **raw** -- one ``pwritev`` / ``preadv`` per page between the host buffer and a
  preallocated file (O_DIRECT when the slab has it), nothing else.

Best of ``--reps``, interleaved run by run; prints GB/s and ratios, never asserts timing.
Usage: ``python bench/bench_sglang_backend.py [--quick] [--reps N] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from kvstrata.connectors.sglang import KvStrataStorage
from kvstrata.physical.buffers import AlignedBuffer

PAGE, LAYERS, HEADS, DIM = 16, 32, 8, 128


def storage_config(extra: dict | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False,
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench", extra_config=extra)


def keys(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short CI-sized run")
    parser.add_argument("--reps", type=int, default=None, help="runs per figure (best of)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: temp)")
    parser.add_argument("--batch", type=int, default=None, help="pages per call")
    args = parser.parse_args()
    batch, reps = (16, 3) if args.quick else (64, 5)
    batch, reps = args.batch or batch, args.reps or reps
    pages = 2 * batch
    tokens = pages * PAGE
    page_bytes = 2 * PAGE * LAYERS * HEADS * DIM * 2
    memory = AlignedBuffer(pages * page_bytes)        # page-aligned: raw O_DIRECT reads it
    buffer = memory.tensor.view(torch.bfloat16).view(2, tokens, LAYERS, HEADS, DIM)
    buffer.view(torch.int16).random_(-2**15, 2**15 - 1)
    pool = SimpleNamespace(layout="page_first", page_size=PAGE, size=tokens, kv_buffer=buffer)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ours = KvStrataStorage(storage_config({
            "interface_v1": 1, "disk_dir": os.path.join(tmp, "kvstrata"),
            "tiers": {"G3": {"bytes": str(page_bytes * batch * (reps + 2) + (64 << 20))}}}))
        ours.register_mem_pool_host(pool)
        theirs = HiCacheFile(storage_config({}), file_path=os.path.join(tmp, "sglang-file"))
        disk = ours.manager.storage("G3")
        status = disk.status()
        print(f"kvstrata slab {status.path} o_direct={status.o_direct}; SGLang file backend "
              f"in {theirs.file_path}")
        raw_path = os.path.join(tmp, "raw.bin")
        with open(raw_path, "wb") as fh:
            fh.truncate(page_bytes * batch)
        raw_fd = os.open(raw_path, os.O_RDWR | (os.O_DIRECT if status.o_direct else 0))
        host = buffer.view(torch.uint8).numpy().reshape(2, pages, -1)   # [K/V, page, bytes]

        def slots(first: int) -> torch.Tensor:
            return torch.arange(first * PAGE, (first + batch) * PAGE, dtype=torch.int64)

        def flat(page: int) -> torch.Tensor:               # SGLang's get_data_page (page_first)
            return buffer[:, page * PAGE:(page + 1) * PAGE].flatten()

        def unflat(page: int, data: torch.Tensor) -> None:  # set_from_flat_data_page
            buffer[:, page * PAGE:(page + 1) * PAGE] = data.view(2, PAGE, LAYERS, HEADS, DIM)

        def raw(write: bool) -> None:
            io = os.pwritev if write else os.preadv
            for i in range(batch):
                page = i if write else batch + i
                io(raw_fd, [host[0, page], host[1, page]], i * page_bytes)

        def cold(names: list[str]) -> None:
            for key in names:
                path = os.path.join(theirs.file_path, f"{key}{theirs.config_suffix}.bin")
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        best: dict[str, float] = {}
        try:
            for rep in range(reps + 1):                     # round 0 is warm-up
                ours_keys, their_keys = keys(batch, f"k{rep}"), keys(batch, f"s{rep}")
                targets = [torch.empty(page_bytes // 2, dtype=torch.bfloat16)
                           for _ in range(batch)]
                runs = [
                    ("raw_w", lambda: raw(True)),
                    ("ours_w", lambda: ours.batch_set_v1(ours_keys, slots(0))),
                    ("file_w", lambda: theirs.batch_set(their_keys,
                                                        [flat(p) for p in range(batch)])),
                    ("raw_r", lambda: raw(False)),
                    ("ours_r", lambda: ours.batch_get_v1(ours_keys, slots(batch))),
                    ("file_r_cold", lambda: (cold(their_keys), [
                        unflat(batch + i, t) for i, t in
                        enumerate(theirs.batch_get(their_keys, targets))])),
                    ("file_r_warm", lambda: [unflat(batch + i, t) for i, t in
                                             enumerate(theirs.batch_get(their_keys, targets))]),
                ]
                for name, fn in runs:
                    start = time.perf_counter()
                    out = fn()
                    elapsed = time.perf_counter() - start
                    if name.startswith("ours"):
                        assert out == [True] * batch, (name, out[:4])
                    if rep:
                        best[name] = min(best.get(name, float("inf")), elapsed)
        finally:
            os.close(raw_fd)
            ours.close()
    nbytes = batch * page_bytes
    gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
    print(f"{batch} pages of {page_bytes >> 20} MiB per call, best of {reps}; GB/s:")
    for way, label in (("w", "write (set)"), ("r", "read (get)")):
        print(f"  {label}: kvstrata {gbs[f'ours_{way}']:.2f}  raw {gbs[f'raw_{way}']:.2f}  "
              f"ratio {gbs[f'ours_{way}'] / gbs[f'raw_{way}']:.2f}")
    print(f"  SGLang file: write {gbs['file_w']:.2f}, read cold {gbs['file_r_cold']:.2f}, "
          f"read warm (page cache) {gbs['file_r_warm']:.2f}")
    for way, theirs_key in (("w", "file_w"), ("r", "file_r_cold")):
        print(f"RESULT name=sglang_backend_{'set' if way == 'w' else 'get'} "
              f"ours={gbs[f'ours_{way}']:.2f}GB/s baseline={gbs[theirs_key]:.2f}GB/s "
              f"(SGLang file backend{', cold' if way == 'r' else ''}) "
              f"ratio={gbs[f'ours_{way}'] / gbs[theirs_key]:.2f} raw={gbs[f'raw_{way}']:.2f}GB/s "
              f"ratio_to_raw={gbs[f'ours_{way}'] / gbs[f'raw_{way}']:.2f}")


if __name__ == "__main__":
    main()
