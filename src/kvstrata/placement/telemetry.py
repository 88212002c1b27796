"""What the planner reports about its work: a listener interface and the counters it keeps.

The planner calls every :class:`PlacementListener` it was given on its own thread, once per
event (a plan completed, blocks skipped, an onboard finished, the in-flight count changed).
:class:`PlacementStats` is the listener every planner has: plain counters the replay report
and ``KvBlockManager.transfer_stats()`` read. The manager adds its Prometheus collectors as a
second listener. Listeners must be cheap and must not call back into the planner.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["PlacementListener", "PathStats", "PlacementStats", "SKIP_REASONS"]

SKIP_REASONS = ("admission", "evicted", "no_slot", "quota")
"""Why blocks offered to a tier were not copied there: its admission filter refused them; they
left their source tier while waiting for a slot; no slot could be had and the source could not
wait (an engine-owned block, or nothing in flight that would free one); their tenant was at
its quota of the tier and had no idle block of its own there to evict (:mod:`.tenants`)."""


class PlacementListener:
    """Override what you need; the defaults do nothing."""

    def transfer_done(self, path: str, blocks: int, nbytes: int, busy_seconds: float,
                      latency_seconds: float, failures: Iterable[tuple[str, int]]) -> None:
        """A plan on ``path`` completed: ``blocks`` / ``nbytes`` arrived, the executor spent
        ``busy_seconds`` on it, ``latency_seconds`` passed between the planner handing it out
        and taking its result, and ``(kind, count)`` blocks failed."""

    def skipped(self, tier: str, reason: str, count: int) -> None:
        """``count`` blocks offered to ``tier`` were not copied (see :data:`SKIP_REASONS`)."""

    def onboarded(self, requested: int, sources: Sequence[str]) -> None:
        """An onboard asked for ``requested`` blocks; ``sources`` names the tier each block of
        the delivered prefix came from."""

    def in_flight(self, pending: int) -> None:
        """Plans handed out and not completed, plus batches waiting for a slot, now number
        ``pending``."""


@dataclass
class PathStats:
    """What moved on one path: plans, blocks and bytes that arrived, blocks that failed,
    ``busy_seconds`` (executor time spent on the plans, queueing excluded) and
    ``latency_seconds`` (summed hand-out-to-result times)."""

    plans: int = 0
    blocks: int = 0
    bytes: int = 0
    failed_blocks: int = 0
    busy_seconds: float = 0.0
    latency_seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["gb_per_s"] = self.bytes / self.busy_seconds / 1e9 if self.busy_seconds else 0.0
        return d


class PlacementStats(PlacementListener):
    """Counters of everything the planner did, by path, tier and reason."""

    def __init__(self) -> None:
        self.paths: dict[str, PathStats] = {}
        self.skipped_blocks: Counter[tuple[str, str]] = Counter()
        """``(tier, reason) -> blocks`` not copied to ``tier``."""
        self.failed_kinds: Counter[tuple[str, str]] = Counter()
        """``(path, kind) -> blocks`` that failed on ``path``."""
        self.lookups = 0
        """Blocks asked for by onboards."""
        self.hits: Counter[str] = Counter()
        """Blocks of delivered onboard prefixes, by the tier that served them."""

    def transfer_done(self, path, blocks, nbytes, busy_seconds, latency_seconds, failures):
        stats = self.paths.get(path)
        if stats is None:
            stats = self.paths[path] = PathStats()
        stats.plans += 1
        stats.blocks += blocks
        stats.bytes += nbytes
        stats.busy_seconds += busy_seconds
        stats.latency_seconds += latency_seconds
        for kind, count in failures:
            stats.failed_blocks += count
            self.failed_kinds[path, kind] += count

    def skipped(self, tier, reason, count):
        self.skipped_blocks[tier, reason] += count

    def onboarded(self, requested, sources):
        self.lookups += requested
        self.hits.update(sources)

    def moved(self) -> dict[str, int]:
        """Blocks that arrived, per path with any."""
        return {path: s.blocks for path, s in sorted(self.paths.items()) if s.blocks}

    def skipped_for(self, reason: str) -> dict[str, int]:
        """Blocks skipped for ``reason``, per tier with any."""
        return {tier: n for (tier, why), n in sorted(self.skipped_blocks.items())
                if why == reason and n}
