"""One configuration object for kvstrata, from keyword arguments, a TOML file and env vars.

(About 450 lines on purpose: one concern, turning every source of settings (keyword
arguments, TOML, ``KVSTRATA_*`` and Dynamo env vars) into one validated object; splitting the
sources apart would scatter the precedence rules.)

Precedence, lowest first: built-in defaults < TOML file < ``KVSTRATA_*`` / Dynamo env vars <
keyword arguments. :func:`load_config` merges them; :meth:`KvConfig.validate` reports every
problem at once in a single :class:`ConfigError`. docs/configuration.md lists every key.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .dtypes import ALIASES, DTYPE_NAMES, DtypeError, canonical_dtype, itemsize
from .paths import InputTooLargeError, path_problem, read_bounded
from .redact import redacted
from .logical.policy import ADMISSION_NAMES, EVICTION_NAMES
from .logical.slots import MAX_SLOTS as MAX_TIER_BLOCKS
from .tokens import MAX_BLOCK_SIZE
from .tiers import TIER_NAMES, TIERS, TOP_TIER, Addressing, TierKind, first_of_kind, ordered, spec

log = logging.getLogger(__name__)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
               "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
               "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


class ConfigError(ValueError):
    """An invalid configuration; ``problems`` lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            "invalid kvstrata config:\n" + "\n".join(f"  - {p}" for p in self.problems)
        )


def format_size(nbytes: int | float) -> str:
    """``nbytes`` for a message, in the largest binary unit that keeps it at least 1:
    ``"512 B"``, ``"4.00 KiB"``, ``"1.50 GiB"`` (never "0.00 GiB" for a small size)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_size(value: str | int | float) -> int:
    """Bytes from ``1073741824``, ``"4GiB"``, ``"2.5 GB"`` (GB = 10**9, GiB = 2**30)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"size must be a finite number >= 0, got {value}")
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r} (e.g. 4096, '4GiB', '2.5GB')")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


@dataclass(frozen=True)
class ModelGeometry:
    """What one KV block weighs: layers x (K,V) x block_size x kv_heads x head_dim x dtype."""

    num_layers: int = 4
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "bf16"
    outer_dim: int = 2  # 2 for K and V, 1 for MLA

    def bytes_per_block(self, block_size: int) -> int:
        return (
            self.num_layers * self.outer_dim * block_size * self.kv_heads * self.head_dim
            * _itemsize_or_2(self.dtype)
        )


def _itemsize_or_2(dtype: str) -> int:
    """Bytes per element, 2 for a name validation will refuse (sizes stay computable)."""
    try:
        return itemsize(dtype)
    except DtypeError:
        return 2


@dataclass(frozen=True)
class TierConfig:
    """One tier's size (``blocks`` or ``bytes``) and policies (None = the global ones)."""

    blocks: int | None = None
    bytes: int | None = None
    eviction: str | None = None
    admission: str | None = None
    path: str | None = None  # G3: directory for the slab file
    url: str | None = None   # G4: the object store, "http(s)://host:port/bucket"
    tenant_quota: str | None = None
    """The most of this tier any one tenant may hold: ``"25%"`` of it or a size
    (``"1GiB"``); None: no limit. ``KvConfig.tenant_quotas`` overrides it per tenant."""

    def num_blocks(self, bytes_per_block: int) -> int:
        if self.blocks is not None:
            return self.blocks
        if self.bytes is not None:
            return self.bytes // bytes_per_block
        return 0


DEFAULT_TIERS: dict[str, TierConfig] = {
    s.name: TierConfig(blocks=s.default_blocks) for s in TIERS if s.default_blocks is not None
}
"""The tiers and sizes of the default configuration (see ``default_blocks`` in
:mod:`kvstrata.tiers`): 128 MiB / 512 MiB / 2 GiB at the default geometry, small on purpose."""


DEFAULT_ADMISSION = "predicted-reuse"
"""The bottom tier's filter unless one is named (docs/policies.md: it was never below
admitting every block on any trace measured, and ahead on most)."""


