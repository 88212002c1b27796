"""The connector's settings: vLLM's ``kv_connector_extra_config`` plus kvstrata's own config.

Both halves of the connector (scheduler and worker processes) build the same
:class:`ConnectorSettings` from the same inputs, so they agree on every tier's size in blocks
without talking to each other. Sources, lowest precedence first: kvstrata's defaults, its
TOML file (``config`` key or ``$KVSTRATA_CONFIG``), ``KVSTRATA_*`` / ``DYN_KVBM_*``
environment variables, then the keys of ``kv_connector_extra_config``:

=====================  =========================================  ==========================
key                    meaning                                     default
=====================  =========================================  ==========================
``tiers``              ``{"G2": {"bytes": "4GiB"}, "G3": {...}}``  G2 1 GiB, G3 4 GiB
                       or ``"G2=4GiB,G3=16GiB"``; a tier missing
                       is not used (``{"G2": ...}`` alone: no G3)
``disk_dir``           directory of the G3 tier, kept across       a temporary directory
                       restarts (see docs/vllm.md)
``list_interval``      seconds between listings of a shared G4     10
                       (``{"G4": {"blocks": N, "url": URL}}``)
``tenant``             the tenant of a shared G4's blocks          ``""`` (shared)
``tenant_quotas``      per named tenant (``salt:<cache_salt>`` of   none
                       a request, else ``lora:<adapter>``), the
                       most of each tier it may hold: ``{"salt:a":
                       {"G2": "50%"}}``; a tier's own ``tenant_quota``
                       (``{"G2": {"bytes": "4GiB", "tenant_quota":
                       "25%"}}``) is every other tenant's
``cost_aware``         load a held prefix only while loading it    ``true``
                       beats recomputing it (learned costs)
``eviction``           ``default``, ``lru``, ``lfu``, ``adaptive``  ``lru``
``admission``          ``always``, ``second-offer``,                ``predicted-reuse``
                       ``predicted-reuse``, ``adaptive``            (``always`` on G4)
``events``             kvstrata sink specs (list or one string)    none
``verify_host_reads``  verify G2 bytes (xxh3) before a load        ``true``
``o_direct``           G3 with O_DIRECT (``null`` = when possible)  ``null``
``load`` / ``store``   turn loads / stores off                     ``true``
``fail_on_load_error`` a failed load fails the request (vLLM's     ``false``: recompute
                       ``kv_load_failure_policy=fail``)
``worker_id``          publisher id in kvstrata events             0
``export``             ``tcp://host:port``: serve this engine's     none
                       G2 to other engines over NIXL (leases on
                       that address; one worker per engine)
``store_nice``         CPU niceness (0-19) of the worker's store   10
                       threads: stores yield the cores to the
                       engine's forward
``yield_to_forward``   writes to G3/G4 wait while vLLM's forward   ``"auto"``: when vLLM
                       runs (at most 5 s each): ``true``,          computes on the CPU
                       ``false`` or ``"auto"``
``peers``              control addresses of other engines'         none
                       exports: a prefix they hold is read from
                       their G2 into vLLM's cache over NIXL
``peer_ask_timeout``   seconds a new request waits for the peers'  0.2
                       answers before it is scheduled without
                       them
``peer_read_timeout``  seconds a remote load may take before its   5
                       blocks are recomputed instead
``share_host_tier``    an MLA model over tensor-parallel workers:  ``"auto"``: where it
                       one G2 per group, in shared memory          can be done here
                       (``true``, ``false`` or ``"auto"``)
``shared_memory_dir``  where the workers of a group find it        ``/dev/shm``
``config``             a kvstrata TOML file                        ``$KVSTRATA_CONFIG``
=====================  =========================================  ==========================

G1 is vLLM's own KV cache (its size is vLLM's ``num_gpu_blocks``); the block size and the KV
geometry are vLLM's. Unknown keys and bad values raise :class:`ConnectorConfigError` listing
every problem, before anything is allocated.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ...config import ConfigError, KvConfig, ModelGeometry, TierConfig, load_config
from ...events.spec import engine_address
from ...kinds import StorageOptions, check_tiers
from ...kinds.host import shared_host_problem
from ...remote.control import can_listen_on, is_own_address, parse_control
from ...tiers import TIER_NAMES, TOP_TIER, TierKind, first_of_kind, spec
from .. import engine_config
from ..engine_config import ENGINE_KEYS, checked, is_int, is_number
from .groups import MAMBA, MLA, KvGroups, group_of_spec

log = logging.getLogger(__name__)

__all__ = ["ConnectorConfigError", "ConnectorSettings", "KvGeometry", "DEFAULT_TIERS",
           "StoredAs", "settings_from", "stored_as"]

DEFAULT_TIERS: dict[str, TierConfig] = {first_of_kind(TierKind.HOST): TierConfig(bytes=1 << 30),
                                        first_of_kind(TierKind.DISK): TierConfig(bytes=4 << 30)}
"""Lower tiers used when nothing says otherwise: 1 GiB of host RAM (G2), 4 GiB of disk (G3)."""

_KNOWN = ENGINE_KEYS | {"verify_host_reads", "o_direct", "load", "store", "fail_on_load_error",
                       "list_interval", "cost_aware", "export", "peers", "store_nice",
                       "yield_to_forward", "peer_ask_timeout", "peer_read_timeout",
                       "share_host_tier", "shared_memory_dir"}


MAX_PEER_READ_TIMEOUT = 240
"""Longest ``peer_read_timeout``: a remote load's lease must outlast it, and exporters grant
leases of 300 s at most."""

MAX_PEERS = 64
"""Other engines' exports one engine may name in ``peers``."""


