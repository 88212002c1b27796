"""``KvStrataConnector``: kvstrata as a vLLM v1 KV connector.

Name it in vLLM's ``kv_transfer_config``::

    {"kv_connector": "KvStrataConnector",
     "kv_connector_module_path": "kvstrata.connectors.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"tiers": {"G2": {"bytes": "8GiB"},
                                             "G3": {"bytes": "64GiB", "path": "/nvme/kv"}}}}

vLLM makes one instance per role: in the engine-core process (scheduler role) it delegates to
:class:`~kvstrata.connectors.vllm.scheduler.SchedulerHalf`, in each worker process (worker
role) to :class:`~kvstrata.connectors.vllm.worker.WorkerHalf`. This class only translates
vLLM's calls; the halves hold the logic.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...tiers import TierKind, spec
from .identity import model_identity
from .metadata import StepOrders
from .settings import KvGeometry, settings_from
from .stats import KvStrataPromMetrics, KvStrataStats, delta, estimates, moved

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvStrataConnector"]

log = logging.getLogger(__name__)

_HIT_SOURCE = {TierKind.HOST: CacheHitSource.HOST, TierKind.DISK: CacheHitSource.DISK}


class KvStrataConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstrata's tiers (G2 host RAM, G3 disk) under vLLM's KV cache; see the module
    docstring and docs/vllm.md. It declares ``SupportsHMA``: vLLM keeps its hybrid KV cache
    manager on and hands it every KV cache group (:mod:`.groups`)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        world_size = parallel.world_size
        geometry = KvGeometry.from_vllm(kv_cache_config, world_size,
                                        _replicating_ranks(parallel))
        settings = settings_from(extra, geometry,
                                 model_id=model_identity(vllm_config),
                                 block_layout=_block_layout(vllm_config, kv_cache_config),
                                 engine_index=_engine_index(parallel))
        if settings.load and not _engine_reads_cached_prefixes(vllm_config):
            log.warning("kvstrata: vLLM cannot attend to a cached prefix of this model here "
                        "(it turned its own prefix caching off: MLA on a CPU); kvstrata "
                        "stores its KV but loads none")
            settings = replace(settings, load=False)
        self.settings = settings
        self.scheduler = None
        self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import SchedulerHalf

            # A cache miss is never an error: a block that fails to load is recomputed.
            # vLLM reads this policy right after building the scheduler's connector.
            policy = "fail" if settings.fail_on_load_error else "recompute"
            if self._kv_transfer_config.kv_load_failure_policy != policy:
                log.info("kvstrata: kv_load_failure_policy=%s (a failed load is %s)", policy,
                         "an error" if policy == "fail" else "recomputed")
                self._kv_transfer_config.kv_load_failure_policy = policy

            observers = _kvstrata_publishers(settings)
            self.scheduler = SchedulerHalf(settings, vllm_config.parallel_config.world_size,
                                           observers=_primary_group_only(settings, observers))
            self._publishers = observers
            self._reported = self.scheduler.counters.as_dict()
            self._estimates_sent: dict | None = None
            self._tenant_blocks_sent: dict[str, int] = {}
        else:
            from .worker import WorkerHalf

            self.worker = WorkerHalf(settings, _worker_rank(world_size),
                                     world_size=world_size, server=_server_name(vllm_config))

    @property
    def requires_kv_delivery(self) -> bool:
        return False        # a cache: a store that does not happen is a future miss

    # -- worker role -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, StepOrders):
            self.worker.start(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, StepOrders) and kv_connector_metadata.flush:
            self.worker.flush_g1_readers()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None         # loads started when the orders were bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None         # loads are asynchronous: vLLM waits for get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None         # blocks are stored whole, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        sending, recving = self.worker.finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """As :meth:`get_finished`, plus the requests whose load failed in a model of several
        KV cache groups (vLLM takes block-level load errors from one group only: such a
        request is recomputed whole)."""
        sending, recving = self.worker.finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=self.worker.failed_requests())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.report()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.close()
        for publisher in getattr(self, "_publishers", ()):
            publisher.close()
            _log_lost_events(publisher)

    # -- scheduler role --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.scheduler.update_state_after_alloc(request, blocks.get_block_ids(),
                                                    num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        tiers = self.scheduler.last_load_tiers(request.request_id)
        out: dict[CacheHitSource, int] = {}
        bs = self.settings.kv.block_size
        for tier in tiers[:num_external_tokens // bs]:
            source = _HIT_SOURCE.get(spec(tier).kind, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + bs
        return out if sum(out.values()) == num_external_tokens else \
            {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids), None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids), None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    def get_kv_connector_stats(self) -> KvStrataStats | None:
        if self.scheduler is None:
            return None
        now = self.scheduler.counters.as_dict()
        stats = KvStrataStats(data=delta(now, self._reported))
        self._reported = now
        current = estimates(self.scheduler.planner.costs.snapshot())
        if moved(current, self._estimates_sent):
            stats.data["estimates"] = self._estimates_sent = current
        tenants = self.scheduler.planner.tenants
        if tenants is not None:
            held = {f"{tier}:{label}": n for (tier, label), n in tenants.held.items()}
            sent = self._tenant_blocks_sent
            if held != sent:
                # a label whose last block went is sent as 0, so its gauge does not stick
                stats.data["tenant_blocks"] = {**{k: 0 for k in sent}, **held}
                self._tenant_blocks_sent = held
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvStrataStats:
        return KvStrataStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvStrataPromMetrics:
        return KvStrataPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)


def _engine_reads_cached_prefixes(vllm_config: Any) -> bool:
    """Whether the engine's attention can start a prefill after a cached prefix. vLLM's CPU
    build cannot for MLA models (its CPU MLA prefill attends to the new tokens only) and
    turns prefix caching off for them: a loaded prefix would change the outputs."""
    from vllm.platforms import current_platform

    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    return not (getattr(model, "use_mla", False) and current_platform.is_cpu()
                and not getattr(cache, "enable_prefix_caching", True))


def _block_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    """How vLLM lays out a KV page here: its version, the device type, the KV cache layout
    the engine resolved (``LBNHC``, ``LBHNC``...: which way a page's tokens and heads are
    ordered; vLLM picks it from ``VLLM_KV_CACHE_LAYOUT``, the backends' preferences and the
    GPU) and the attention backend asked for. Both halves compute the same: the engine core
    resolves the layout before it builds the scheduler, and a worker records it before it
    builds its connector. A page stored under another layout passes every checksum, so only
    this name keeps it from being loaded as this one."""
    import vllm
    from vllm.platforms import current_platform

    cache = getattr(vllm_config, "cache_config", None)
    layout = getattr(cache, "kv_cache_layout", None) \
        or getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(getattr(attention, "backend", None), "name", None) or "auto"
    return f"vllm {vllm.__version__} {current_platform.device_type} {layout} {backend}"


def _replicating_ranks(parallel_config: Any) -> int:
    """How many consecutive workers would hold the same MLA latent and share one copy of it
    on this machine's disk: a tensor-parallel group's ranks, when the whole group runs on
    one machine (vLLM's own processes, each machine's ranks a whole number of groups). 1
    (a copy per rank, as for other models) where decode context parallelism splits the
    latent's tokens over them, or where a group may span machines (Ray, an external
    launcher, or groups cut by the machines' ranks)."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    if tp <= 1 or int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1) > 1:
        return 1
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    if backend not in (None, "mp", "uni"):
        return 1
    try:
        local = int(parallel_config.local_world_size)
    except (AttributeError, TypeError, ValueError):
        return 1
    return tp if local % tp == 0 else 1