@dataclass(frozen=True)
class KvConfig:
    """Everything a block manager needs to know; immutable, validated by :meth:`validate`.

    ``eviction`` is the default order of every tier; ``admission`` is the filter of the
    bottom tier (blocks the engine computes are offered to G1, blocks registered in a tier are
    offered to the next one down); a tier may override either. Tiers above the bottom admit
    every block unless they name a filter themselves: offload is write-through, so a block a
    tier refuses never reaches the tiers below it either (docs/policies.md, "Several tiers").
    """

    block_size: int = 16
    tiers: Mapping[str, TierConfig] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    eviction: str = "default"
    admission: str | None = None
    """The bottom tier's filter; None: :data:`DEFAULT_ADMISSION` on a bottom tier of the
    worker's own (G1-G3), ``always`` on G4 (shared by workers, whose filter would see one
    worker's requests only)."""
    model: ModelGeometry = field(default_factory=ModelGeometry)
    disk_dir: str | None = None
    keep_tokens: bool = False
    model_id: str = ""
    """The model's identity (name and revision) for the compatibility fingerprint of stored
    blocks (:mod:`kvstrata.compat`); "" leaves only the geometry to tell models apart."""
    tenant: str = ""
    """Who the blocks of a shared tier belong to: part of its namespace, so tenants of one
    store never read each other's blocks ("" is the shared default tenant)."""
    encrypt_at_rest: bool = False
    """Encrypt blocks stored in G3 and G4 (AES-256-GCM, a key derived from the deployment's
    secret, which must then be set): :mod:`kvstrata.physical.tags`."""
    tenant_quotas: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per named tenant (the engine's tenant key: ``salt:<cache_salt>`` or ``lora:<name>``
    in vLLM, :func:`kvstrata.tokens.tenant_key`), the most of each tier it may hold, as
    ``tenant_quota`` values: ``{"salt:alice": {"G2": "50%"}}``.
    Overrides the tiers' ``tenant_quota`` for that tenant (:mod:`kvstrata.placement.tenants`)."""

    @property
    def bytes_per_block(self) -> int:
        return self.model.bytes_per_block(self.block_size)

    def tier_blocks(self, tier: str) -> int:
        return self.tiers[tier].num_blocks(self.bytes_per_block)

    def tier_eviction(self, tier: str) -> str:
        return self.tiers[tier].eviction or self.eviction

    def tier_admission(self, tier: str) -> str:
        """``tier``'s admission filter: its own, else ``admission`` for the bottom tier and
        ``always`` for the tiers above it (see the class docstring)."""
        own = self.tiers[tier].admission
        if own:
            return own
        if tier != ordered(self.tiers)[-1]:
            return "always"
        if self.admission is not None:
            return self.admission
        shared = spec(tier).addressing is Addressing.KEYS     # G4: a store workers share
        return "always" if shared else DEFAULT_ADMISSION

    def tenant_limits(self, tier: str) -> tuple[int | None, dict[str, int]]:
        """The most blocks of ``tier`` one tenant may hold: ``(for any tenant, {named
        tenant: its own})``; None / absent: no limit. Call on a validated config."""
        capacity = self.tier_blocks(tier)
        default = self.tiers[tier].tenant_quota
        named = {t: quota_blocks(q[tier], capacity, self.bytes_per_block)
                 for t, q in self.tenant_quotas.items() if tier in q}
        return (None if default is None
                else quota_blocks(default, capacity, self.bytes_per_block)), named

    def directory_of(self, tier: str) -> str | None:
        """The directory a disk tier lives in: ``disk_dir``, else the tier's ``path``; None
        when neither names one (a temporary directory is used, removed when its owner
        closes). The one place this is decided."""
        directory = self.disk_dir or self.tiers[tier].path
        return os.fspath(directory) if directory else None

    def validate(self) -> "KvConfig":
        """Return self if valid, else raise one :class:`ConfigError` naming every problem."""
        shapes = _shape_problems(self)
        if shapes:                  # nothing else can be checked on parts of the wrong type
            raise ConfigError(shapes)
        problems: list[str] = []
        for flag in ("encrypt_at_rest", "keep_tokens"):       # "false" is a true string
            if not isinstance(getattr(self, flag), bool):
                problems.append(f"{flag} must be true or false, got "
                                f"{getattr(self, flag)!r:.40}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or not 0 < self.block_size <= MAX_BLOCK_SIZE:
            problems.append(f"block_size must be an integer in 1..{MAX_BLOCK_SIZE:,}, got "
                            f"{self.block_size!r:.40}")
        if not self.tiers:
            problems.append(f"at least one tier is required (e.g. {TOP_TIER})")
        for name in self.tiers:
            if name not in TIER_NAMES:
                problems.append(f"unknown tier {name!r}; tiers are {', '.join(TIER_NAMES)}")
        present = [t for t in TIER_NAMES if t in self.tiers]
        if present and present[0] != TOP_TIER:
            problems.append(f"tier {TOP_TIER} is required when lower tiers are configured")
        for name, tier in self.tiers.items():
            if tier.blocks is None and tier.bytes is None:
                problems.append(f"tier {name}: give a size in blocks or bytes")
            if tier.blocks is not None and tier.bytes is not None:
                problems.append(f"tier {name}: give blocks or bytes, not both")
            if tier.blocks is not None and (isinstance(tier.blocks, bool)
                                            or not isinstance(tier.blocks, int) or tier.blocks < 1):
                problems.append(f"tier {name}: blocks must be a positive integer, got {tier.blocks!r}")
            if tier.bytes is not None and (isinstance(tier.bytes, bool)
                                           or not isinstance(tier.bytes, int) or tier.bytes < 1):
                problems.append(f"tier {name}: bytes must be positive, got {tier.bytes!r}")
            elif tier.bytes is not None and self._geometry_ok() and (
                tier.bytes < self.bytes_per_block
            ):
                problems.append(
                    f"tier {name}: {tier.bytes} bytes hold no block of {self.bytes_per_block} bytes"
                )
            blocks = None          # the size in blocks, when it is well-formed
            if tier.bytes is None and type(tier.blocks) is int:
                blocks = tier.blocks
            elif tier.blocks is None and type(tier.bytes) is int and self._geometry_ok():
                blocks = tier.bytes // self.bytes_per_block
            if blocks is not None and blocks > MAX_TIER_BLOCKS:
                problems.append(f"tier {name}: {blocks:,} blocks is more than a tier holds "
                                f"(at most {MAX_TIER_BLOCKS:,}: block ids are 32-bit)")
            if tier.eviction and tier.eviction not in EVICTION_NAMES:
                problems.append(
                    f"tier {name}: unknown eviction {tier.eviction!r}; one of {sorted(EVICTION_NAMES)}"
                )
            if tier.admission and tier.admission not in ADMISSION_NAMES:
                problems.append(
                    f"tier {name}: unknown admission {tier.admission!r}; one of {sorted(ADMISSION_NAMES)}"
                )
        if not isinstance(self.model_id, str) or len(self.model_id) > 512:
            problems.append(f"model_id must be a string of at most 512 characters, got "
                            f"{self.model_id!r:.80}")
        if not isinstance(self.tenant, str) or not re.fullmatch(
                r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})?", self.tenant):
            problems.append(f"tenant must be empty or up to 64 letters, digits, '.', '_' or "
                            f"'-' starting with a letter or digit, got {self.tenant!r:.80}")
        for name, tier in self.tiers.items():
            if tier.url is not None:
                problem = _url_problem(tier.url)
                if problem:
                    problems.append(f"tier {name}: url {problem}")
            if tier.path not in (None, "") and path_problem(tier.path):
                problems.append(f"tier {name}: path {path_problem(tier.path)}")
            if tier.tenant_quota is not None:
                problem = self._quota_problem(tier.tenant_quota, name)
                if problem:
                    problems.append(f"tier {name}: tenant_quota {problem}")
        problems.extend(self._tenant_quotas_problems())
        if self.disk_dir not in (None, "") and path_problem(self.disk_dir):
            problems.append(f"disk_dir {path_problem(self.disk_dir)}")
        if self.eviction not in EVICTION_NAMES:
            problems.append(f"unknown eviction {self.eviction!r}; one of {sorted(EVICTION_NAMES)}")
        if self.admission is not None and self.admission not in ADMISSION_NAMES:
            problems.append(
                f"unknown admission {self.admission!r}; one of {sorted(ADMISSION_NAMES)}"
            )
        m = self.model
        for key in ("num_layers", "kv_heads", "head_dim"):
            value = getattr(m, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"model.{key} must be a positive integer, got {value!r}")
        if isinstance(m.outer_dim, bool) or m.outer_dim not in (1, 2):
            problems.append(f"model.outer_dim must be 1 (MLA) or 2 (K and V), got {m.outer_dim!r}")
        try:
            canonical_dtype(m.dtype)
        except DtypeError:
            problems.append(f"model.dtype {m.dtype!r} unknown; one of {sorted(DTYPE_NAMES)} "
                            f"or an alias ({', '.join(sorted(ALIASES))})")
        if problems:
            raise ConfigError(problems)
        return self

    def _tenant_quotas_problems(self) -> list[str]:
        quotas = self.tenant_quotas
        if not isinstance(quotas, Mapping):
            return [f"tenant_quotas must be a table of tenants, got {quotas!r:.80}"]
        if len(quotas) > MAX_NAMED_TENANTS:
            return [f"tenant_quotas names {len(quotas):,} tenants; at most "
                    f"{MAX_NAMED_TENANTS:,} (give the rest the tiers' tenant_quota)"]
        problems = []
        for tenant, per_tier in quotas.items():
            if tenant_problem(tenant):
                problems.append(f"tenant_quotas: {tenant_problem(tenant)}")
                continue
            if tenant == "*":
                problems.append("tenant_quotas: '*' is the label of every tenant not named; "
                                "give every tenant a quota with the tiers' tenant_quota")
                continue
            if not isinstance(per_tier, Mapping):
                problems.append(f"tenant_quotas.{tenant!r:.40} must be a table of tiers, got "
                                f"{per_tier!r:.80}")
                continue
            for tier, quota in per_tier.items():
                problem = self._quota_problem(quota, tier) if tier in self.tiers \
                    else f"names tier {tier!r:.20}, which is not configured"
                if problem:
                    problems.append(f"tenant_quotas.{tenant!r:.40}.{tier!r:.20}: {problem}")
        return problems

    def _quota_problem(self, quota: object, tier: str) -> str | None:
        """What is wrong with a tenant quota of ``tier`` (None if nothing): see
        :func:`_quota_problem`, and it must allow at least one block."""
        problem = _quota_problem(quota, tier)
        if problem or not self._geometry_ok() or tier not in self.tiers:
            return problem
        tier_config = self.tiers[tier]
        if not isinstance(tier_config.blocks, (int, type(None))) or \
                not isinstance(tier_config.bytes, (int, type(None))):
            return None                       # the tier's own size is reported
        capacity = self.tier_blocks(tier)
        if capacity > 0 and quota_blocks(quota, capacity, self.bytes_per_block) < 1:
            hint = "" if quota.strip().endswith("%") else \
                f" (a size is bytes: did you mean '{quota.strip()}%'?)"
            return (f"{quota!r:.40} allows no block of the tier's {capacity:,} of "
                    f"{format_size(self.bytes_per_block)}{hint}")
        return None

    def _geometry_ok(self) -> bool:
        m = self.model
        return (
            isinstance(self.block_size, int) and self.block_size > 0
            and all(isinstance(getattr(m, k), int) and getattr(m, k) > 0
                    for k in ("num_layers", "kv_heads", "head_dim"))
            and m.outer_dim in (1, 2)
        )


