"""The storages of a config's tiers, each built by its kind's module (:mod:`kvstrata.kinds`).

:func:`check_tiers` names every reason the tiers cannot be built here, before anything is
allocated (both ``KvBlockManager`` and the vLLM connector's scheduler ask it);
:func:`build_storages` checks, then builds one storage per tier, fastest first, leaving
nothing behind on error; :func:`peek_recovered` reads what durable tiers kept without
building them (a scheduler whose workers build them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ..config import KvConfig
from ..physical import LayoutConfig, Storage
from ..tiers import TierKind, first_of_kind, ordered, spec
from . import KINDS, kind_of
from .base import RecoveredRow, StorageOptions, Storages, TierSetupError

__all__ = ["Storages", "check_tiers", "build_storages", "peek_recovered"]


def check_tiers(config: KvConfig, options: StorageOptions, ranks: int = 1,
                copies: Mapping[TierKind, int] | None = None) -> list[str]:
    """Every reason the tiers of ``config`` cannot be built on this machine by ``ranks``
    ranks (from ``options.rank`` on; each holds its share of every block), found without
    allocating anything: a kind of tier with no module, a fastest tier that is not device
    memory, a tier whose blocks move through host RAM without a host tier (or KV tensors
    wrapped as the device tier that are themselves in host RAM, as SGLang's host pool is), a
    tier of no block, and what each kind finds (:meth:`~kvstrata.kinds.base.Kind.problems`).
    ``copies``: per kind of tier, how many of it those ranks keep, where ranks holding the
    same bytes share one (a kind not named: one per rank)."""
    identity = _identity_problem(options)
    if identity:
        return [identity]
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
    host_ram = TierKind.HOST in kinds or _wrapped_in_host_ram(options.kv_caches)
    for tier in tiers:
        kind = kind_of(tier)
        if kind.through_host and not host_ram:
            problems.append(f"tier {tier} ({kind.kind.value}) needs tier "
                            f"{first_of_kind(TierKind.HOST)} (host): its blocks move through "
                            f"host RAM")
        if config.tier_blocks(tier) < 1:
            problems.append(f"tier {tier} holds no block of {config.bytes_per_block} bytes")
            continue
        problems.extend(kind.problems(config, tier, options,
                                      (copies or {}).get(kind.kind, ranks)))
    return problems


def _identity_problem(options: StorageOptions) -> str:
    """Why ``options.rank`` / ``world_size`` name no rank ("" if they do): they are part of
    the fingerprint and home of what is stored, so a wrong one would file blocks away where
    no rank looks."""
    rank, world = options.rank, options.world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return f"world_size must be an integer >= 1, got {world!r:.40}"
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        return f"rank must be an integer in 0..{world - 1} (world_size {world}), got {rank!r:.40}"
    return ""


def _wrapped_in_host_ram(kv_caches) -> bool:
    """Whether KV tensors given to wrap as the device tier all live in host RAM."""
    if kv_caches is None:
        return False
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    return bool(tensors) and all(getattr(getattr(t, "device", None), "type", None) == "cpu"
                                 for t in tensors)


def build_storages(config: KvConfig, options: StorageOptions) -> Storages:
    """One storage per tier of ``config``, fastest first (:func:`check_tiers` first); on
    error (:class:`~kvstrata.kinds.base.TierSetupError`) nothing built here is left behind,
    and a device tier the caller wrapped (``options.g1``) is left open, as it came."""
    problems = check_tiers(config, options)
    if problems:
        raise TierSetupError(problems)
    built = Storages(config)
    try:
        geometry: LayoutConfig | None = None
        for tier in ordered(config.tiers):
            kind = kind_of(tier)
            storage = kind.build(tier, built, geometry, options)
            built.by_tier[tier] = storage
            built.kinds[tier] = kind
            if geometry is None:
                geometry = storage.config
                if geometry.num_blocks != config.tier_blocks(tier):
                    sized = dict(config.tiers)
                    sized[tier] = replace(sized[tier], blocks=geometry.num_blocks, bytes=None)
                    built.config = replace(config, tiers=sized)
    except BaseException:
        if options.g1 is not None:               # the caller's: it closes it
            built.by_tier = {t: s for t, s in built.by_tier.items() if s is not options.g1}
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
