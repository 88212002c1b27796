"""Host RAM (G2) owned by kvstrata: every block one contiguous slot whose stride is aligned to
4 KiB, so a disk tier reads and writes host slots in place with O_DIRECT, and the blocks of
every tier further down pass through it."""

from __future__ import annotations

from ..config import KvConfig, format_size
from ..physical import HostStorage, LayoutConfig, PhysicalError, Storage
from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind, StorageOptions, TierSetupError, layout_config_for, ram_problem

__all__ = ["HostKind", "KIND", "HOST_ALIGNMENT", "host_slot_bytes"]

HOST_ALIGNMENT = 4096
"""Host block stride alignment: lets the disk read and write host slots in place (O_DIRECT)."""


class HostKind(Kind):
    """Host RAM: must fit this machine's memory (and ``max_host_bytes``); assumed fast."""

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
        return problems

    def build(self, tier: str, built, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        cfg = geometry.with_blocks(built.config.tier_blocks(tier)).with_alignment(HOST_ALIGNMENT)
        try:
            return HostStorage(cfg, verify_reads=options.verify_host_reads)
        except PhysicalError as exc:
            raise TierSetupError(f"{tier}: {exc}") from exc


def host_slot_bytes(geometry: LayoutConfig) -> int:
    """The bytes one block of ``geometry`` takes in host RAM: its payload rounded up to
    :data:`HOST_ALIGNMENT`."""
    return -(-geometry.block_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


KIND = HostKind()
