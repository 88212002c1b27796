"""What moving a block costs, learned online from the transfers the planner actually runs.

:class:`CostModel` is a :class:`~.telemetry.PlacementListener` every planner has
(``planner.costs``). For each path (``"G3->G1"``) it keeps two estimates from the plans that
complete on it:

* **bandwidth** -- bytes per second of executor time (``nbytes / busy_seconds``);
* **overhead** -- seconds a plan spends outside the copy itself (``latency - busy``: queueing,
  the round trip through an engine step, a request to a store), not counting the time it was
  held back on purpose or waited on the engine (``TransferResult.held_seconds`` and
  ``waited_seconds``: a store waiting for the forward that writes what it reads, a result
  waiting for an engine that does not step).

and, from what a driver reports (:meth:`CostModel.observe_prefill`), the engine's **prefill
rate** in tokens per second. Each estimate is an exponentially weighted moving average of
the samples' logarithms (a geometric mean: one slow outlier moves it by a factor, not by an
order of magnitude), each sample first clipped to within :data:`CLIP` times the current
estimate (the prior before any sample; while the estimate is young, its blend with the
prior), its first samples too: an outlier first sample (2 MiB "copied" in a microsecond)
moves it by a factor of :data:`CLIP` at most. Two exceptions while an estimate is young
(fewer than :data:`WARM_SAMPLES` samples): a sample *worse* than it (less bandwidth, more
overhead) is believed as it is, so a path far slower than its prior is known within its
first plans (bad news is never the dangerous kind: at worst a block is recomputed); and the
prefill rate, which has no worse side, is clipped to within ``CLIP ** WARM_SAMPLES`` times
its prior (weighing one :data:`WARM_SAMPLES`-th in the blend, a first sample moves it by
:data:`CLIP` at most). It is pessimistic: a sample worse than the estimate (less bandwidth,
more overhead) weighs :data:`ALPHA_WORSE`, a better one :data:`ALPHA` (every prefill sample
weighs :data:`ALPHA`), so a path that turns slow is used less within a plan or two and
trusted again gradually. With fewer
than :data:`WARM_SAMPLES` samples an estimate is blended with a prior, and it decays back
towards the prior with a half-life of :data:`STALE_HALF_LIFE` seconds without samples (a
path that was slow an hour ago is tried again).

A path's prior is what the other paths to or from its slower tier measured (the worst of
them: a bucket's reads are assumed no faster than its writes until a read is measured), and
without those the :class:`CostPrior` of that tier's kind. Each kind of tier declares its own
in its module of :mod:`kvstrata.kinds` (deliberately conservative for the slow ones), and the
driver that builds a planner over real storages hands them in (``CostModel(cost_priors())``);
the engine's prefill rate starts at 2,000 tokens/s.

Copies on one path queue behind each other: a planner tells its model how many blocks are in
flight on each path (:meth:`CostModel.attach_backlog`), and a load's estimate includes
moving them first. :meth:`CostModel.load_seconds` and
:meth:`CostModel.recompute_seconds` give what an onboard decision compares, and
:meth:`CostModel.worth_loading` makes it (how much of a held prefix to load);
:meth:`CostModel.snapshot` what status output and metrics show.
"""

from __future__ import annotations

import math
import time
from itertools import groupby
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from ..tiers import TierKind, order_of, path_name, spec, split_path
from .telemetry import PlacementListener

__all__ = ["CostModel", "CostPrior", "Estimate", "ALPHA", "ALPHA_WORSE", "CLIP",
           "WARM_SAMPLES", "STALE_HALF_LIFE", "PREFILL_PRIOR"]

ALPHA = 0.2
"""Weight of a new sample better than the estimate in the moving average (of logarithms)."""
ALPHA_WORSE = 0.5
"""Weight of a new sample worse than the estimate: bad news is believed sooner."""
CLIP = 4.0
"""A sample further than this factor from the current estimate counts as this factor."""
WARM_SAMPLES = 3
"""Samples before an estimate stands on its own (before that it is blended with the prior)."""
_COLD_CLIP = CLIP ** WARM_SAMPLES
"""How far from its prior a young direction-less estimate's (the prefill rate's) sample may
lie: its blend with the prior weighs it one WARM_SAMPLES-th, so the first moves it by CLIP
at most."""
STALE_HALF_LIFE = 300.0
"""Seconds without samples after which an estimate has moved halfway back to its prior."""