# -- loading ---------------------------------------------------------------------------------

_TOP_KEYS = {"block_size", "eviction", "admission", "disk_dir", "keep_tokens", "model_id",
             "tenant", "encrypt_at_rest", "tenant_quotas"}
_TIER_KEYS = {"blocks", "bytes", "gb", "eviction", "admission", "path", "url", "tenant_quota"}
_MODEL_KEYS = {"num_layers", "kv_heads", "head_dim", "dtype", "outer_dim"}


def _tier_from_mapping(name: str, raw: Mapping[str, Any], problems: list[str]) -> TierConfig:
    unknown = set(raw) - _TIER_KEYS
    if unknown:
        problems.append(f"tier {name}: unknown keys {sorted(unknown)}; known {sorted(_TIER_KEYS)}")
    sizes = [k for k in ("blocks", "bytes", "gb") if k in raw]
    if len(sizes) > 1:
        problems.append(f"tier {name}: give one of blocks, bytes or gb, not {' and '.join(sizes)}")
    size_bytes: int | None = None
    try:
        if "bytes" in raw:
            size_bytes = parse_size(raw["bytes"])
        elif "gb" in raw:
            if isinstance(raw["gb"], bool):
                raise ValueError(f"gb must be a number of GiB, got {raw['gb']!r}")
            gib = float(raw["gb"])
            if not math.isfinite(gib) or gib < 0:
                raise ValueError(f"gb must be a finite number >= 0, got {raw['gb']!r}")
            size_bytes = int(gib * 1024**3)
    except (ValueError, TypeError, OverflowError) as exc:
        problems.append(f"tier {name}: {exc}")
    blocks = raw.get("blocks")
    if blocks is not None:
        try:
            blocks = _to_int(blocks)
        except ValueError:
            problems.append(f"tier {name}: blocks must be an integer, got {blocks!r}")
            blocks = None
    return TierConfig(
        blocks=blocks,
        bytes=size_bytes,
        eviction=raw.get("eviction"),
        admission=raw.get("admission"),
        path=raw.get("path"),
        url=raw.get("url"),
        tenant_quota=raw.get("tenant_quota"),
    )


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    text = str(value).replace("_", "").replace(",", "")
    return int(text)


