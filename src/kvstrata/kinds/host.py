"""Host RAM (G2) owned by kvstrata: every block one contiguous slot whose stride is aligned to
4 KiB, so a disk tier reads and writes host slots in place with O_DIRECT, and the blocks of
every tier further down pass through it."""

from __future__ import annotations

import os
import shutil

from ..config import KvConfig, format_size
from ..physical import HostStorage, LayoutConfig, PhysicalError, Storage
from ..physical.leftovers import reclaim
from ..physical.storage.host_shared import (FollowedHostStorage, PublishedHostStorage,
                                            shared_file_bytes)
from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind, StorageOptions, TierSetupError, layout_config_for, ram_problem

__all__ = ["HostKind", "KIND", "HOST_ALIGNMENT", "host_slot_bytes", "shared_host_problem"]

HOST_ALIGNMENT = 4096
"""Host block stride alignment: lets the disk read and write host slots in place (O_DIRECT)."""


class HostKind(Kind):
    """Host RAM: must fit this machine's memory (and ``max_host_bytes``); assumed fast.
    With :attr:`~.base.StorageOptions.shared_host` it is kept once in shared memory for the
    processes that hold the same bytes (:mod:`kvstrata.physical.storage.host_shared`); it
    must then also fit the shared-memory filesystem."""

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
            problem = shared_host_problem(config, tier, options.shared_host.directory, ranks)
            if problem:
                problems.append(problem)
        return problems

    def build(self, tier: str, built, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        cfg = geometry.with_blocks(built.config.tier_blocks(tier)).with_alignment(HOST_ALIGNMENT)
        shared = options.shared_host
        try:
            if shared is None:
                return HostStorage(cfg, verify_reads=options.verify_host_reads)
            if shared.writer:
                reclaim(shared.directory, f"kvstrata-{tier.lower()}-")  # of killed servers
                return PublishedHostStorage(cfg, shared.path(tier),
                                            verify_reads=options.verify_host_reads)
            return FollowedHostStorage(cfg, shared.path(tier))
        except PhysicalError as exc:
            raise TierSetupError(f"{tier}: {exc}") from exc

    def followed_exists(self, config: KvConfig, tier: str, options: StorageOptions) -> bool:
        """Whether the shared host tier these ``options`` read was made by its writer (true
        where they read none)."""
        shared = options.shared_host
        return shared is None or shared.writer or shared.path(tier).exists()


def host_slot_bytes(geometry: LayoutConfig) -> int:
    """The bytes one block of ``geometry`` takes in host RAM: its payload rounded up to
    :data:`HOST_ALIGNMENT`."""
    return -(-geometry.block_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


def shared_host_problem(config: KvConfig, tier: str, directory: str, copies: int = 1) -> str | None:
    """Why ``copies`` shared host tiers ``tier`` of ``config`` cannot be kept in the
    shared-memory ``directory`` (None if they can). Its filesystem's whole size is what
    counts, not its free space: every process of a server decides the same, whenever it
    asks (a writer may have taken its share already)."""
    if not os.path.isdir(directory):
        return f"tier {tier}: shared-memory directory {directory} does not exist"
    stride = host_slot_bytes(layout_config_for(config, 1))
    need = copies * shared_file_bytes(config.tier_blocks(tier), stride)
    total = shutil.disk_usage(directory).total
    if need > total:
        held_by = f" ({copies} copies)" if copies > 1 else ""
        return (f"tier {tier}{held_by} needs {format_size(need)} of shared memory; "
                f"{directory} holds {format_size(total)} in all")
    return None


KIND = HostKind()
