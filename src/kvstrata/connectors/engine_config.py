"""The keys every engine connector reads from its engine's extra config, checked one way.

vLLM's ``kv_connector_extra_config`` and SGLang's ``--hicache-storage-backend-extra-config``
both carry kvstrata's settings beside the engine's own: the tiers under the engine's cache,
kvstrata's config keys (``disk_dir``, ``eviction``, ``admission``, ``tenant``,
``tenant_quotas``), a TOML file (``config``), event sinks (``events``) and the engine's id in
its events (``worker_id``). This module checks those keys for both connectors (each bad
value becomes one line in ``problems``, so a connector refuses to start naming every
problem at once); each connector adds its own keys and builds its config.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from ..config import ConfigError, TierConfig, normalize_tiers, parse_tiers_flag
from ..events.spec import sink_problem, sink_specs
from ..tiers import TOP_TIER

__all__ = ["ENGINE_KEYS", "OVERRIDE_KEYS", "checked", "is_int", "is_number", "lower_tiers",
           "config_overrides", "config_path", "events", "worker_id"]

ENGINE_KEYS = frozenset({"tiers", "disk_dir", "eviction", "admission", "events", "worker_id",
                         "config", "tenant", "tenant_quotas"})
"""Keys of an engine's extra config that every kvstrata connector reads."""

OVERRIDE_KEYS = ("tenant", "eviction", "admission", "disk_dir", "tenant_quotas")
"""Keys of kvstrata's own config that the extra config may set."""


def checked(extra: Mapping[str, Any], key: str, default: Any, ok: Callable[[Any], bool],
            what: str, problems: list[str]) -> Any:
    """``extra[key]`` (``default`` when absent) if ``ok`` says it is valid; else
    ``default``, and ``"<key> must be <what>, got <value>"`` in ``problems``."""
    value = extra.get(key, default)
    if ok(value):
        return value
    problems.append(f"{key} must be {what}, got {value!r:.80}")
    return default


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lower_tiers(raw: Any, problems: list[str], top: str) -> dict[str, TierConfig]:
    """The tiers under the engine's own cache, from a table or a ``"G2=4GiB,G3=16GiB"``
    string. ``top`` says what G1 is in this engine (it is sized by the engine, not here)."""
    try:
        if isinstance(raw, str):
            tiers = dict(parse_tiers_flag(raw))
        elif isinstance(raw, Mapping):
            tiers = dict(normalize_tiers(raw, problems))
        else:
            problems.append(f"tiers must be a mapping or 'G2=4GiB,G3=16GiB', got {raw!r:.80}")
            return {}
    except ConfigError as exc:
        problems.append("tiers: " + "; ".join(exc.problems))
        return {}
    except ValueError as exc:
        problems.append(f"tiers: {exc}")
        return {}
    if TOP_TIER in tiers:
        problems.append(f"tiers: {TOP_TIER} is {top}; size it with the engine's options, not "
                        f"here")
        tiers.pop(TOP_TIER)
    if not tiers:
        problems.append(f"tiers: name at least one tier under {top}")
    return tiers


def config_overrides(extra: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """The keys of kvstrata's own config that the extra config sets (:data:`OVERRIDE_KEYS`),
    checked for type (their values when the config is validated)."""
    overrides: dict[str, Any] = {}
    if "tenant_quotas" in extra:
        if not isinstance(extra["tenant_quotas"], Mapping):
            problems.append(f"tenant_quotas must be a table of tenants, got "
                            f"{extra['tenant_quotas']!r:.80}")
        else:
            overrides["tenant_quotas"] = extra["tenant_quotas"]
    if "tenant" in extra:
        if not isinstance(extra["tenant"], str):
            problems.append(f"tenant must be a string, got {extra['tenant']!r:.80}")
        else:
            overrides["tenant"] = extra["tenant"]
    for key in ("eviction", "admission", "disk_dir"):
        if key in extra:
            if not isinstance(extra[key], str) or not extra[key]:
                problems.append(f"{key} must be a non-empty string, got {extra[key]!r:.80}")
            else:
                overrides[key] = extra[key]
    return overrides


def config_path(extra: Mapping[str, Any], problems: list[str]) -> str | None:
    """The kvstrata TOML file the extra config names (``config``), if any."""
    path = extra.get("config")
    if path is not None and not isinstance(path, str):
        problems.append(f"config must be a path, got {path!r:.80}")
        return None
    return path


def events(extra: Mapping[str, Any], problems: list[str]) -> tuple[str, ...]:
    """kvstrata event sink specs (:mod:`kvstrata.events.spec`), one or a list."""
    return sink_specs(extra.get("events", ()), problems)


def worker_id(extra: Mapping[str, Any], problems: list[str]) -> int:
    """This engine's id in its events (``worker_id``, default 0)."""
    return checked(extra, "worker_id", 0, lambda v: is_int(v) and 0 <= v < 2**64,
                   "an integer in 0..2^64-1", problems)


def engine_directory(directory: str, engine_index: int) -> str:
    """Where data-parallel engine ``engine_index`` keeps its disk tier under ``directory``:
    the directory itself for engine 0 (as without data parallelism), ``dp<k>`` in it for
    engine ``k``."""
    return os.path.join(directory, f"dp{engine_index}") if engine_index else directory


def engine_sink_problems(events: tuple[str, ...], engine_index: int) -> list[str]:
    """What stops data-parallel engine ``engine_index`` from publishing to the sinks
    ``events``, as checked for engine 0 (:func:`~kvstrata.events.spec.sink_problem`): its
    own file and bound port, and a format that can tell it from engine 0."""
    if not engine_index:
        return []
    return [f"data-parallel engine {engine_index}: {problem}" for problem in
            (sink_problem(spec, dp_rank=engine_index) for spec in events) if problem]