def _shape_problems(config: "KvConfig") -> list[str]:
    """Parts of ``config`` of the wrong type (a tier that is no :class:`TierConfig`, a model
    that is no :class:`ModelGeometry`): what the Python API can be handed."""
    problems = []
    if not isinstance(config.tiers, Mapping) or not all(
            isinstance(name, str) and isinstance(tier, TierConfig)
            for name, tier in config.tiers.items()):
        problems.append(f"tiers must map tier names to TierConfig, got {config.tiers!r:.80} "
                        f"(load_config takes sizes)")
    if not isinstance(config.model, ModelGeometry):
        problems.append(f"model must be a ModelGeometry, got {config.model!r:.80}")
    return problems


def _from_mapping(raw: Mapping[str, Any], problems: list[str], source: str) -> dict[str, Any]:
    """Turn a TOML-like mapping into KvConfig keyword arguments."""
    out: dict[str, Any] = {}
    known = _TOP_KEYS | {"tiers", "model", "policy"}
    unknown = set(raw) - known
    if unknown:
        problems.append(f"{source}: unknown keys {sorted(unknown)}; known {sorted(known)}")
    for key in _TOP_KEYS & set(raw):
        out[key] = raw[key]
    if "policy" in raw:
        if "eviction" in raw and raw["eviction"] != raw["policy"]:
            problems.append(f"{source}: policy {raw['policy']!r} and eviction {raw['eviction']!r} disagree")
        out["eviction"] = raw["policy"]
    if "tiers" in raw:
        tiers = raw["tiers"]
        if not isinstance(tiers, Mapping):
            problems.append(f"{source}: [tiers] must be a table")
        else:
            out["tiers"] = normalize_tiers(tiers, problems)
    if "model" in raw:
        model = raw["model"]
        if not isinstance(model, Mapping):
            problems.append(f"{source}: [model] must be a table, got {model!r}")
        else:
            unknown = set(model) - _MODEL_KEYS
            if unknown:
                problems.append(f"{source}: model has unknown keys {sorted(unknown)}")
            out["model"] = ModelGeometry(**{k: v for k, v in model.items() if k in _MODEL_KEYS})
    return out