PREFILL_PRIOR = 2_000.0
"""Tokens per second of prefill assumed before the engine was measured."""


@dataclass(frozen=True)
class CostPrior:
    """What a planner assumes of a kind of tier before any copy on it was measured:
    ``bandwidth`` in bytes per second of copying, ``overhead`` in seconds per plan besides
    the copy. Each kind of tier declares its own (:mod:`kvstrata.kinds`)."""

    bandwidth: float
    overhead: float

    def __post_init__(self) -> None:
        for name in ("bandwidth", "overhead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"a cost prior's {name} is a finite number > 0, "
                                 f"got {value!r}")


@dataclass
class Estimate:
    """One robust, decaying estimate of a positive quantity (see the module docstring).
    ``higher_is_better`` says which way a sample is bad news (bandwidth: lower; overhead:
    higher; ``None``: neither, every sample weighs :data:`ALPHA`). Methods take the prior to
    blend with (``None``: the one it was made with)."""

    prior: float
    higher_is_better: bool | None = None
    log_mean: float = field(init=False)
    samples: int = 0
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        self.log_mean = math.log(self.prior)

    def add(self, value: float, now: float, prior: float | None = None) -> None:
        """Fold in one sample (ignored unless a finite float > 0: an integer past the
        floats, too), clipped to within :data:`CLIP` times the estimate now; while the
        estimate is young, a worse sample is taken as it is and one of an estimate without
        a worse side is clipped to within ``CLIP ** WARM_SAMPLES`` times the prior (module
        docstring)."""
        try:
            value = float(value)
        except OverflowError:
            return
        if not (value > 0 and math.isfinite(value)):
            return
        current = self.value(now, prior)
        if self.samples >= WARM_SAMPLES:
            value = min(max(value, current / CLIP), current * CLIP)
        elif self.higher_is_better is None:   # blended: bounded by the prior, moved by CLIP
            base = self.prior if prior is None else prior
            value = min(max(value, base / _COLD_CLIP), base * _COLD_CLIP)
        elif self.higher_is_better:           # young: good news clipped, bad news believed
            value = min(value, current * CLIP)
        else:
            value = max(value, current / CLIP)
        log_value = math.log(value)
        if self.samples == 0:
            self.log_mean = log_value
        else:
            # a warm estimate moves from where it stands now (decayed if it went stale)
            base = math.log(current) if self.samples >= WARM_SAMPLES else self.log_mean
            worse = (self.higher_is_better is not None
                     and (log_value < base) == self.higher_is_better)
            self.log_mean = base + (ALPHA_WORSE if worse else ALPHA) * (log_value - base)
        self.samples += 1
        self.updated_at = now

    def value(self, now: float, prior: float | None = None) -> float:
        """The estimate now: blended with the prior while young, decayed towards it when
        stale."""
        prior = self.prior if prior is None else prior
        if self.samples == 0:
            return prior
        prior_log = math.log(prior)
        weight = min(1.0, self.samples / WARM_SAMPLES)
        age = max(0.0, now - self.updated_at)
        weight *= 0.5 ** (age / STALE_HALF_LIFE)
        return math.exp(prior_log + weight * (self.log_mean - prior_log))


PREFILL_RATES = (1.0, 1e12)
"""The prefill rates (tokens per second) a caller may assume: below a token a second no
engine runs, and the seconds a cache saves would be meaningless (at 1e-308 they were
infinite); a trillion stands for an engine whose prefill costs nothing."""