class ConnectorConfigError(ValueError):
    """The connector cannot start with this configuration; the message names every problem."""


@dataclass(frozen=True)
class KvGeometry:
    """What the engine's KV cache looks like, as both halves read it from vLLM's config.

    ``num_layers`` counts the KV tensors a block id has a page in (one per attention layer,
    or with several KV cache groups one per tensor the groups' layers share); ``outer_dim``
    is 2 for K and V, 1 for MLA's one latent per token."""

    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    num_gpu_blocks: int
    workers: int = 1
    """Workers holding a share of each block (tier sizes are per worker)."""
    outer_dim: int = 2
    groups: KvGroups = KvGroups()
    replicas: int = 1
    """Consecutive workers holding the same bytes of each block (an MLA model's latent is
    replicated over its tensor-parallel ranks): persistent tiers keep one copy of them
    (:func:`stored_as`)."""

    @classmethod
    def from_vllm(cls, kv_cache_config: Any, workers: int = 1,
                  tensor_parallel: int = 1) -> "KvGeometry":
        """From vLLM's ``KVCacheConfig``: its KV cache groups of full-attention (MLA
        included), sliding-window and Mamba (align mode) layers; anything else is refused
        (:func:`~.groups.group_of_spec`). The page geometry is the attention groups'; a
        Mamba group's state page is padded by vLLM to the same size. ``tensor_parallel``:
        the ranks of a tensor-parallel group whose MLA latent would be the same (1 where
        they split it, as decode context parallelism does)."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
        if not groups:
            raise ConnectorConfigError("kvstrata's vLLM connector: vLLM's KV cache has no "
                                       "KV cache group")
        try:
            kinds = tuple(group_of_spec(i, g.kv_cache_spec) for i, g in enumerate(groups))
        except ValueError as exc:
            raise ConnectorConfigError(f"kvstrata's vLLM connector: {exc}") from None
        attention = [g.kv_cache_spec for g, k in zip(groups, kinds) if k.kind != MAMBA]
        if not attention:
            raise ConnectorConfigError("kvstrata's vLLM connector holds a Mamba state beside "
                                       "attention layers, not a model without attention")
        first = attention[0]
        shapes = {(int(s.block_size), int(s.num_kv_heads), int(s.head_size), str(s.dtype))
                  for s in attention}
        if len(shapes) != 1:
            raise ConnectorConfigError(
                f"kvstrata's vLLM connector needs every attention group to have the same "
                f"block size, heads, head size and dtype; this model's have {sorted(shapes)}")
        pages = {int(g.kv_cache_spec.page_size_bytes) for g in groups}
        sizes = {int(g.kv_cache_spec.block_size) for g in groups}
        if len(pages) != 1 or len(sizes) != 1:
            raise ConnectorConfigError(
                f"kvstrata's vLLM connector needs one page size and block size in every KV "
                f"cache group; this model's are {sorted(pages)} bytes, {sorted(sizes)} tokens")
        mla = {k.kind == MLA for k in kinds if k.kind != MAMBA}
        if len(mla) != 1:
            raise ConnectorConfigError("kvstrata's vLLM connector does not hold a model "
                                       "that mixes MLA and other attention groups")
        layers = _pages_per_block(kv_cache_config) or max(len(g.layer_names) for g in groups)
        dtype = str(first.dtype).removeprefix("torch.")
        return cls(block_size=int(first.block_size), num_layers=layers,
                   kv_heads=int(first.num_kv_heads), head_dim=int(first.head_size),
                   dtype=dtype, num_gpu_blocks=int(kv_cache_config.num_blocks),
                   workers=workers, outer_dim=1 if mla == {True} else 2,
                   groups=KvGroups(kinds),
                   replicas=tensor_parallel if mla == {True} and tensor_parallel > 1 else 1)


def _pages_per_block(kv_cache_config: Any) -> int:
    """How many distinct pages one block id has in vLLM's KV cache allocation: one per
    layer of a group, but the layers of different groups overlay each other (a block id
    belongs to one group at a time), so pages are counted by their place in the
    allocation (``KVCacheTensor``: layer ``l``'s pages start at ``offset + l *
    layer_stride``). 0 when vLLM's config does not say."""
    starts = set()
    for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ():
        stride = getattr(tensor, "layer_stride", None)
        names = getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or ()
        if stride is None:
            return 0
        offset = getattr(tensor, "offset", 0) or 0
        starts.update(offset + i * stride for i in range(len(names)))
    return len(starts)


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything both halves need: the kvstrata config (tiers sized in blocks, G1 being
    vLLM's cache) and the connector's own switches."""

    kv: KvConfig
    events: tuple[str, ...] = ()
    verify_host_reads: bool = True
    o_direct: bool | None = None
    load: bool = True
    store: bool = True
    fail_on_load_error: bool = False
    cost_aware: bool = True
    """Load only the part of a held prefix whose estimated load time beats recomputing it
    (:meth:`kvstrata.placement.costs.CostModel.worth_loading`); False loads all of it."""
    worker_id: int = 0
    export: str | None = None
    """Where this engine serves its G2 to others (``tcp://host:port``), or None."""
    peers: tuple[str, ...] = ()
    """Control addresses of other engines' exports to read prefixes from."""
    peer_ask_timeout: float = 0.2
    """Seconds a new request waits for the peers' answers (how much of a prefix each holds)
    before vLLM schedules it without them: the most a peer that is slow to answer adds to
    a request's time to first token."""
    peer_read_timeout: float = 5.0
    """Seconds a remote load may take before it is given up and its blocks recomputed."""
    store_nice: int = 10
    """CPU niceness of the worker's store threads (0: as the engine's)."""
    yield_to_forward: bool | None = None
    """Hold writes to G3/G4 back while vLLM's forward runs
    (:class:`~kvstrata.physical.pacing.ForwardPacer`); None: when G1 is not on a GPU."""
    list_interval: float = 10.0
    block_layout: str = "vllm"
    """The byte order of vLLM's KV pages as stored (platform, version, attention backend):
    part of the fingerprint of persistent tiers, so pages of another layout are never read."""

    groups: KvGroups = KvGroups()
    """vLLM's KV cache groups (:mod:`.groups`): how each group's blocks are named and
    which of them a load needs."""
    replicas: int = 1
    """:attr:`KvGeometry.replicas`."""
    shared_host_dir: str | None = None
    """Where the workers of a group of :attr:`replicas` keep one G2 for the group, in
    shared memory (its first worker writes it, the others read it in place); None: each
    worker keeps its own."""
    data_parallel_index: int = 0
    """This engine's data-parallel rank (its G3 directory, export port, event files and
    endpoints, and the rank its events carry)."""

    def tier_blocks(self, tier: str) -> int:
        return self.kv.tier_blocks(tier)

    def stored_as(self, rank: int, world_size: int) -> "StoredAs":
        """How worker ``rank`` of ``world_size`` keeps blocks (:func:`stored_as`)."""
        return stored_as(rank, world_size, self.replicas)


@dataclass(frozen=True)
class StoredAs:
    """How a worker names and keeps blocks in persistent tiers (G3, G4)."""

    rank: int
    world_size: int
    """The rank and world size its blocks are stored under (part of their fingerprint and of
    a durable G3's home)."""
    writer: bool
    """Whether it writes them; otherwise it reads what the writer of the same identity
    stores (its G3 followed read-only, the same G4 keys) and writes none."""


def stored_as(rank: int, world_size: int, replicas: int = 1) -> StoredAs:
    """Worker ``rank``'s identity in persistent tiers. Each worker keeps its own share of
    every block, except where ``replicas`` consecutive workers hold the same bytes (an MLA
    model over tensor-parallel ranks, whose groups are consecutive ranks in vLLM): those are
    stored once, under the identity of the group (rank ``rank // replicas`` of ``world_size
    // replicas``), by its first worker; the others read that copy (and its G2, where
    :attr:`ConnectorSettings.shared_host_dir` keeps one for the group)."""
    if replicas <= 1:
        return StoredAs(rank, world_size, True)
    return StoredAs(rank // replicas, max(1, world_size // replicas), rank % replicas == 0)


def settings_from(extra: Mapping[str, Any] | None, geometry: KvGeometry,
                  env: Mapping[str, str] | None = None, *,
                  model_id: str = "", block_layout: str = "vllm",
                  engine_index: int = 0) -> ConnectorSettings:
    """Build the settings from ``kv_connector_extra_config`` and vLLM's geometry;
    ``model_id`` (vLLM's model and revision) names the model in the fingerprint of stored
    blocks unless kvstrata's own config sets ``model_id``. Every problem is named in one
    :class:`ConnectorConfigError`, before anything is allocated.

    ``engine_index``: this engine's data-parallel rank (vLLM's ``data_parallel_index``).
    Each data-parallel engine has its own scheduler and workers, so its own G3 (engine
    ``k > 0`` in ``<directory>/dp<k>``), its own export (``k`` ports above ``export``) and
    events stamped with its rank; the engines share G4, where a worker's blocks are the
    same bytes as the worker of the same rank in any other engine."""
    extra = dict(extra or {})
    env = os.environ if env is None else env
    problems: list[str] = []
    unknown = set(extra) - _KNOWN
    if unknown:
        problems.append(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                        f"known: {sorted(_KNOWN)}")
    switches = _switches(extra, geometry, problems)
    if switches["export"] or switches["peers"]:
        _check_sharing_secret(env, problems)
    overrides = engine_config.config_overrides(extra, problems)
    tiers = (engine_config.lower_tiers(extra["tiers"], problems, "vLLM's own KV cache")
             if "tiers" in extra else None)
    config_path = engine_config.config_path(extra, problems)
    if problems:
        raise ConnectorConfigError("kvstrata connector: " + "; ".join(problems))
    kv = _kv_config(geometry, tiers, overrides, config_path, env, model_id)
    kv, switches["export"] = _engine_of(kv, switches["export"], switches["events"],
                                        engine_index)
    switches["peers"] = _others(switches["peers"], switches["export"], engine_index)
    if geometry.groups != KvGroups():
        block_layout = f"{block_layout} groups {geometry.groups.signature()}"
    replicas = geometry.replicas
    disk = first_of_kind(TierKind.DISK)
    share, directory = switches.pop("share_host_tier"), switches.pop("shared_memory_dir")
    if replicas > 1 and disk in kv.tiers and kv.directory_of(disk) is None:
        # a temporary G3 cannot be found by the other ranks: one copy each, G2 too
        if share:
            raise ConnectorConfigError(
                f"kvstrata connector: share_host_tier: the workers of a tensor-parallel group "
                f"share their tiers only where {disk} is in a directory (disk_dir, or the "
                f"tier's path) or left out; set one, or share_host_tier false")
        log.info("kvstrata: each worker keeps its own copy of the MLA latent (%s is "
                 "temporary: give it a directory to keep one per group)", disk)
        replicas = 1
    shared_host_dir = _shared_host_dir(kv, share, directory, replicas)
    _check_runnable(kv, geometry.workers, block_layout, replicas, shared_host_dir)
    return ConnectorSettings(kv=kv, block_layout=block_layout, groups=geometry.groups,
                             replicas=replicas, shared_host_dir=shared_host_dir,
                             data_parallel_index=engine_index, **switches)


def _engine_of(kv: KvConfig, export: str | None, events: tuple[str, ...],
               engine_index: int) -> tuple[KvConfig, str | None]:
    """The config and export address of data-parallel engine ``engine_index`` (see
    :func:`settings_from`): engine ``k > 0`` exports ``k`` ports above the configured
    address, as its events bind."""
    if not engine_index:
        return kv, export
    problems = engine_config.engine_sink_problems(events, engine_index)
    if export is not None:
        try:
            export = engine_address(export, engine_index)
        except ValueError as exc:
            problems.append(f"export {exc}")
    if problems:
        raise ConnectorConfigError("kvstrata connector: " + "; ".join(problems))
    disk = first_of_kind(TierKind.DISK)
    if disk in kv.tiers and kv.directory_of(disk) is not None:
        kv = replace(kv, disk_dir=engine_config.engine_directory(kv.directory_of(disk),
                                                                 engine_index))
    return kv, export


def _others(peers: tuple[str, ...], export: str | None, engine_index: int) -> tuple[str, ...]:
    """``peers`` less this engine's own ``export`` (one list naming every engine's export,
    given to each engine alike, as data-parallel engines are): an engine asking itself would
    only add a round trip to each request its local tiers fall short on."""
    if export is None:
        return peers
    others = tuple(p for p in peers if not is_own_address(p, export))
    for own in sorted(set(peers) - set(others)):
        log.info("kvstrata: engine %d leaves %s out of its peers: its own export (%s)",
                 engine_index, own, export)
    return others


def _shared_host_dir(kv: KvConfig, share: bool | None, directory: str,
                     replicas: int) -> str | None:
    """Where a group of ``replicas`` workers finds its one G2 (None: each keeps its own):
    ``share_host_tier`` true, or "auto" (None here) where that can be done here
    (:func:`~kvstrata.kinds.host.shared_host_problem`); never for one worker per group."""
    host = first_of_kind(TierKind.HOST)
    if replicas <= 1 or share is False or host not in kv.tiers:
        return None
    problem = shared_host_problem(host, directory)
    if problem is None:
        return directory
    if share:
        raise ConnectorConfigError(f"kvstrata connector: share_host_tier: {problem}; "
                                   f"set share_host_tier false")
    log.info("kvstrata: each worker keeps its own %s (%s)", host, problem)
    return None


def _switches(extra: Mapping[str, Any], geometry: KvGeometry,
              problems: list[str]) -> dict[str, Any]:
    """The connector's own settings (every :class:`ConnectorSettings` field but ``kv`` and
    ``block_layout``), each checked; a bad one is named in ``problems``."""
    out: dict[str, Any] = {}
    for key, default in (("verify_host_reads", True), ("load", True), ("store", True),
                         ("fail_on_load_error", False), ("cost_aware", True)):
        out[key] = checked(extra, key, default, lambda v: isinstance(v, bool),
                            "true or false", problems)
    out["o_direct"] = checked(extra, "o_direct", None,
                               lambda v: v is None or isinstance(v, bool),
                               "true, false or null", problems)
    out["list_interval"] = float(checked(
        extra, "list_interval", 10.0, lambda v: is_number(v) and 0.1 <= v <= 86_400,
        "seconds in 0.1..86400 (a shorter interval would list the store without pause)",
        problems))
    for key, default, most in (("peer_ask_timeout", 0.2, 60), ("peer_read_timeout", 5.0,
                                                                   MAX_PEER_READ_TIMEOUT)):
        out[key] = float(checked(extra, key, default,
                                  lambda v, most=most: is_number(v) and 0 < v <= most,
                                  f"seconds in (0, {most}]", problems))
    out["worker_id"] = engine_config.worker_id(extra, problems)
    out["store_nice"] = checked(extra, "store_nice", 10, lambda v: is_int(v) and 0 <= v <= 19,
                                 "an integer in 0..19", problems)
    pace = checked(extra, "yield_to_forward", "auto",
                    lambda v: isinstance(v, bool) or (isinstance(v, str) and v == "auto"),
                    'true, false or "auto"', problems)
    out["yield_to_forward"] = None if pace == "auto" else pace
    share = checked(extra, "share_host_tier", "auto",
                    lambda v: isinstance(v, bool) or (isinstance(v, str) and v == "auto"),
                    'true, false or "auto"', problems)
    out["share_host_tier"] = None if share == "auto" else share
    out["shared_memory_dir"] = checked(extra, "shared_memory_dir", "/dev/shm",
                                        lambda v: isinstance(v, str) and os.path.isabs(v),
                                        "an absolute path", problems)
    out["events"] = engine_config.events(extra, problems)
    out["export"] = checked(extra, "export", None,
                             lambda v: v is None or _control_address(v, local=True),
                             "tcp://host:port, a port in 1..65535 on an address of this host",
                             problems)
    peers = extra.get("peers", ())
    out["peers"] = tuple(checked({"peers": (peers,) if isinstance(peers, str) else peers},
                                  "peers", (),
                                  lambda v: isinstance(v, (list, tuple))
                                  and len(v) <= MAX_PEERS
                                  and all(_control_address(x) for x in v),
                                  f"a list of at most {MAX_PEERS} tcp://host:port, ports in "
                                  f"1..65535", problems))
    if (out["export"] or out["peers"]) and not geometry.groups.single:
        problems.append("export/peers (sharing G2 between engines) holds models of one KV "
                        f"cache group for now; this one has {len(geometry.groups.groups)}")
    if (out["export"] or out["peers"]) and geometry.workers != 1:
        problems.append("export/peers (sharing G2 between engines) supports one worker per "
                        f"engine for now; this engine has {geometry.workers}")
    return out


def _check_sharing_secret(env: Mapping[str, str], problems: list[str]) -> None:
    """Sharing G2 between engines needs the deployment's secret in every engine's
    environment (:mod:`kvstrata.remote.auth`): an exporter serves nothing to a peer that
    cannot prove it holds it."""
    from ...secret import SECRET_ENV, SECRET_FILE_ENV, SecretError, resolve_secret

    try:
        if resolve_secret(env=env) is None:
            problems.append(f"export/peers need the deployment's sharing secret: set "
                            f"${SECRET_ENV} (or ${SECRET_FILE_ENV}, a file of the running "
                            f"user's) to the same value in every engine")
    except SecretError as exc:
        problems.append(f"export/peers: {exc}")


def _kv_config(geometry: KvGeometry, tiers: dict[str, TierConfig] | None,
               overrides: Mapping[str, Any], config_path: str | None,
               env: Mapping[str, str], model_id: str) -> KvConfig:
    """kvstrata's config for this engine: its own sources (TOML, env) under the extra
    config's keys, with G1 being vLLM's cache and vLLM's block size and KV geometry."""
    try:
        # the connector's defaults where kvstrata's own file and environment say nothing
        # (kvstrata's built-in tiers are sized for the trace replay); G1 is vLLM's cache
        base = load_config(
            config_path, env=env, defaults={"tiers": DEFAULT_TIERS, "eviction": "lru"},
            fixed_tiers={TOP_TIER: TierConfig(blocks=max(1, geometry.num_gpu_blocks))})
    except ConfigError as exc:
        raise ConnectorConfigError("kvstrata connector: " + "; ".join(exc.problems)) from None
    chosen = tiers if tiers is not None else \
        {t: c for t, c in base.tiers.items() if t != TOP_TIER}
    disk_dir = overrides.get("disk_dir", base.disk_dir)
    if tiers is not None and "disk_dir" not in overrides:
        # A disk tier's path in the extra config wins over kvstrata's own config and env (a
        # later source); within the extra config, disk_dir wins, as KvConfig.directory_of
        # decides for every config.
        if any(c.path is not None and t in TIER_NAMES and spec(t).kind is TierKind.DISK
               for t, c in tiers.items()):
            disk_dir = None
    eviction = overrides.get("eviction", base.eviction)
    model = ModelGeometry(num_layers=geometry.num_layers, kv_heads=geometry.kv_heads,
                          head_dim=geometry.head_dim, dtype=geometry.dtype,
                          outer_dim=geometry.outer_dim)
    try:
        return replace(base, block_size=geometry.block_size, model=model,
                       tiers={TOP_TIER: TierConfig(blocks=geometry.num_gpu_blocks), **chosen},
                       eviction=eviction, admission=overrides.get("admission", base.admission),
                       disk_dir=disk_dir, model_id=base.model_id or model_id,
                       tenant=overrides.get("tenant", base.tenant),
                       tenant_quotas=overrides.get("tenant_quotas", base.tenant_quotas)
                       ).validate()
    except ConfigError as exc:
        raise ConnectorConfigError("kvstrata connector: " + "; ".join(exc.problems)) from None


def _control_address(value: Any, local: bool = False) -> bool:
    """Whether ``value`` is a ``tcp://host:port`` control address (port 1..65535), and with
    ``local`` one this host can listen on."""
    try:
        host, _ = parse_control(value)
    except ValueError:
        return False
    return not local or can_listen_on(host)


def _check_runnable(kv: KvConfig, workers: int = 1, block_layout: str = "vllm",
                    replicas: int = 1, shared_host_dir: str | None = None) -> None:
    """Refuse, before anything is allocated, what the workers could not build: the tiers'
    own checks (:func:`kvstrata.kinds.check_tiers`: a kind with no backend, a disk or object
    tier without the host tier its blocks move through, a tier of no block, host tiers over
    this machine's memory, disk tiers over their filesystem's free space), for every worker
    of this engine on this machine (tier sizes are per worker: each tensor-parallel rank
    holds its own heads' share of a block; replicated blocks are kept once on disk, and
    in host RAM where ``shared_host_dir`` keeps them)."""
    first = stored_as(0, workers, replicas)
    options = StorageOptions(world_size=first.world_size, block_layout=block_layout,
                             engine_kv=True)
    copies = {TierKind.DISK: first.world_size}
    if shared_host_dir is not None:
        copies[TierKind.HOST] = first.world_size
    problems = check_tiers(kv, options, ranks=workers, copies=copies)
    if problems:
        raise ConnectorConfigError("kvstrata connector: " + "; ".join(problems))
