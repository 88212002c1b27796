"""The storages of a config's tiers, each built by its kind's module (:mod:`kvstrata.kinds`).

:func:`check_tiers` names every reason the tiers cannot be built here, before anything is
allocated (both ``KvBlockManager`` and the vLLM connector's scheduler ask it);
:func:`build_storages` checks, then builds one storage per tier, fastest first, leaving
nothing behind on error; :func:`peek_recovered` reads what durable tiers kept without
building them (a scheduler whose workers build them).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace

from ..config import KvConfig
from ..physical import LayoutConfig, Storage
from ..tiers import TierKind, first_of_kind, ordered, spec
from ..types import BlockRecord
from . import KINDS, kind_of
from .base import RecoveredRow, StorageOptions, TierSetupError

__all__ = ["Storages", "check_tiers", "build_storages", "peek_recovered"]


@dataclass
class Storages:
    """The storages built (by tier, fastest first), the config with the fastest tier sized
    to its storage, and the temporary directories to remove on close."""

    config: KvConfig
    by_tier: dict[str, Storage] = field(default_factory=dict)
    temp_dirs: list[str] = field(default_factory=list)

    def recovered_rows(self) -> dict[str, list[RecoveredRow]]:
        """Per tier that kept blocks from a previous process, (slot, sequence hash, parent
        hash, local hash) of each, oldest first."""
        out = {}
        for tier, storage in self.by_tier.items():
            rows = kind_of(tier).recovered_rows(storage)
            if rows:
                out[tier] = rows
        return out

    def recovered(self) -> dict[str, list[tuple[int, BlockRecord]]]:
        """:meth:`recovered_rows` as (slot, record) pairs: what
        :meth:`~kvstrata.placement.Planner.restore` takes."""
        block_size = self.config.block_size
        return {tier: [(slot, BlockRecord(seq, local, parent, block_size))
                       for slot, seq, parent, local in rows]
                for tier, rows in self.recovered_rows().items()}

    def close(self) -> None:
        """Free every storage (a temporary slab is deleted, a durable one kept) and the
        temporary directories."""
        for storage in self.by_tier.values():
            storage.close()
        for directory in self.temp_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self.temp_dirs = []


def check_tiers(config: KvConfig, options: StorageOptions, ranks: int = 1) -> list[str]:
    """Every reason the tiers of ``config`` cannot be built on this machine by ``ranks``
    ranks (from ``options.rank`` on; each holds its share of every block), found without
    allocating anything: a kind of tier with no module, a fastest tier that is not device
    memory, a tier whose blocks move through host RAM without a host tier, a tier of no
    block, and what each kind finds (:meth:`~kvstrata.kinds.base.Kind.problems`)."""
    tiers = ordered(config.tiers)
    missing = [t for t in tiers if kind_of(t) is None]
    if missing:
        return [f"no storage for tier(s) {', '.join(missing)} "
                f"({', '.join(spec(t).kind.value for t in missing)}) yet; kvstrata holds "
                f"{', '.join(k.value for k in KINDS)} tiers"]
    problems = []
    if spec(tiers[0]).kind is not TierKind.DEVICE:
        problems.append(f"the fastest tier must be device memory, got {tiers[0]}")
    kinds = {spec(t).kind for t in tiers}
    for tier in tiers:
        kind = kind_of(tier)
        if kind.through_host and TierKind.HOST not in kinds:
            problems.append(f"tier {tier} ({kind.kind.value}) needs tier "
                            f"{first_of_kind(TierKind.HOST)} (host): its blocks move through "
                            f"host RAM")
        if config.tier_blocks(tier) < 1:
            problems.append(f"tier {tier} holds no block of {config.bytes_per_block} bytes")
            continue
        problems.extend(kind.problems(config, tier, options, ranks))
    return problems


def build_storages(config: KvConfig, options: StorageOptions) -> Storages:
    """One storage per tier of ``config``, fastest first (:func:`check_tiers` first); on
    error (:class:`~kvstrata.kinds.base.TierSetupError`) nothing is left behind."""
    problems = check_tiers(config, options)
    if problems:
        raise TierSetupError(problems)
    built = Storages(config)
    try:
        geometry: LayoutConfig | None = None
        for tier in ordered(config.tiers):
            storage = kind_of(tier).build(tier, built, geometry, options)
            built.by_tier[tier] = storage
            if geometry is None:
                geometry = storage.config
                if geometry.num_blocks != config.tier_blocks(tier):
                    sized = dict(config.tiers)
                    sized[tier] = replace(sized[tier], blocks=geometry.num_blocks, bytes=None)
                    built.config = replace(config, tiers=sized)
    except BaseException:
        built.close()
        raise
    return built


def peek_recovered(config: KvConfig, options: StorageOptions,
                   rank: int) -> dict[str, list[RecoveredRow]] | None:
    """What :func:`build_storages` recovers (or recovered) for ``rank``'s durable tiers, read
    without touching them: the rows of each tier that kept blocks. None when a durable tier
    cannot be read from here (another machine, nothing stored yet)."""
    out: dict[str, list[RecoveredRow]] = {}
    for tier in ordered(config.tiers):
        kind = kind_of(tier)
        rows = kind.peek_recovered(config, tier, options, rank) if kind is not None else []
        if rows is None:
            return None
        if rows:
            out[tier] = rows
    return out
