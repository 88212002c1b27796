"""Handles on blocks handed out by a pool.

A handle covers a batch of blocks from one pool. It is released explicitly (``release()``) or by
leaving a ``with`` block. If a handle is garbage-collected unreleased, its finalizer
(``__del__``) posts its blocks to the pool's return queue; the pool takes them back on its next call, on its owner
thread (the garbage collector never mutates a pool).

* :class:`MutableBlocks` come from ``allocate``: exclusively owned, in any state but
  Registered; fill them (``init_sequence``/``add_tokens``/``commit`` or ``apply_token_block``)
  and hand them to ``register``. Releasing them unregistered returns them to the free list.
* :class:`ImmutableBlocks` come from ``register`` and ``match``: shared, registered blocks.

A handle holds its blocks' slot ids; :class:`Block` views of them are made when asked for.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from .block import Block
from .slots import SlotStore
from ..types import BlockRecord


class HandleOwner(Protocol):
    """What a handle needs of the pool that handed it out (a
    :class:`~kvstrata.logical.pool.BlockPool`): its slot store, to make views of the
    blocks; ``release``, to give them back; and ``_post_orphans``, the queue a finalizer
    posts unreleased blocks to for the pool's owner thread. (A protocol, so that this module
    does not import the pool, which imports it.)"""

    _store: SlotStore

    def release(self, handle: "_Blocks") -> None: ...

    def _post_orphans(self, ids: list[int], mutable: bool) -> None: ...


class HandleReleasedError(RuntimeError):
    """A handle was used after it was released or consumed by ``register``."""


class _Blocks:
    __slots__ = ("_pool", "_ids")

    def __init__(self, pool: HandleOwner, ids: list[int]) -> None:
        self._pool = pool
        self._ids: list[int] | None = ids

    def __del__(self) -> None:
        # Safety net only: queue the blocks for the pool's owner; never touch the pool here.
        ids = getattr(self, "_ids", None)
        if ids:
            try:
                self._pool._post_orphans(ids, self._mutable)
            except Exception:  # interpreter shutdown: nothing left to return blocks to
                pass

    _mutable = False

    @property
    def pool(self) -> HandleOwner:
        """The pool that handed these blocks out (a
        :class:`~kvstrata.logical.pool.BlockPool`)."""
        return self._pool

    @property
    def blocks(self) -> list[Block]:
        """Views of the blocks (raises once released)."""
        store = self._pool._store
        return [Block(i, store=store) for i in self.block_ids]

    @property
    def block_ids(self) -> list[int]:
        """The blocks' slot ids (raises once released)."""
        if self._ids is None:
            raise HandleReleasedError("handle already released")
        return list(self._ids)

    @property
    def sequence_hashes(self) -> list[int | None]:
        store = self._pool._store
        state, seq = store.state, store.seq
        return [seq[i] if state[i] >= 2 else None for i in self.block_ids]

    @property
    def released(self) -> bool:
        return self._ids is None

    def __len__(self) -> int:
        return len(self._ids) if self._ids is not None else 0

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def __getitem__(self, index: int) -> Block:
        if self._ids is None:
            raise HandleReleasedError("handle already released")
        return Block(self._ids[index], store=self._pool._store)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._ids is not None:
            self.release()

    def release(self) -> None:
        """Give the blocks back to the pool; a second release raises HandleReleasedError."""
        self._pool.release(self)

    def _take(self) -> list[int]:
        """Detach the slot ids from this handle (the pool calls this when it takes them)."""
        if self._ids is None:
            raise HandleReleasedError("handle already released")
        ids = self._ids
        self._ids = None
        return ids


class MutableBlocks(_Blocks):
    """Exclusively owned blocks on their way to being registered."""

    __slots__ = ()
    _mutable = True

    def apply_token_blocks(self, records: Sequence[BlockRecord]) -> None:
        """``apply_token_block`` on each block with the matching record; all or nothing."""
        ids = self._ids
        if ids is None:
            raise HandleReleasedError("handle already released")
        if len(records) != len(ids):
            raise ValueError(f"{len(records)} records for {len(ids)} blocks")
        store = self._pool._store
        # The stores of Block.apply_token_block for each pair in one loop (natively when
        # built), then all or nothing: an invalid pair undoes what was applied.
        done = store.ops.apply(ids, records, store.block_size)
        if done < len(ids):
            store.ops.reset(ids[:done], 1, False)
            Block(ids[done], store=store).apply_token_block(records[done])  # the precise error
            raise AssertionError("apply_token_blocks: a record was refused, then accepted")

    def split(self, keep: Sequence[bool]) -> tuple["MutableBlocks | None", "MutableBlocks | None"]:
        """Split into (kept, rest) handles of the same pool; either may be None.

        This handle is consumed unless every block is kept (then it is returned as ``kept``)
        or none is (then it is returned as ``rest``). Used when part of a batch failed, so
        only the good blocks get registered.
        """
        ids = self.block_ids
        if len(keep) != len(ids):
            raise ValueError(f"{len(keep)} flags for {len(ids)} blocks")
        if all(keep):
            return self, None
        if not any(keep):
            return None, self
        self._take()
        kept = MutableBlocks(self._pool, [i for i, k in zip(ids, keep) if k])
        rest = MutableBlocks(self._pool, [i for i, k in zip(ids, keep) if not k])
        return kept, rest


class ImmutableBlocks(_Blocks):
    """Shared handles on registered blocks.

    The :class:`Block` views show the pool's own slots: read them, never call their
    lifecycle methods (``reset`` on a registered block would corrupt the pool's bookkeeping).
    """

    __slots__ = ()