# Later entries win: a KVSTRATA_ variable overrides the Dynamo alias for the same key.
_ENV_SCALARS = {
    "DYN_KVBM_DISK_CACHE_DIR": "disk_dir",
    "KVSTRATA_BLOCK_SIZE": "block_size",
    "KVSTRATA_EVICTION": "eviction",
    "KVSTRATA_POLICY": "eviction",
    "KVSTRATA_ADMISSION": "admission",
    "KVSTRATA_DISK_DIR": "disk_dir",
    "KVSTRATA_MODEL_ID": "model_id",
    "KVSTRATA_TENANT": "tenant",
    "KVSTRATA_ENCRYPT_AT_REST": "encrypt_at_rest",
}
_ENV_TIER_SIZE = re.compile(rf"^KVSTRATA_({'|'.join(TIER_NAMES)})_(BLOCKS|BYTES|GB)$")
_DYNAMO_TIER_GB = {"DYN_KVBM_CPU_CACHE_GB": first_of_kind(TierKind.HOST),
                   "DYN_KVBM_DISK_CACHE_GB": first_of_kind(TierKind.DISK)}

OTHER_ENV_VARS = frozenset({
    "KVSTRATA_CONFIG",
    "KVSTRATA_SHARING_SECRET", "KVSTRATA_SHARING_SECRET_FILE",
    "KVSTRATA_RAM_CLAIMS_DIR",
    "KVSTRATA_NATS_SERVER", "KVSTRATA_NATS_USER", "KVSTRATA_NATS_PASSWORD", "KVSTRATA_NATS_TOKEN",
    "KVSTRATA_NATIVE_COPY", "KVSTRATA_NATIVE_EVENTS",
    "KVSTRATA_WEED", "KVSTRATA_DEBUG",
    # read by the project's own scripts, benchmarks and tests
    "KVSTRATA_GPU_OUT", "KVSTRATA_GPU_SUITE", "KVSTRATA_GPU_BENCH",
    "KVSTRATA_PEERS_PYTHON", "KVSTRATA_BENCH_STANDIN_PIDS", "KVSTRATA_HYPOTHESIS_EXAMPLES",
})
"""The ``KVSTRATA_*`` variables read outside this module's settings (``_ENV_SCALARS`` and
the tier sizes): together they are every variable kvstrata knows."""