class CostModel(PlacementListener):
    """Per path bandwidth and overhead, and the engine's prefill rate; see the module
    docstring. ``priors`` holds the :class:`CostPrior` of each kind of tier the paths may
    touch (:func:`kvstrata.kinds.cost_priors`); ``clock`` is ``time.monotonic`` (tests pass
    their own)."""

    def __init__(self, priors: Mapping[TierKind, CostPrior],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._priors = dict(priors)
        for kind, prior in self._priors.items():
            if not isinstance(kind, TierKind) or not isinstance(prior, CostPrior):
                raise TypeError(f"cost priors map a TierKind to a CostPrior, got "
                                f"{kind!r}: {prior!r}")
        self._clock = clock
        self._bandwidth: dict[str, Estimate] = {}
        self._overhead: dict[str, Estimate] = {}
        self.prefill = Estimate(PREFILL_PRIOR)
        self._backlog: Callable[[str], int] = lambda path: 0

    def attach_backlog(self, blocks_in_flight: Callable[[str], int]) -> None:
        """Where to ask how many blocks are queued or moving on a path (the planner's jobs in
        flight); a load's estimate waits for them."""
        self._backlog = blocks_in_flight

    def blocks_in_flight(self, path: str) -> int:
        """Blocks queued or moving on ``path`` now (0 without a planner attached)."""
        return self._backlog(path)

    # -- learning --------------------------------------------------------------------------
    def transfer_done(self, path: str, blocks: int, nbytes: int, busy_seconds: float,
                      latency_seconds: float, failures: Iterable[tuple[str, int]]) -> None:
        if nbytes <= 0:          # nothing moved (a failed plan, a metadata-only replay)
            return
        now = self._clock()
        if busy_seconds > 0:
            self._estimate(self._bandwidth, path, True).add(
                _ratio(nbytes, busy_seconds), now, self._prior(self._bandwidth, path, now))
        if latency_seconds > 0:
            self._estimate(self._overhead, path, False).add(
                max(latency_seconds - busy_seconds, 1e-6), now,
                self._prior(self._overhead, path, now))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.prefill.add(_ratio(tokens, seconds), self._clock())

    # -- what a decision compares ----------------------------------------------------------
    def bandwidth(self, path: str) -> float:
        """Estimated bytes per second of copying on ``path``."""
        return self._value(self._bandwidth, path, True)

    def overhead(self, path: str) -> float:
        """Estimated seconds a plan on ``path`` spends besides copying."""
        return self._value(self._overhead, path, False)

    def load_seconds(self, path: str, nbytes: int, block_bytes: int = 0) -> float:
        """Estimated seconds to bring ``nbytes`` over ``path`` in one plan; given the size of
        a block, behind the blocks already in flight on it."""
        queued = self._backlog(path) * block_bytes if block_bytes else 0
        return self.overhead(path) + (queued + nbytes) / self.bandwidth(path)

    def recompute_seconds(self, tokens: int) -> float:
        """Estimated seconds for the engine to compute ``tokens`` prompt tokens."""
        return tokens / self.prefill.value(self._clock())

    def assume_prefill(self, tokens_per_s: float) -> None:
        """Take ``tokens_per_s`` as the engine's prefill rate (no engine to measure: a replay
        sizing tiers for one; within :data:`PREFILL_RATES`); measurements made afterwards
        move it as usual."""
        low, high = PREFILL_RATES
        if not low <= tokens_per_s <= high:
            raise ValueError(f"a prefill rate is {low:g}..{high:g} tokens per second, got "
                             f"{tokens_per_s!r:.40}")
        self.prefill = Estimate(float(tokens_per_s))

    def saving(self, tiers: Sequence[str], top: str, block_bytes: int, block_tokens: int,
               count: int) -> float:
        """Estimated seconds saved by loading the first ``count`` blocks of ``tiers`` instead
        of recomputing them (negative: loading is slower)."""
        if count <= 0:
            return 0.0
        return self._savings(tiers[:count], top, block_bytes, block_tokens)[-1][1]

    def worth_loading(self, tiers: Sequence[str], top: str, block_bytes: int,
                      block_tokens: int) -> int:
        """How many blocks of a prefix held in ``tiers`` (the tier of each block, in order)
        to load into ``top`` so that the time to first token is least: the cut, at a change
        of tier or at the end, where the estimated recompute time of the loaded tokens beats
        their estimated load time by the most (0 if loading never pays). Copies on different
        paths run side by side, so a cut's load time is its slowest path's; blocks already
        in ``top`` cost nothing (their recompute is saved, no copy is made)."""
        best, best_saved = 0, 0.0
        for count, saved in self._savings(tiers, top, block_bytes, block_tokens):
            if saved > best_saved:
                best, best_saved = count, saved
        return best

    def _savings(self, tiers: Sequence[str], top: str, block_bytes: int,
                 block_tokens: int) -> list[tuple[int, float]]:
        """(blocks loaded, seconds saved) at each cut of ``tiers``: every change of tier and
        the end. Each path's estimates are read once (this runs per request)."""
        per_token = 1.0 / self.prefill.value(self._clock())
        costs: dict[str, tuple[float, float, int]] = {}     # overhead, seconds/byte, queued
        loading: dict[str, int] = {}                         # bytes up to this cut, per path
        savings: list[tuple[int, float]] = []
        count = 0
        for tier, run in groupby(tiers):
            blocks = sum(1 for _ in run)
            count += blocks
            if tier != top:     # blocks already in the top tier: nothing to move, no path
                path = path_name(tier, top)
                if path not in costs:
                    costs[path] = (self.overhead(path), 1.0 / self.bandwidth(path),
                                   self._backlog(path) * block_bytes)
                loading[path] = loading.get(path, 0) + blocks * block_bytes
            load = max((costs[q][0] + (costs[q][2] + nbytes) * costs[q][1]
                        for q, nbytes in loading.items()), default=0.0)
            savings.append((count, count * block_tokens * per_token - load))
        return savings

    def snapshot(self) -> dict:
        """Every estimate, for status output and metrics."""
        now = self._clock()
        paths = sorted(set(self._bandwidth) | set(self._overhead))
        return {"paths": {p: {"bandwidth_bytes_per_s": round(self.bandwidth(p)),
                              "overhead_seconds": round(self.overhead(p), 6),
                              "samples": self._estimate(self._bandwidth, p, True).samples,
                              "blocks_in_flight": self._backlog(p)}
                          for p in paths},
                "prefill_tokens_per_s": round(self.prefill.value(now), 1),
                "prefill_samples": self.prefill.samples}

    # -- estimates and their priors --------------------------------------------------------
    def _estimate(self, table: dict[str, Estimate], path: str,
                  higher_is_better: bool) -> Estimate:
        estimate = table.get(path)
        if estimate is None:
            split_path(path)                    # a malformed path is an error, not a new row
            estimate = table[path] = Estimate(self._kind_prior(path, higher_is_better),
                                              higher_is_better)
        return estimate

    def _value(self, table: dict[str, Estimate], path: str, higher_is_better: bool) -> float:
        now = self._clock()
        return self._estimate(table, path, higher_is_better).value(
            now, self._prior(table, path, now))

    def _prior(self, table: dict[str, Estimate], path: str, now: float) -> float:
        """The worst measured estimate among the other paths to or from ``path``'s slower
        tier, else the prior of that tier's kind."""
        estimate = table[path] if path in table else None
        far = _slower_tier(path)
        related = [e.value(now) for p, e in table.items()
                   if e.samples and p != path and _slower_tier(p) == far]
        higher_is_better = estimate.higher_is_better if estimate else table is self._bandwidth
        if not related:
            return self._kind_prior(path, higher_is_better)
        return min(related) if higher_is_better else max(related)

    def _kind_prior(self, path: str, higher_is_better: bool) -> float:
        """The prior of the kind of ``path``'s slower tier."""
        kind = spec(_slower_tier(path)).kind
        prior = self._priors.get(kind)
        if prior is None:
            raise ValueError(f"no cost prior for {kind.value} tiers (path {path}); the "
                             f"model knows {sorted(k.value for k in self._priors)}")
        return prior.bandwidth if higher_is_better else prior.overhead


def _ratio(amount: int | float, seconds: float) -> float:
    """``amount / seconds`` as a float; NaN (a sample ignored) past the floats' range."""
    try:
        return amount / seconds
    except OverflowError:
        return math.nan


def _slower_tier(path: str) -> str:
    """The tier of a path further from the engine (the one whose medium limits it)."""
    source, target = split_path(path)
    return max(source, target, key=order_of)
