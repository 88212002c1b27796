"""Device memory (G1): the engine's KV tensors wrapped zero-copy, or a region allocated for
them (a CPU tensor stands in without a GPU). Its block count is the tier's size; every other
tier takes its geometry from it."""

from __future__ import annotations

from ..config import KvConfig
from ..physical import DeviceStorage, LayoutConfig, PhysicalError, Storage
from ..placement.costs import CostPrior
from ..tiers import TierKind
from .base import Kind, StorageOptions, TierSetupError, layout_config_for, ram_problem

__all__ = ["DeviceKind", "KIND"]


class DeviceKind(Kind):
    """Device memory: built first; a copy to or from it is assumed fast until measured."""

    kind = TierKind.DEVICE
    cost_prior = CostPrior(bandwidth=10e9, overhead=50e-6)

    def problems(self, config: KvConfig, tier: str, options: StorageOptions,
                 ranks: int = 1) -> list[str]:
        if options.g1 is None and options.kv_caches is None and options.device is not None:
            problem = _device_problem(options.device)
            if problem:
                return [f"tier {tier}: {problem}"]
        if not _stands_in(options):
            return []
        geometry = layout_config_for(config, config.tier_blocks(tier))
        problem = ram_problem(f"tier {tier}", ranks * geometry.num_blocks * geometry.block_bytes)
        return [problem] if problem else []

    def build(self, tier: str, built, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        config = built.config
        if options.g1 is not None:
            got = options.g1.config
            if got.page_size != config.block_size or got.block_bytes != config.bytes_per_block:
                raise TierSetupError(
                    f"{tier}: the engine's KV blocks hold {got.page_size} tokens in "
                    f"{got.block_bytes} bytes; the config says {config.block_size} tokens in "
                    f"{config.bytes_per_block} bytes")
            return options.g1
        try:
            if options.kv_caches is not None:
                storage = DeviceStorage.wrap(options.kv_caches, kv_layout=options.kv_layout)
                problems = geometry_problems(storage.config, config)
                if problems:
                    storage.close()
                    raise TierSetupError("KV tensors do not match the config: "
                                         + "; ".join(problems))
                return storage
            return DeviceStorage.allocate(layout_config_for(config, config.tier_blocks(tier)),
                                          device=options.device, kv_layout=options.g1_layout)
        except PhysicalError as exc:
            raise TierSetupError(f"{tier}: {exc}") from exc


def _stands_in(options: StorageOptions) -> bool:
    """Whether the device tier will be allocated in host RAM (a CPU stand-in)."""
    return (not options.engine_kv and options.g1 is None and options.kv_caches is None
            and (options.device is None or str(options.device).startswith("cpu")))


def _device_problem(device) -> str:
    """Why the device tier cannot be allocated on ``device`` ("" if it can)."""
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"device {device!r:.80} is not a device torch knows"
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (where.index or 0) >= count:
            return f"device {device!r} is not on this machine ({count} CUDA device(s))"
    elif where.type != "cpu":
        return f"device {device!r}: kvstrata allocates G1 on CUDA or CPU (a stand-in)"
    return ""


def geometry_problems(got: LayoutConfig, config: KvConfig) -> list[str]:
    """How the engine's KV tensors (of geometry ``got``) differ from ``config.model``."""
    m = config.model
    want = layout_config_for(config, got.num_blocks)
    problems = []
    if got.page_size != config.block_size:
        problems.append(f"they hold {got.page_size}-token blocks but config.block_size is "
                        f"{config.block_size}")
    if got.num_layers != want.num_layers:
        problems.append(f"{got.num_layers} layers, config.model.num_layers is "
                        f"{want.num_layers}")
    if got.outer_dim != want.outer_dim:
        problems.append(f"outer dim {got.outer_dim}, config.model.outer_dim is "
                        f"{want.outer_dim}")
    if got.inner_dim != want.inner_dim:
        problems.append(f"{got.inner_dim} elements per token (heads x head dim), "
                        f"config.model has kv_heads x head_dim = {m.kv_heads} x "
                        f"{m.head_dim} = {want.inner_dim}")
    if got.dtype != want.dtype:
        problems.append(f"dtype {got.dtype}, config.model.dtype is {want.dtype}")
    return problems


KIND = DeviceKind()