_warned_env_vars: set[str] = set()


def unknown_env_vars(env: Mapping[str, str]) -> list[str]:
    """The ``KVSTRATA_*`` variables in ``env`` that kvstrata does not read (a misspelling,
    of a tier size, say, would otherwise be ignored without a word)."""
    return sorted(var for var in env
                  if var.startswith("KVSTRATA_") and var not in _ENV_SCALARS
                  and var not in OTHER_ENV_VARS and not _ENV_TIER_SIZE.match(var))


def _warn_unknown_env_vars(env: Mapping[str, str]) -> None:
    """Log each unknown ``KVSTRATA_*`` variable once per process."""
    for var in unknown_env_vars(env):
        if var not in _warned_env_vars:
            _warned_env_vars.add(var)
            log.warning("unknown kvstrata environment variable %s is ignored "
                        "(docs/configuration.md lists them)", var)


def _from_env(env: Mapping[str, str], problems: list[str]) -> tuple[dict[str, Any], dict[str, dict]]:
    scalars: dict[str, Any] = {}
    tiers: dict[str, dict[str, Any]] = {}
    for var, key in _ENV_SCALARS.items():
        if var in env:
            scalars[key] = env[var]
    both = ("KVSTRATA_EVICTION", "KVSTRATA_POLICY")
    if all(v in env for v in both) and env[both[0]] != env[both[1]]:
        problems.append(f"KVSTRATA_EVICTION={env[both[0]]!r} and KVSTRATA_POLICY={env[both[1]]!r} disagree")
    if "encrypt_at_rest" in scalars:
        flag = scalars["encrypt_at_rest"].strip().lower()
        if flag in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            scalars["encrypt_at_rest"] = flag in ("1", "true", "yes", "on")
        else:
            problems.append(f"KVSTRATA_ENCRYPT_AT_REST must be 1 or 0, got "
                            f"{env['KVSTRATA_ENCRYPT_AT_REST']!r:.40}")
            del scalars["encrypt_at_rest"]
    if "block_size" in scalars:
        try:
            scalars["block_size"] = _to_int(scalars["block_size"])
        except ValueError:
            problems.append(f"KVSTRATA_BLOCK_SIZE must be an integer, got {env['KVSTRATA_BLOCK_SIZE']!r}")
            del scalars["block_size"]
    for var, value in env.items():
        match = _ENV_TIER_SIZE.match(var)
        if match:
            tiers.setdefault(match.group(1), {})[match.group(2).lower()] = value
    for var, tier in _DYNAMO_TIER_GB.items():
        if var in env and tier not in tiers:  # a KVSTRATA_G*_ size wins over the Dynamo alias
            tiers[tier] = {"gb": env[var]}
    return scalars, tiers


_SHARE_RE = re.compile(r"[0-9]{1,3}(\.[0-9]{1,6})?\s*%")

MAX_NAMED_TENANTS = 4096
"""Most tenants ``tenant_quotas`` may name (each is a table kept by every tier)."""

MAX_TENANT_CHARS = 256
"""Longest tenant key (vLLM's cache salts are free-form strings)."""


def tenant_problem(tenant: object) -> str | None:
    """What is wrong with a tenant key (None if nothing): a string of at most
    :data:`MAX_TENANT_CHARS` characters."""
    if isinstance(tenant, str) and len(tenant) <= MAX_TENANT_CHARS:
        return None
    return f"a tenant is a string of at most {MAX_TENANT_CHARS} characters, got {tenant!r:.60}"


