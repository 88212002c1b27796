"""Trace replay that moves real bytes: ``kvstrata replay --data``.

:func:`run_data_replay` replays Mooncake requests (see :mod:`kvstrata.replay` for the trace
format and the synthetic tokens) through a :class:`~kvstrata.manager.KvBlockManager` whose
tiers hold real KV bytes of ``config.model``: G1 (a CPU tensor standing in for device memory
without a GPU), G2 host RAM and G3 a slab file in a temporary directory.

Per request, like the metadata replay:

1. ``onboard`` the request's block hashes: the longest prefix held anywhere is copied into
   G1 (from G2, or straight from G3) and verified; every block of the returned prefix is
   compared with its expected bytes (mismatches are counted and must be 0);
2. the engine "computes" the missing blocks: G1 blocks are allocated, filled with
   :func:`block_payload` of their sequence hash, and registered, which offloads them down the
   tiers (write-through cascade, subject to admission);
3. by default the replay waits until the offloads finished (``flush_each_request``), so hit
   rates do not depend on timing and compare with the metadata replay.

Bandwidth per path is bytes moved over the time the transfer workers spent on that path's
plans (queueing excluded).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from typing import Callable, Iterable

import numpy as np

from .physical.leftovers import owner_tag, reclaim
from .config import KvConfig, format_size
from .logical.pool import PoolExhaustedError
from .kinds import KINDS
from .kinds.base import layout_config_for
from .kinds.host import host_slot_bytes
from .manager import KvBlockManager, ManagerConfigError
from .physical.storage.disk import slab_stride
from .replay import TierStats, count_hits, hit_summary
from .tiers import TierKind, ordered, spec
from .trace import RequestHasher, TraceRequest

__all__ = ["run_data_replay", "block_payload", "DataReplayError", "DataRun", "check_sizes",
           "DEFAULT_MAX_HOST_BYTES", "DEFAULT_MAX_DISK_BYTES"]

DEFAULT_MAX_HOST_BYTES = 4 << 30
"""Refuse a replay whose G1 stand-in plus G2 would take more host RAM than this (4 GiB)."""
DEFAULT_MAX_DISK_BYTES = 32 << 30
"""Refuse a replay whose G3 slab would be bigger than this (32 GiB) or than free space."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


class DataReplayError(ManagerConfigError):
    """A data replay that cannot run as configured (tiers too big for RAM or disk)."""


