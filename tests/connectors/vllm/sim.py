"""vLLM's side of the connector contract, simulated in one process with real bytes.

:class:`SimEngine` plays vLLM's scheduler and its workers around kvstrata's two connector
halves: it allocates engine block ids, asks for matches, reports allocations, runs steps
(orders to every worker, a "forward" that writes each full block's KV, stores after it),
combines the workers' outputs across tensor-parallel ranks as vLLM's aggregator does, frees or
holds finished requests, and can preempt. The KV tensors have vLLM's CPU layout
(``[blocks, kv_heads, block_size, 2 * head_dim]`` per layer); the KV written for a block is a
function of its sequence hash, the layer and the rank, so a loaded block can be checked byte
for byte. The real engine is exercised by tests/integration/test_vllm_engine.py; this
harness reaches corners a real engine reaches only by chance (preemption mid-store, several
ranks, failed loads) and runs in milliseconds.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import torch

from kvstrata.connectors.vllm.groups import KvGroups
from kvstrata.connectors.vllm.metadata import WorkerReport
from kvstrata.connectors.vllm.scheduler import SchedulerHalf
from kvstrata.connectors.vllm.settings import KvGeometry, settings_from
from kvstrata.connectors.vllm.worker import WorkerHalf
from kvstrata.physical.leftovers import owner_tag

LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def block_kv(sequence_hash: int, layer: int, rank: int, block_size: int) -> torch.Tensor:
    """The KV the simulated forward writes for a full block."""
    gen = torch.Generator().manual_seed((sequence_hash ^ (layer << 3) ^ (rank << 7)) % (1 << 62))
    return torch.randn(HEADS, block_size, 2 * HEAD_DIM, generator=gen).to(torch.bfloat16)


class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` the connector reads."""

    def __init__(self, request_id: str, prompt: list[int], max_new: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self._tokens = list(prompt)
        self.num_computed_tokens = 0
        self.max_new = max_new
        self.lora_request = None
        self.cache_salt = None
        self.mm_features: list = []
        self.block_ids: list[int] = []
        self.state = "waiting"
        self.loaded = 0                       # blocks promised by the connector

    @property
    def all_token_ids(self) -> list[int]:
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def generated(self) -> int:
        return len(self._tokens) - len(self.prompt_token_ids)


@dataclass
class _BlockState:
    table: dict[str, list[int] | tuple[list[int], ...]]
    """Per request its block ids, or one list per KV cache group."""

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        ids = self.table[req_id]
        return ids if isinstance(ids, tuple) else (ids,)


@dataclass
class _SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str]
    kv_connector_block_state: _BlockState


@dataclass
class _ConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_worker_meta: WorkerReport | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


_SERVERS = itertools.count()


