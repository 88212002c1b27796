"""Host RAM (G2) owned by kvstrata: every block one contiguous slot whose stride is aligned to
4 KiB, so a disk tier reads and writes host slots in place with O_DIRECT, and the blocks of
every tier further down pass through it."""

from __future__ import annotations

import os

from ..config import KvConfig, format_size
from ..physical import HostStorage, LayoutConfig, PhysicalError, Storage
from ..physical.leftovers import reclaim
from ..physical.storage.host_shared import (FollowedHostStorage, PublishedHostStorage,
                                            memory_sharing_problem)
from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind, StorageOptions, TierSetupError, layout_config_for, ram_problem
from .ram_claims import claim_host_ram

__all__ = ["HostKind", "KIND", "HOST_ALIGNMENT", "host_slot_bytes", "shared_host_problem"]

HOST_ALIGNMENT = 4096
"""Host block stride alignment: lets the disk read and write host slots in place (O_DIRECT)."""


class HostKind(Kind):
    """Host RAM: must fit this machine's memory (and ``max_host_bytes``); assumed fast.
    With :attr:`~.base.StorageOptions.shared_host` it is kept once in shared memory for the
    processes that hold the same bytes (:mod:`kvstrata.physical.storage.host_shared`)."""

    kind = TierKind.HOST
    cost_prior = CostPrior(bandwidth=5e9, overhead=100e-6)

    def problems(self, config: KvConfig, tier: str, options: StorageOptions,
                 ranks: int = 1) -> list[str]:
        blocks = config.tier_blocks(tier)
        need = blocks * host_slot_bytes(layout_config_for(config, 1))
        problems = []
        limit = options.max_host_bytes
        if limit is not None and need > limit:
            problems.append(f"{tier} of {blocks} blocks needs {format_size(need)} of host "
                            f"RAM, over the limit of {format_size(limit)}; shrink tier {tier}")
        held_by = f" ({ranks} ranks)" if ranks > 1 else ""
        problem = ram_problem(f"tier {tier}{held_by}", ranks * need)
        if problem:
            problems.append(problem)
        if options.shared_host is not None:
            problem = shared_host_problem(tier, options.shared_host.directory)
            if problem:
                problems.append(problem)
        return problems

    def build(self, tier: str, built, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        cfg = geometry.with_blocks(built.config.tier_blocks(tier)).with_alignment(HOST_ALIGNMENT)
        shared = options.shared_host
        try:
            if shared is not None and not shared.writer:    # maps the writer's: no RAM of its own
                return FollowedHostStorage(cfg, shared.path(tier))
            # counted with the host tiers of this user's other processes here (data-parallel
            # engines, other servers), which the check at start cannot see
            claim = claim_host_ram(cfg.num_blocks * host_slot_bytes(cfg), f"tier {tier}")
            if claim is not None:
                built.claims.append(claim)
            if shared is None:
                return HostStorage(cfg, verify_reads=options.verify_host_reads)
            reclaim(shared.directory, f"kvstrata-{tier.lower()}-")  # of killed servers
            return PublishedHostStorage(cfg, shared.path(tier),
                                        verify_reads=options.verify_host_reads)
        except PhysicalError as exc:
            raise TierSetupError(f"{tier}: {exc}") from exc

    def followed_exists(self, config: KvConfig, tier: str, options: StorageOptions) -> bool:
        """Whether the shared host tier these ``options`` read was made by its writer (true
        where they read none)."""
        shared = options.shared_host
        return shared is None or shared.writer or shared.path(tier).exists()

    def followed_where(self, config: KvConfig, tier: str, options: StorageOptions) -> str:
        return "" if options.shared_host is None else str(options.shared_host.path(tier))


def host_slot_bytes(geometry: LayoutConfig) -> int:
    """The bytes one block of ``geometry`` takes in host RAM: its payload rounded up to
    :data:`HOST_ALIGNMENT`."""
    return -(-geometry.block_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


def shared_host_problem(tier: str, directory: str) -> str | None:
    """Why a shared host tier ``tier`` cannot be kept with its rendezvous files in
    ``directory`` (None if it can): its memory is no file (a memfd, counted as RAM like any
    host tier), but the other processes find it through that directory."""
    if not hasattr(os, "memfd_create"):
        return f"tier {tier}: this platform has no memfd_create to share host memory"
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        return f"tier {tier}: {directory} is not a directory this process can write in"
    problem = memory_sharing_problem()
    return f"tier {tier}: {problem}" if problem else None


KIND = HostKind()