def quota_blocks(quota: str, capacity: int, bytes_per_block: int) -> int:
    """Blocks of a tier of ``capacity`` blocks that a tenant quota allows: ``"25%"`` of it
    (rounded down), or a size in bytes (``"1GiB"``) over ``bytes_per_block``; at most the
    capacity. Call on a valid quota (:func:`_quota_problem`)."""
    text = quota.strip()
    if text.endswith("%"):
        return min(capacity, int(capacity * float(text[:-1]) / 100))
    return min(capacity, parse_size(text) // bytes_per_block)


def _quota_problem(quota: object, tier: str) -> str | None:
    """What is wrong with a tenant quota (None if nothing): a string, ``"N%"`` with N in
    (0, 100] or a size."""
    if not isinstance(quota, str):
        return f"must be a string such as '25%' or '1GiB', got {quota!r:.40}"
    if tier == TOP_TIER:
        return (f"applies to the tiers kvstrata stores into, below {TOP_TIER} (the engine's "
                f"own cache, or the blocks a manager's caller holds)")
    if tier in TIER_NAMES and spec(tier).addressing is Addressing.KEYS:
        return (f"cannot apply to {tier}: a shared store keeps what each worker writes, and "
                f"every listing brings it back whatever one worker evicts")
    text = quota.strip()
    if text.endswith("%"):
        if not _SHARE_RE.fullmatch(text) or not 0 < float(text[:-1]) <= 100:
            return f"must be a share in (0%, 100%] such as '25%', got {quota!r:.40}"
        return None
    try:
        size = parse_size(text)
    except (ValueError, OverflowError):
        return f"must be 'N%' or a size such as '1GiB', got {quota!r:.40}"
    if size > 0:
        return None
    if re.fullmatch(r"[0-9.]+", text):
        return f"{quota!r:.40} is a size in bytes and allows no block (did you mean '{text}%'?)"
    return f"must be more than 0, got {quota!r:.40}"


MAX_CONFIG_BYTES = 1 << 20
"""Largest TOML config file read (1 MiB; kvstrata's own are a few hundred bytes)."""

def _url_problem(url: object) -> str | None:
    """What is wrong with an object tier's url (None if nothing): ``http(s)://host[:port]/
    bucket``, a port in 1..65535, no credentials (they come from the environment)."""
    shape = "must look like http://host:port/bucket"
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^/\s]+/[A-Za-z0-9.-]{3,63}/?",
                                                    url):
        return f"{shape}, got {redacted(url)!r:.80}"
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        return ("must not hold credentials (user:password@): give them in "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    try:
        port = parts.port
    except ValueError:
        return f"{shape} with a port in 1..65535, got {redacted(url)!r:.80}"
    if port == 0 or not parts.hostname:
        return f"{shape} with a host and a port in 1..65535, got {redacted(url)!r:.80}"
    return None


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    fixed_tiers: Mapping[str, TierConfig] | None = None,
    **overrides: Any,
) -> KvConfig:
    """Build and validate a :class:`KvConfig`.

    ``path`` (or ``$KVSTRATA_CONFIG``) names a TOML file; ``env`` defaults to ``os.environ``;
    ``overrides`` are KvConfig fields (``tiers`` may map names to TierConfig, an int of
    blocks, or a mapping like ``{"bytes": "4GiB"}``). ``defaults`` are KvConfig fields in
    place of kvstrata's own defaults, where neither the file nor the environment sets them
    (an engine connector's): tiers the environment sizes are sized within them.
    ``fixed_tiers`` are tiers the caller decides whatever any source says (an engine's own
    cache as G1): what the file or environment says of them is ignored, and a file that
    names no other tier leaves the tiers as they were.
    """
    env = os.environ if env is None else env
    fixed = dict(fixed_tiers or {})
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    if defaults:
        kwargs.update(defaults)
        if defaults.get("tiers") is not None:
            kwargs["tiers"] = normalize_tiers(defaults["tiers"], problems)
    path = path or env.get("KVSTRATA_CONFIG")
    if path:
        try:
            text = read_bounded(path, MAX_CONFIG_BYTES).decode("utf-8")
            from_file = _from_mapping(tomllib.loads(text), problems, str(path))
            if fixed and "tiers" in from_file:
                named = {t: c for t, c in from_file["tiers"].items() if t not in fixed}
                if named:
                    from_file["tiers"] = named
                else:
                    del from_file["tiers"]
            kwargs.update(from_file)
        except OSError as exc:
            problems.append(f"cannot read config file {path}: {exc.strerror}")
        except InputTooLargeError:
            problems.append(f"config file {path} is larger than {MAX_CONFIG_BYTES:,} bytes")
        except UnicodeDecodeError:
            problems.append(f"config file {path} is not UTF-8 text")
        except tomllib.TOMLDecodeError as exc:
            problems.append(f"config file {path} is not valid TOML: {exc}")
        except RecursionError:
            problems.append(f"config file {path} nests too deeply")
    _warn_unknown_env_vars(env)
    env_scalars, env_tiers = _from_env(env, problems)
    kwargs.update(env_scalars)
    env_tiers = {t: raw for t, raw in env_tiers.items() if t not in fixed}
    if env_tiers:
        tiers = dict(kwargs.get("tiers", DEFAULT_TIERS))
        for name, raw in env_tiers.items():
            base = tiers.get(name, TierConfig())
            parsed = _tier_from_mapping(name, raw, problems)
            tiers[name] = replace(base, blocks=parsed.blocks, bytes=parsed.bytes)
        kwargs["tiers"] = tiers
    if "tiers" in overrides and overrides["tiers"] is not None:
        overrides = dict(overrides)
        overrides["tiers"] = normalize_tiers(overrides["tiers"], problems)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if fixed:
        kwargs["tiers"] = {**fixed, **{t: c for t, c in kwargs.get("tiers", DEFAULT_TIERS).items()
                                      if t not in fixed}}
    known = set(KvConfig.__dataclass_fields__)
    unknown = set(kwargs) - known
    if unknown:
        problems.append(f"unknown config fields {sorted(unknown)}; known {sorted(known)}")
        for key in unknown:
            kwargs.pop(key)
    config = KvConfig(**kwargs)
    try:
        config.validate()
    except ConfigError as exc:
        problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return config