class SimEngine:
    """See the module docstring."""

    def __init__(self, tmp_path, *, g1_blocks: int = 64, g2_blocks: int = 32,
                 g3_blocks: int | None = 64, ranks: int = 1, block_size: int = 4,
                 extra: dict | None = None, copy_engine=None,
                 groups: KvGroups = KvGroups(), mla: bool = False,
                 durable: bool = True, engine_index: int = 0) -> None:
        self.block_size = block_size
        # MLA: one latent of HEADS * 2 * HEAD_DIM per token, as vLLM's CPU MLA page
        # [blocks, 1, block_size, latent]
        page = (1, block_size, HEADS * 2 * HEAD_DIM) if mla \
            else (HEADS, block_size, 2 * HEAD_DIM)
        # MLA over several ranks: every rank holds the same latent (vLLM's replicated MLA)
        self.replicas = ranks if mla else 1
        geometry = KvGeometry(block_size, LAYERS, page[0], page[2] // (1 if mla else 2),
                              "bfloat16", g1_blocks, outer_dim=1 if mla else 2, groups=groups,
                              workers=ranks, replicas=self.replicas)
        tiers = {"G2": {"blocks": g2_blocks}}
        if g3_blocks:
            tiers["G3"] = {"blocks": g3_blocks}
        # The simulator's blocks are tiny and its steps instant: a cost model would rightly
        # recompute rather than load them. Tests of the load path turn it off; tests of the
        # decision turn it on and teach it costs.
        config = {"tiers": tiers, "o_direct": False, "cost_aware": False, **(extra or {})}
        if durable:                 # else G3 is a temporary slab
            config.setdefault("disk_dir", str(tmp_path))
        # no kvstrata setting from the environment but the deployment's sharing secret
        self.settings = settings_from(config, geometry, env={
            k: v for k, v in os.environ.items() if k.startswith("KVSTRATA_SHARING_")},
            engine_index=engine_index)
        self.scheduler = SchedulerHalf(self.settings, world_size=ranks)
        # the engine's name on this host (vLLM's: its engine core's owner tag and instance)
        server = f"{owner_tag()}-sim{next(_SERVERS)}"
        self.workers = [WorkerHalf(self.settings, rank=r, copy_engine=copy_engine,
                                   world_size=ranks, server=server)
                        for r in range(ranks)]
        self.kv = [[torch.zeros(g1_blocks, *page, dtype=torch.bfloat16)
                    for _ in range(LAYERS)] for _ in range(ranks)]
        for worker, layers in zip(self.workers, self.kv):
            worker.register_kv_caches({f"model.layers.{i}.attn": t
                                       for i, t in enumerate(layers)})
        self.free = list(range(1, g1_blocks))      # block 0 is vLLM's null block
        self.requests: dict[str, FakeRequest] = {}
        self.held: dict[str, FakeRequest] = {}
        self.finished: dict[str, FakeRequest] = {}
        self._preempted: set[str] = set()
        self.invalid_seen: set[int] = set()
        self._recv_counts: dict[str, int] = {}
        self._scribble: list[int] = []
        self.steps = 0

    # -- the engine's API ------------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_new: int = 2) -> FakeRequest:
        request = self.requests[req_id] = FakeRequest(req_id, prompt, max_new)
        return request

    def preempt(self, req_id: str, overwrite: bool = True) -> None:
        """Preempt a running request: its blocks are freed at once and, with ``overwrite``,
        scribbled over by the next step's forward (as another request reusing them would)."""
        request = self.requests[req_id]
        if overwrite:
            self._scribble.extend(request.block_ids)
        self._free(request)
        request.num_computed_tokens = 0
        request.state = "waiting"
        self._preempted.add(req_id)

    def run(self, timeout: float = 30.0) -> None:
        """Step until every request finished and the connector is idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.requests and not self.held and self.scheduler.idle \
                    and not any(w.outstanding for w in self.workers):
                return
            self.step()
            if not self._progressing:
                time.sleep(0.001)       # copies run on the transfer threads
        raise AssertionError(f"not idle after {timeout} s: {self.scheduler.status()}")

    def step(self) -> None:
        self.steps += 1
        bs = self.block_size
        scheduled: dict[str, int] = {}
        for request in list(self.requests.values()):
            if request.state == "waiting":
                n, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
                if n is None:                  # not determined yet: vLLM skips it this step
                    continue
                assert n % bs == 0 and n < request.num_tokens
                self._allocate_for(request, n)
                self.scheduler.update_state_after_alloc(request, self._tables(request), n)
                request.loaded = n // bs
                if is_async:
                    request.state = "loading"
                    request.num_computed_tokens = n
                    continue
                request.state = "running"
            if request.state == "running":
                todo = request.num_tokens - request.num_computed_tokens
                scheduled[request.request_id] = todo
        table = {r: self._tables(self.requests[r]) for r in scheduled}
        orders = self.scheduler.build_connector_meta(
            _SchedulerOutput(scheduled, set(self._preempted), _BlockState(table)))
        self._preempted.clear()
        output = _ConnectorOutput()
        recving: dict[str, int] = {}
        reports = []
        for rank, worker in enumerate(self.workers):
            worker.start(orders)
            if orders.flush:
                worker.flush_g1_readers()
            self._forward(rank, scheduled)
            worker.save()
            _, done = worker.finished()
            for req_id in done:
                recving[req_id] = recving.get(req_id, 0) + 1
            output.invalid_block_ids |= worker.load_errors()
            output.failed_recving |= worker.failed_requests()
            report = worker.report()
            if report is not None:
                reports.append(report)
        if reports:
            combined = reports[0]
            for other in reports[1:]:
                combined = combined.aggregate(other)
            output.kv_connector_worker_meta = combined
        # vLLM's aggregator passes a request on once every rank reported it
        for r, n in recving.items():
            self._recv_counts[r] = self._recv_counts.get(r, 0) + n
        output.finished_recving = {r for r, n in self._recv_counts.items()
                                   if n == len(self.workers)}
        for r in output.finished_recving:
            del self._recv_counts[r]
        self.invalid_seen |= output.invalid_block_ids
        self.scheduler.update_connector_output(output)
        self._progressing = bool(scheduled) or bool(output.finished_recving)
        self._after_step(scheduled, output)

    # -- internals -------------------------------------------------------------------------
    def _tables(self, request: FakeRequest) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group (one group here)."""
        return (list(request.block_ids),)

    def _allocate_for(self, request: FakeRequest, external_tokens: int) -> None:
        request.block_ids = self._allocate(-(-request.num_tokens // self.block_size))

    def _allocate(self, n: int) -> list[int]:
        assert len(self.free) >= n, "simulated KV cache full"
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    def _free(self, request: FakeRequest) -> None:
        self.free.extend(request.block_ids)
        request.block_ids = []

    def _forward(self, rank: int, scheduled: dict[str, int]) -> None:
        """Write the KV of every block this step makes full (and scribble over the blocks
        of requests preempted since the last step)."""
        bs = self.block_size
        for block_id in self._scribble:
            for layer in self.kv[rank]:
                layer[block_id].fill_(-7.0)
        if rank == len(self.kv) - 1:
            self._scribble = []
        for req_id, n in scheduled.items():
            request = self.requests[req_id]
            tracked = self.scheduler._requests.get(req_id)
            first = request.num_computed_tokens // bs
            last = (request.num_computed_tokens + n) // bs
            if tracked is None or last <= first:
                continue
            tracked.hash_upto(last, bs)
            for b in range(first, last):
                self._write_block(rank, request, tracked, b)

    def _write_block(self, rank: int, request: FakeRequest, tracked, b: int) -> None:
        """The forward writes block ``b`` of ``request`` (in every group holding it)."""
        for layer, tensor in enumerate(self.kv[rank]):
            tensor[request.block_ids[b]] = self.page_kv(tracked.seq[b], layer, rank)

    def page_kv(self, sequence_hash: int, layer: int, rank: int) -> torch.Tensor:
        """:func:`block_kv` in the shape of this engine's KV page."""
        page = self.kv[0][0].shape[1:]
        rank = rank if self.replicas == 1 else 0       # replicated: the same on every rank
        return block_kv(sequence_hash, layer, rank, self.block_size).reshape(page)

    def _after_step(self, scheduled: dict[str, int], output: _ConnectorOutput) -> None:
        bs = self.block_size
        for req_id in output.finished_recving or ():
            request = self.requests.get(req_id)
            if request is None:            # aborted while loading: vLLM frees it now
                continue
            bad = [i for i, b in enumerate(request.block_ids[:request.loaded])
                   if b in output.invalid_block_ids]
            if bad:
                request.num_computed_tokens = bad[0] * bs
            if req_id in output.failed_recving:           # recomputed whole
                request.num_computed_tokens = 0
            request.state = "running"
        for req_id in output.finished_sending or ():
            self.finished[req_id] = request = self.held.pop(req_id)
            self._free(request)
        for req_id, n in scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.generated >= request.max_new:
                self._finish(request)
                continue
            request._tokens.append(1000 + request.num_tokens % 97)   # the sampled token
            self._grow(request)

    def _grow(self, request: FakeRequest) -> None:
        """After a step: a block for the next token if it starts one."""
        if -(-request.num_tokens // self.block_size) > len(request.block_ids):
            request.block_ids += self._allocate(1)

    def _finish(self, request: FakeRequest) -> None:
        del self.requests[request.request_id]
        used = -(-request.num_computed_tokens // self.block_size)
        computed = tuple(ids[:used] for ids in self._tables(request))
        if self.scheduler.request_finished(request, computed if len(computed) > 1
                                           else list(computed[0])):
            self.held[request.request_id] = request
        else:
            self.finished[request.request_id] = request
            self._free(request)

    _progressing = True


def assert_idle(sim: SimEngine) -> None:
    """The engine and the connector are back where they started: no request, nothing held
    or loading, no copy in flight, every kvstrata slot idle."""
    status = sim.scheduler.status()
    assert sim.scheduler.idle, status
    assert status["tracked"] == 0 and status["held"] == 0 and status["loading"] == 0, status
    for tier, pool in status["pools"].items():
        assert pool["active"] == 0, (tier, pool)
    assert all(w.outstanding == 0 for w in sim.workers)
    assert not sim.held and not sim.requests


def sim_factory(cls, tmp_path, block_size: int):
    """A fixture body: yields ``make(**kw)`` building ``cls`` simulators, shuts them down."""
    sims = []

    def make(**kw):
        sim = cls(tmp_path / f"sim{len(sims)}", block_size=block_size, **kw)
        sims.append(sim)
        return sim

    yield make
    for sim in sims:
        for worker in sim.workers:
            worker.shutdown()


def slow_path(worker, path: str, seconds: float):
    """Make every ``path`` copy of ``worker`` sleep ``seconds`` first (a copy still running
    when the engine moves on); returns a function that restores the path."""
    handlers = worker.engine._handlers
    real = handlers[path]

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    handlers[path] = slow
    return lambda: handlers.__setitem__(path, real)
