"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config`` plus kvstrata's
own config.

SGLang hands a dynamic backend every key of its extra config but the few it pops itself
(prefetch settings). Its own keys that reach the backend are passed over
(:data:`SGLANG_KEYS`); kvstrata reads these (:data:`KNOWN`), anything else is refused with
every problem named (:class:`SGLangConfigError`):

=================  ================================================  =======================
key                meaning                                           default
=================  ================================================  =======================
``interface_v1``   must be true: SGLang then hands kvstrata page      (required)
                   indices of its host pool, which kvstrata fills
                   and reads in place
``tiers``          kvstrata's tiers under SGLang's host pool:         ``{"G3": {"bytes":
                   ``{"G3": {"bytes": "64GiB"}, "G4": {...}}``,       "4GiB"}}``
                   or ``"G3=64GiB"`` (a G2 adds host RAM of its own)
``disk_dir``       directory of G3; durable there (kept across       a temporary directory
                   restarts, one locked home per rank)
``config``         a kvstrata TOML file                               ``$KVSTRATA_CONFIG``
``tenant``         whose blocks a shared G4 holds                     ``""``
``tenant_quotas``  per named tenant, its quota per tier               none
``eviction`` /     kvstrata's eviction order / admission filter       ``default`` / ``always``
``admission``
``events``         kvstrata event sinks (``nats://...``, ``jsonl:``   none
                   ``PATH``, ...; docs/events.md): one or a list
``worker_id``      this server's id in its events (an integer)       0
=================  ================================================  =======================

Sources, lowest precedence first: kvstrata's defaults, its TOML file, ``KVSTRATA_*``
environment variables, the extra config (:func:`kvstrata.config.load_config`). G1 is SGLang's
host pool (its page count and page size); the block geometry is the pool's
(:mod:`.host_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ...config import ConfigError, KvConfig, TierConfig, load_config, normalize_tiers, \
    parse_tiers_flag
from ...events.spec import sink_specs
from ...tiers import TOP_TIER, TierKind, first_of_kind
from .host_pool import HostPoolView

__all__ = ["BackendSettings", "SGLangConfigError", "settings_from", "kv_config", "KNOWN",
           "SGLANG_KEYS", "DEFAULT_TIERS"]

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""SGLang's own keys that reach a dynamic backend's extra config."""

KNOWN = frozenset({"tiers", "disk_dir", "config", "tenant", "tenant_quotas", "eviction",
                   "admission", "events", "worker_id"})

DEFAULT_TIERS = {first_of_kind(TierKind.DISK): {"bytes": "4GiB"}}
"""kvstrata under SGLang's host pool when nothing says otherwise: a 4 GiB G3."""


class SGLangConfigError(ValueError):
    """The backend's settings are invalid; the message names every problem."""


@dataclass(frozen=True)
class BackendSettings:
    """What the extra config asked for (checked; the config itself is built once the host
    pool's geometry is known: :func:`kv_config`)."""

    tiers: dict[str, TierConfig]
    config_path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    """kvstrata event sink specs (:mod:`kvstrata.events.spec`)."""
    worker_id: int = 0


def settings_from(extra_config: Mapping[str, Any] | None) -> BackendSettings:
    """The settings in SGLang's extra config (``None``: the defaults, which then fail for
    want of ``interface_v1``)."""
    extra = dict(extra_config or {})
    problems: list[str] = []
    unknown = sorted(set(extra) - KNOWN - SGLANG_KEYS, key=str)
    if unknown:
        problems.append(f"unknown keys {unknown}; kvstrata reads {sorted(KNOWN)}")
    if not extra.get("interface_v1"):
        problems.append("set \"interface_v1\": 1 in --hicache-storage-backend-extra-config: "
                        "kvstrata fills and reads SGLang's host pool pages in place (the "
                        "copying get/set path is not served)")
    raw_tiers = extra.get("tiers", DEFAULT_TIERS)
    tiers: dict[str, TierConfig] = {}
    try:
        if isinstance(raw_tiers, str):
            tiers = parse_tiers_flag(raw_tiers)
        elif isinstance(raw_tiers, Mapping):
            tiers = normalize_tiers(raw_tiers, problems)
        else:
            problems.append(f"tiers must be a table or 'G3=64GiB', got {raw_tiers!r:.80}")
    except (ConfigError, ValueError) as exc:
        problems.append(f"tiers: {exc}")
    if TOP_TIER in tiers:
        problems.append(f"tiers: {TOP_TIER} is SGLang's host pool; give the tiers under it")
    if not tiers and not problems:
        problems.append("tiers: give at least one tier under SGLang's host pool (G3, G4)")
    config_path = extra.get("config")
    if config_path is not None and not isinstance(config_path, str):
        problems.append(f"config must be a path, got {config_path!r:.80}")
    overrides = {k: extra[k] for k in ("disk_dir", "tenant", "tenant_quotas", "eviction",
                                       "admission") if k in extra}
    events = sink_specs(extra.get("events", ()), problems)
    worker_id = extra.get("worker_id", 0)
    if isinstance(worker_id, bool) or not isinstance(worker_id, int) \
            or not 0 <= worker_id < 2**64:
        problems.append(f"worker_id must be an integer in 0..2^64-1, got {worker_id!r:.40}")
    if problems:
        raise SGLangConfigError("kvstrata HiCache backend: " + "; ".join(problems))
    return BackendSettings(tiers, config_path, overrides, events, worker_id)


def kv_config(settings: BackendSettings, pool: HostPoolView, model_name: str | None,
              env: Mapping[str, str] | None = None) -> KvConfig:
    """kvstrata's config for this rank: G1 is the host pool (its pages, its page size and
    the geometry of its runs), the lower tiers and the rest from the settings. The pool's
    layout is part of the model's identity, so stored blocks are only read by a pool of the
    same layout."""
    try:
        return load_config(settings.config_path, env=env, **{
            **settings.overrides,
            "tiers": {TOP_TIER: TierConfig(blocks=pool.pages), **settings.tiers},
            "block_size": pool.page_size, "model": pool.geometry,
            "model_id": f"{model_name or ''}|sglang-host:{pool.layout}"})
    except ConfigError as exc:
        raise SGLangConfigError("kvstrata HiCache backend: " + "; ".join(exc.problems)) \
            from None
