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

Sources, lowest precedence first: kvstrata's defaults (for the tiers, :data:`DEFAULT_TIERS`),
its TOML file, ``KVSTRATA_*`` environment variables, the extra config
(:func:`kvstrata.config.load_config`). G1 is SGLang's
host pool (its page count and page size); the block geometry is the pool's
(:mod:`.host_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ...config import ConfigError, KvConfig, TierConfig, load_config
from ...tiers import TOP_TIER, TierKind, first_of_kind
from .. import engine_config
from ..engine_config import ENGINE_KEYS
from .host_pool import HostPoolView

__all__ = ["BackendSettings", "SGLangConfigError", "settings_from", "kv_config", "KNOWN",
           "SGLANG_KEYS", "DEFAULT_TIERS"]

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "prefetch_threshold", "prefetch_timeout_base",
                         "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
                         "tp_lcm_size"})
"""SGLang's own keys that may reach a dynamic backend's extra config: its cache controller
takes the prefetch keys and ``tp_lcm_size`` out before it builds the backend, but a PD
decode server's offload manager hands the whole extra config on (they were refused as
unknown, and a decode server with the documented config did not start)."""

KNOWN = ENGINE_KEYS
"""The keys kvstrata reads: the ones every engine connector reads, no SGLang-only ones."""

DEFAULT_TIERS = {first_of_kind(TierKind.DISK): {"bytes": "4GiB"}}
"""kvstrata under SGLang's host pool when nothing says otherwise: a 4 GiB G3."""


class SGLangConfigError(ValueError):
    """The backend's settings are invalid; the message names every problem."""


@dataclass(frozen=True)
class BackendSettings:
    """What the extra config asked for (checked; the config itself is built once the host
    pool's geometry is known: :func:`kv_config`)."""

    tiers: dict[str, TierConfig] | None
    """The extra config's tiers under the host pool (None: not given, so kvstrata's own
    file and environment say, else :data:`DEFAULT_TIERS`)."""
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
    if extra.get("interface_v1") not in (True, 1):     # "false" is a true string
        problems.append("set \"interface_v1\": 1 in --hicache-storage-backend-extra-config: "
                        "kvstrata fills and reads SGLang's host pool pages in place (the "
                        "copying get/set path is not served)")
    tiers = (engine_config.lower_tiers(extra["tiers"], problems, "SGLang's host pool")
             if "tiers" in extra else None)
    config_path = engine_config.config_path(extra, problems)
    overrides = engine_config.config_overrides(extra, problems)
    events = engine_config.events(extra, problems)
    worker_id = engine_config.worker_id(extra, problems)
    if problems:
        raise SGLangConfigError("kvstrata HiCache backend: " + "; ".join(problems))
    return BackendSettings(tiers, config_path, overrides, events, worker_id)


def kv_config(settings: BackendSettings, pool: HostPoolView, model_name: str | None,
              env: Mapping[str, str] | None = None) -> KvConfig:
    """kvstrata's config for this rank: G1 is the host pool (its pages, its page size and
    the geometry of its runs), the lower tiers and the rest from the settings. The pool's
    layout is part of the model's identity, so stored blocks are only read by a pool of the
    same layout."""
    given = {} if settings.tiers is None else {"tiers": settings.tiers}
    try:
        # the tiers of the extra config, else kvstrata's own file and environment, else
        # DEFAULT_TIERS; G1 is the host pool whatever they say
        config = load_config(settings.config_path, env=env, defaults={"tiers": DEFAULT_TIERS},
                             fixed_tiers={TOP_TIER: TierConfig(blocks=pool.pages)}, **{
                                 **settings.overrides, **given,
                                 "block_size": pool.page_size, "model": pool.geometry,
                                 "model_id": f"{model_name or ''}|sglang-host:{pool.layout}"})
    except ConfigError as exc:
        raise SGLangConfigError("kvstrata HiCache backend: " + "; ".join(exc.problems)) \
            from None
    # SGLang's calls name pages, not requests: a filter that learns from requests would
    # learn nothing here, so the default admits every block.
    return config if config.admission is not None else replace(config, admission="always")