def block_payload(sequence_hash: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes of the block named ``sequence_hash`` (what the replay's engine
    "computes"): 64-bit words ``w[i] = mix(hash + i * golden)``, any two blocks differ
    everywhere. Returns ``nbytes`` uint8."""
    words = np.arange(-(-nbytes // 8), dtype=np.uint64)
    words *= _GOLDEN
    words += np.uint64(sequence_hash)
    words ^= words >> np.uint64(31)
    words *= _MIX
    return words.view(np.uint8)[:nbytes]


def run_data_replay(
    requests: Iterable[TraceRequest],
    config: KvConfig,
    *,
    granularity: str = "engine",
    disk_dir: str | None = None,
    progress: Callable[[int], None] | None = None,
    verify: str = "all",
    flush_each_request: bool = True,
    max_host_bytes: int = DEFAULT_MAX_HOST_BYTES,
    max_disk_bytes: int = DEFAULT_MAX_DISK_BYTES,
    durable_disk: bool = False,
    object_store=None,
    list_interval: float | None = None,
    prefill_tokens_per_s: float | None = None,
) -> dict:
    """Replay ``requests`` moving real bytes; returns a JSON-able report.

    ``config`` gives the block size, tiers (in blocks or bytes; G1, G2, G3, and a G4 whose
    store is ``tiers.G4.url`` or ``object_store``), policies and ``config.model`` (default 4 layers x 8 KV heads x 64 dims bf16,
    so a 16-token block is 128 KiB). ``granularity`` is ``"engine"`` (blocks of
    ``config.block_size``) or ``"trace"`` (one 512-token block per trace id). The G3 slab goes
    to ``disk_dir`` (default: a temporary directory, removed afterwards). ``progress(n)`` is
    called after each request. ``verify``: ``"all"`` compares every block of each onboarded
    prefix with its expected bytes, ``"loaded"`` only those copied from G2/G3, ``"none"``
    skips it. Raises :class:`DataReplayError` if G1+G2 exceed ``max_host_bytes`` or G3
    exceeds ``max_disk_bytes`` or the free space of its directory. With ``durable_disk``
    (and a ``disk_dir``), G3 is kept when the replay ends and what an earlier durable replay
    left there is recovered first: a restart, as a server would see it.

    Keys of the returned dict:

    * ``mode`` (``"data"``), ``granularity``, ``block_size``, ``block_bytes``, ``model``
      (geometry), ``requests``, ``blocks``, ``tokens``, ``blocks_hit``, ``tokens_hit``,
      ``hit_rate``, ``token_hit_rate`` -- as in :meth:`kvstrata.replay.ReplayResult.as_dict`;
    * ``tiers`` -- per tier, the same shape as the metadata replay: ``capacity``,
      ``eviction``, ``admission``, ``blocks_looked_up``, ``blocks_hit``,
      ``tokens_looked_up``, ``tokens_hit``, ``evictions``, ``hit_rate``, ``token_hit_rate``;
    * ``paths`` -- per transfer path (``G1->G2``, ``G2->G3``, ``G2->G1``, ``G3->G1``):
      ``plans``, ``blocks``, ``bytes``, ``failed_blocks``, ``busy_seconds``,
      ``latency_seconds`` (summed submit-to-completion), ``gb_per_s`` (bytes / busy seconds,
      10**9 bytes per GB);
    * ``bytes_moved`` (all paths), ``computed_blocks``, ``computed_bytes`` (written into G1
      by the "engine");
    * ``verified_blocks``, ``mismatches`` (blocks handed back with wrong bytes: must be 0),
      ``load_failures`` (blocks an onboard reported failed), ``checksum_failures``;
    * ``wall_seconds``, ``stand_in`` (G1 is a CPU tensor), ``o_direct`` (G3 I/O mode),
      ``storage_bytes`` (per tier).
    """
    if verify not in ("all", "loaded", "none"):
        raise ValueError(f"verify must be 'all', 'loaded' or 'none', got {verify!r}")
    hasher = RequestHasher(config.block_size, granularity)
    if granularity == "trace":
        config = replace(config, block_size=hasher.block_size)
    config = config.validate()
    unsupported = [t for t in ordered(config.tiers) if spec(t).kind not in KINDS]
    if unsupported:
        raise DataReplayError(f"data replay moves bytes through "
                              f"{', '.join(k.value for k in KINDS)} tiers only; "
                              f"remove tiers {unsupported}")
    disk_tiers = [t for t in ordered(config.tiers) if spec(t).kind is TierKind.DISK]
    if disk_dir is None and disk_tiers:
        # the configured place (KVSTRATA_DISK_DIR, DYN_KVBM_DISK_CACHE_DIR, TOML disk_dir or
        # the tier's path) before a temporary directory
        disk_dir = config.directory_of(disk_tiers[0])
    if disk_dir is not None and disk_tiers and not os.path.isdir(disk_dir):
        what = "is not a directory" if os.path.exists(disk_dir) else "does not exist"
        raise DataReplayError(f"disk directory {disk_dir} {what}")
    check_sizes(config, disk_dir, max_host_bytes, max_disk_bytes)
    temp_dir = None
    if disk_dir is None and disk_tiers:
        reclaim(tempfile.gettempdir(), "kvstrata-data-replay-")   # left by killed replays
        disk_dir = temp_dir = tempfile.mkdtemp(prefix=f"kvstrata-data-replay-{owner_tag()}-")
    try:
        with KvBlockManager(config, disk_dir=disk_dir, max_host_bytes=max_host_bytes,
                            durable_disk=durable_disk and temp_dir is None,
                            object_store=object_store, list_interval=list_interval) as mgr:
            if prefill_tokens_per_s is not None:
                mgr.assume_prefill(prefill_tokens_per_s).result()
            run = DataRun(mgr, config, hasher, verify, flush_each_request)
            started = time.perf_counter()
            for request in requests:
                run.request(request)
                if progress is not None:
                    progress(run.requests)
            mgr.wait_idle()
            wall = time.perf_counter() - started
            return run.report(wall)
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def check_sizes(config: KvConfig, disk_dir: str | None, max_host: int, max_disk: int) -> None:
    """Refuse tiers whose bytes would not fit: device and host tiers in RAM (the device tier
    is a CPU stand-in here), disk tiers on the disk holding ``disk_dir``."""
    geometry = layout_config_for(config, 1)
    stride = geometry.block_bytes
    aligned = host_slot_bytes(geometry)
    ram_tiers = [t for t in ordered(config.tiers)
                 if spec(t).kind in (TierKind.DEVICE, TierKind.HOST)]
    ram = sum(config.tier_blocks(t) * (stride if spec(t).kind is TierKind.DEVICE else aligned)
              for t in ram_tiers)
    if ram > max_host:
        sizes = " + ".join(f"{t} ({config.tier_blocks(t)} blocks)" for t in ram_tiers)
        raise DataReplayError(
            f"{sizes} of {stride} bytes need {format_size(ram)} of RAM, over the data "
            f"replay limit of {format_size(max_host)}; give smaller tiers (e.g. "
            f"--tiers G1=1000,G2=4000)")
    for tier in ordered(config.tiers):
        if spec(tier).kind is not TierKind.DISK:
            continue
        disk = config.tier_blocks(tier) * slab_stride(geometry)
        where = disk_dir or tempfile.gettempdir()       # the filesystem the slab goes to
        free = shutil.disk_usage(where).free
        limit = min(max_disk, int(free * 0.9))
        if disk > limit:
            raise DataReplayError(
                f"{tier} of {config.tier_blocks(tier)} blocks needs {format_size(disk)} of "
                f"disk in {where}, over the limit of {format_size(limit)} "
                f"(data replay cap {format_size(max_disk)}, 90% of free space)")



class DataRun:
    """State of one data replay: the manager, counters and the per-request steps."""

    def __init__(self, mgr: KvBlockManager, config: KvConfig, hasher: RequestHasher,
                 verify: str, flush: bool) -> None:
        self.mgr, self.config, self.hasher = mgr, config, hasher
        self.verify, self.flush = verify, flush
        self.block_bytes = mgr.status()["block_bytes"]
        self.tiers = {name: TierStats(mgr.pools[name].capacity, config.tier_eviction(name),
                                      config.tier_admission(name)) for name in mgr.pools}
        self.top = mgr.planner.top
        self.g1_capacity = mgr.pools[self.top].capacity
        self.requests = self.blocks = self.tokens = self.blocks_hit = self.tokens_hit = 0
        self.computed = self.verified = self.mismatches = self.load_failures = 0
        self.would_load: dict[str, int] = {}
        self.would_recompute: dict[str, int] = {}
        self.seconds_saved = 0.0

    def request(self, request: TraceRequest) -> tuple[str, ...]:
        """Serve one trace request; returns the tier that served each block of its prefix."""
        return self.serve(*self.hasher.records(request))

    def serve(self, records, token_counts) -> tuple[str, ...]:
        """Serve a request already hashed into ``records``."""
        hashes = [r.sequence_hash for r in records]
        result = self.mgr.onboard(hashes).result()
        try:
            count_hits(self, result.sources, token_counts)
            self._judge(result.sources)
            self.load_failures += len(result.failures)
            self._verify(result)
        finally:
            result.release()
        missing = records[len(result):]
        for start in range(0, len(missing), self.g1_capacity):
            if start and self.flush:
                # Like the metadata replay: a batch's copies settle before the next batch
                # allocates, so which G1 blocks are held (not evictable) never depends on timing.
                self.mgr.wait_idle()
            self._compute(missing[start:start + self.g1_capacity])
        if self.flush:
            self.mgr.wait_idle()
        self.requests += 1
        return result.sources

    def _judge(self, sources) -> None:
        """What the cost model would have loaded of this prefix, and the time it saves."""
        if not sources:
            return
        k, saved = self.mgr.worth_loading(sources).result()
        for i, tier in enumerate(sources):
            table = self.would_load if i < k else self.would_recompute
            table[tier] = table.get(tier, 0) + 1
        self.seconds_saved += saved

    def _verify(self, result) -> None:
        if self.verify == "none" or not len(result):
            return
        picks = [i for i, src in enumerate(result.sources)
                 if self.verify == "all" or src != self.top]
        ids, hashes = result.block_ids, result.sequence_hashes
        got = self.mgr.read_g1([ids[i] for i in picks])
        for i, data in zip(picks, got):
            if not np.array_equal(data, block_payload(hashes[i], self.block_bytes)):
                self.mismatches += 1
        self.verified += len(picks)

    def _compute(self, records) -> None:
        """The engine computes ``records`` into fresh G1 blocks and registers them."""
        try:
            blocks = self.mgr.allocate(len(records)).result()
        except PoolExhaustedError:
            self.mgr.wait_idle()   # G1 slots are held by offloads in flight; they finish
            blocks = self.mgr.allocate(len(records)).result()
        self.mgr.write_g1(blocks.block_ids, [block_payload(r.sequence_hash, self.block_bytes)
                                             for r in records])
        blocks.apply_token_blocks(records)
        self.mgr.release(self.mgr.register(blocks).result())
        self.computed += len(records)

    def report(self, wall: float) -> dict:
        mgr = self.mgr
        status = mgr.status()
        paths = mgr.transfer_stats()
        for name, stats in self.tiers.items():
            stats.evictions = status["tiers"][name]["pool"]["evictions"]
        checksum_failures = sum(
            mgr.metrics.value("kvstrata_checksum_failures_total", tier=t) for t in mgr.pools)
        disks = [t["storage"] for t in status["tiers"].values()
                 if t["storage"].get("path") is not None]
        return {
            "mode": "data",
            "granularity": self.hasher.granularity,
            "block_size": self.hasher.block_size,
            "block_bytes": self.block_bytes,
            "model": asdict(self.config.model),
            **hit_summary(self),
            "tiers": {name: stats.as_dict() for name, stats in self.tiers.items()},
            "paths": {p: {k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()}
                      for p, s in paths.items()},
            "bytes_moved": sum(s["bytes"] for s in paths.values()),
            "computed_blocks": self.computed,
            "computed_bytes": self.computed * self.block_bytes,
            "verified_blocks": self.verified,
            "mismatches": self.mismatches,
            "load_failures": self.load_failures,
            "checksum_failures": int(checksum_failures),
            "wall_seconds": round(wall, 4),
            "cost_model": {**status["costs"], "would_load": dict(self.would_load),
                           "would_recompute": dict(self.would_recompute),
                           "estimated_seconds_saved": round(self.seconds_saved, 4)},
            "stand_in": status["stand_in"],
            "o_direct": any(d.get("o_direct") for d in disks),
            "storage_bytes": {t: s["storage"]["bytes"] for t, s in status["tiers"].items()},
        }