def _server_name(vllm_config: "VllmConfig") -> str:
    """A name for this engine unique among the host's live engines: the owner tag of its
    engine core (the parent of vLLM's worker processes) and vLLM's instance id."""
    from ...physical.leftovers import owner_tag

    return f"{owner_tag(os.getppid())}-{getattr(vllm_config, 'instance_id', '') or 'engine'}"


def _engine_index(parallel_config: Any) -> int:
    """This engine's data-parallel rank: vLLM's ``data_parallel_index``, which, unlike
    ``data_parallel_rank``, vLLM does not reset to 0 in the engines of a dense model (they
    run as independent engines of one rank each)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def _worker_rank(world_size: int) -> int:
    """This worker's rank among its engine's ``world_size`` workers (tensor x pipeline
    parallel). vLLM's world group spans every data-parallel engine (engine ``k``'s workers
    are ranks ``k * world_size`` on), but each engine has its own scheduler: the rank in
    the engine is what names the worker's share of a block."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group) % max(1, world_size)
    except Exception:           # not initialised (single worker, tests)
        return 0


def _log_lost_events(publisher) -> None:
    """At shutdown, say how many of kvstrata's own events a sink never took (none: quiet)."""
    from ...events.publisher import delivery_report

    report = delivery_report(publisher.sink.describe(), publisher.metrics())
    if report["lost"]:
        log.warning("kvstrata: event sink %s: %d of %d events were not delivered (%d sink "
                    "errors)", report["sink"], report["lost"], report["enqueued"],
                    report["sink_errors"])


def _kvstrata_publishers(settings) -> list:
    """kvstrata's own event publishers (``events`` in the extra config), started: one per
    sink spec, each an observer of the scheduler half's block registry."""
    if not settings.events:
        return []
    from ...events.spec import make_publisher

    return [make_publisher(s, worker_id=settings.worker_id,
                           dp_rank=settings.data_parallel_index) for s in settings.events]


def _primary_group_only(settings, publishers: list) -> list:
    """The registry observers that feed ``publishers``: kvstrata's own event formats carry
    one group, the primary (:class:`~.events.PrimaryGroupOnly`)."""
    from .events import PrimaryGroupOnly
    from .groups import KvGroups

    if settings.groups == KvGroups():
        return publishers
    return [PrimaryGroupOnly(p, settings.groups) for p in publishers]


