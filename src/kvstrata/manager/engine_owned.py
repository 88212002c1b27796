"""``EngineOwnedManager``: a block manager over an engine's own KV memory, whose blocks the
engine allocates and frees (SGLang's host pool; any engine that hands block ids over).

It is :class:`~kvstrata.manager.block_manager.KvBlockManager` with one difference: G1 is the
engine's (``engine_owns_g1``), so kvstrata keeps no G1 pool and never allocates, evicts or
reuses a G1 block. The engine says which of its blocks hold what:

* :meth:`~EngineOwnedManager.store` -- blocks the engine computed (or holds) in its block ids
  are copied down the tiers; the future resolves once no copy reads those blocks any more,
  so the engine may then reuse them;
* :meth:`~EngineOwnedManager.load` -- the longest held prefix of some hashes is copied into the
  engine's block ids it gives, verified; the future gives the
  :class:`~kvstrata.placement.OnboardResult` (what was loaded, what failed);
* :meth:`~EngineOwnedManager.held` -- how long a prefix the tiers hold (no side effect).

The verbs of an owned G1 (``allocate``, ``register``, ``match``, ``onboard`` without block
ids) are refused with a :class:`~kvstrata.manager.errors.ManagerError`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

from ..config import tenant_problem
from ..placement import OnboardResult
from ..types import BlockRecord, first_bad_record
from .block_manager import KvBlockManager, _hashes
from .errors import InvalidBlockError, ManagerConfigError, ManagerError

__all__ = ["EngineOwnedManager", "checked_engine_ids"]


def checked_engine_ids(engine_block_ids: Sequence[int], count: int, capacity: int,
                       what: str) -> list[int]:
    """The engine's block ids, checked: ``count`` distinct ints in ``0..capacity-1``
    (:class:`InvalidBlockError` naming ``what`` otherwise)."""
    try:
        ids = [int(b) for b in engine_block_ids]
    except (TypeError, ValueError):
        raise InvalidBlockError(f"{what}: engine_block_ids must be integers") from None
    if len(ids) != count or len(set(ids)) != count \
            or any(not 0 <= b < capacity for b in ids):
        raise InvalidBlockError(f"{what}: give {count} distinct engine block ids in "
                                f"0..{capacity - 1}, got {len(ids)} "
                                f"({ids[:4]}{'...' if len(ids) > 4 else ''})")
    return ids


class EngineOwnedManager(KvBlockManager):
    """See the module docstring. ``kv_caches`` (the engine's KV tensors) is required; every
    other argument is :class:`KvBlockManager`'s."""

    engine_owns_g1 = True

    def __init__(self, config=None, *, kv_caches, **kwargs: Any) -> None:
        if kv_caches is None:
            raise ManagerConfigError("an engine-owned G1 needs the engine's KV tensors "
                                     "(kv_caches)")
        self._stores: list[tuple[frozenset[int], Future]] = []
        """Store calls waiting for the copies that read their engine blocks."""
        super().__init__(config, kv_caches=kv_caches, **kwargs)

    # ------------------------------------------------------------------ the engine's verbs
    def held(self, sequence_hashes: Sequence[int]) -> "Future[int]":
        """How many blocks of the longest prefix of ``sequence_hashes`` the tiers below G1
        hold (no side effect)."""
        hashes = _hashes(sequence_hashes, "held")
        return self._call(lambda: len(self.planner.lookup(hashes)))

    def store(self, records: Sequence[BlockRecord], engine_block_ids: Sequence[int],
              tenant: str | None = None) -> "Future[None]":
        """Copy the blocks ``records`` name, held in the engine's ``engine_block_ids``, down
        the tiers (those a tier already holds are skipped; a tier's admission filter and
        ``tenant``'s quotas apply). Resolves once no copy reads those engine blocks (the
        engine may then reuse them), or fails with ``PlacementError`` (nothing planned) if
        one of them is still being filled by a load."""
        records = list(records)
        bad = first_bad_record(records, self.config.block_size)
        if bad is not None:
            raise InvalidBlockError(f"store: records[{bad}] is not a block record of "
                                    f"{self.config.block_size} tokens with u64 hashes")
        ids = self._engine_ids(engine_block_ids, len(records), "store")
        tenant = self.config.tenant if tenant is None else tenant
        if tenant_problem(tenant):
            raise InvalidBlockError(f"store: {tenant_problem(tenant)}")

        def run(future: Future) -> None:
            self.planner.prepare_offload(self._top, records, engine_block_ids=ids,
                                         tenant=tenant)
            self._stores.append((frozenset(ids), future))
        return self._call(run, deferred=True)

    def load(self, sequence_hashes: Sequence[int], engine_block_ids: Sequence[int],
             cost_aware: bool = False) -> "Future[OnboardResult]":
        """Copy the longest held prefix of ``sequence_hashes`` into the engine's
        ``engine_block_ids`` (one per hash; those past the prefix are not touched), verified.
        The future gives what was loaded (``len(result)`` blocks, their sources) and what
        failed (dropped from its tier: the engine must recompute from there).
        ``cost_aware``: load only as far as the cost model estimates loading beats
        recomputing (see :meth:`KvBlockManager.onboard`)."""
        hashes = _hashes(sequence_hashes, "load")
        ids = self._engine_ids(engine_block_ids, len(hashes), "load")

        def run(future: Future) -> None:
            self._onboards[self._prepare_load(hashes, cost_aware, ids)] = future
        return self._call(run, deferred=True)

    def _engine_ids(self, engine_block_ids: Sequence[int], count: int, what: str) -> list[int]:
        return checked_engine_ids(engine_block_ids, count,
                                  self.config.tier_blocks(self._top), what)

    # ------------------------------------------------------------------ owner thread steps
    def _after_step(self) -> None:
        super()._after_step()
        if self._stores:
            in_use = self.planner.engine_blocks_in_use()
            waiting = []
            for ids, future in self._stores:
                if ids & in_use:
                    waiting.append((ids, future))
                elif not future.done():
                    future.set_result(None)
            self._stores = waiting

    def _fail_onboards(self, error: ManagerError) -> None:
        # The owner broke: copies may still fill or read the engine's blocks. Let the running
        # ones end (queued ones are cancelled) before the engine hears its loads failed and
        # its stores are over: it reuses those blocks as soon as it does.
        if self.engine is not None:
            self.engine.close(cancel_pending=True)
        super()._fail_onboards(error)
        stores, self._stores = self._stores, []
        for _, future in stores:
            if not future.done():
                future.set_exception(error)

    # ------------------------------------------------------------------ an owned G1's verbs
    def _refuse(self, what: str) -> ManagerError:
        return ManagerError(f"{what}: the engine owns G1 here; use store() and load() with "
                            f"its block ids")

    def allocate(self, count: int):
        raise self._refuse("allocate")

    def register(self, blocks, priority: int = 0, tenant: str | None = None):
        raise self._refuse("register")

    def match(self, sequence_hashes):
        raise self._refuse("match")

    def onboard(self, sequence_hashes, cost_aware: bool = False):
        raise self._refuse("onboard")

    def release(self, handle):
        """Refused: there are no G1 handles here (a load's result holds none)."""
        raise self._refuse("release")

    def write_g1(self, block_ids, payloads) -> None:
        raise self._refuse("write_g1")

    def read_g1(self, block_ids):
        raise self._refuse("read_g1")

    def export(self, *args, **kwargs):
        raise self._refuse("export")

    def importer(self, *args, **kwargs):
        raise self._refuse("importer")

    def fetch_remote(self, *args, **kwargs):
        raise self._refuse("fetch_remote")