def normalize_tiers(tiers: Mapping[str, Any], problems: list[str] | None = None) -> dict[str, TierConfig]:
    """Tier specs given as TierConfig, an int (blocks), a size string or a mapping."""
    problems = [] if problems is None else problems
    out: dict[str, TierConfig] = {}
    if not isinstance(tiers, Mapping):
        problems.append(f"tiers must map tier names to sizes, got {tiers!r:.80}")
        return out
    for name, spec in tiers.items():
        if isinstance(spec, TierConfig):
            out[name] = spec
        elif isinstance(spec, Mapping):
            out[name] = _tier_from_mapping(name, spec, problems)
        elif isinstance(spec, int) and not isinstance(spec, bool):
            out[name] = TierConfig(blocks=spec)
        elif isinstance(spec, (float, bool)):
            # an integer is blocks and a size has a unit: 4e9 is neither
            problems.append(f"tier {name}: {spec!r} is neither a number of blocks (an "
                            f"integer) nor a size with a unit (\"4GiB\")")
        else:
            out[name] = _tier_from_mapping(name, _parse_tier_text(str(spec)), problems)
    return out


def _parse_tier_text(text: str) -> dict[str, Any]:
    """``"5000"`` -> blocks; ``"4GiB"`` -> bytes."""
    text = text.strip()
    if re.fullmatch(r"[0-9_,]+", text):
        return {"blocks": text}
    return {"bytes": text}


def parse_tiers_flag(flag: str) -> dict[str, TierConfig]:
    """Parse ``G1=1000,G2=4GiB,G3=100000`` (blocks, or bytes with a unit)."""
    problems: list[str] = []
    tiers: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in flag.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not size:
            problems.append(f"--tiers entry {part!r} must look like G1=1000 or G2=4GiB")
            continue
        name = name.strip().upper()
        if name in tiers:
            problems.append(f"--tiers names {name} twice")
            continue
        tiers[name] = size.strip()
    if not tiers and not problems:
        problems.append(f"--tiers {flag!r} names no tier (e.g. G1=1000,G2=4GiB)")
    out = normalize_tiers(tiers, problems)
    if problems:
        raise ConfigError(problems)
    return out
