"""Handles on blocks handed out by a pool.

A handle covers a batch of blocks from one pool. It is released explicitly (``release()``) or by
leaving a ``with`` block. If a handle is garbage-collected unreleased, its finalizer
(``__del__``) posts its blocks to the pool's return queue; the pool takes them back on its next call, on its owner
thread (the garbage collector never mutates a pool).

* :class:`MutableBlocks` come from ``allocate``: exclusively owned, in any state but
  Registered; fill them (``init_sequence``/``add_tokens``/``commit`` or ``apply_token_block``)
  and hand them to ``register``. Releasing them unregistered returns them to the free list.
* :class:`ImmutableBlocks` come from ``register`` and ``match``: shared, registered blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .block import Block, BlockState
from .blockops import apply_records
from ..types import BlockRecord

if TYPE_CHECKING:
    from .pool import BlockPool


class HandleReleasedError(RuntimeError):
    """A handle was used after it was released or consumed by ``register``."""


class _Blocks:
    __slots__ = ("_pool", "_blocks")

    def __init__(self, pool: "BlockPool", blocks: list[Block]) -> None:
        self._pool = pool
        self._blocks: list[Block] | None = blocks

    def __del__(self) -> None:
        # Safety net only: queue the blocks for the pool's owner; never touch the pool here.
        blocks = getattr(self, "_blocks", None)
        if blocks:
            try:
                self._pool._post_orphans([b.block_id for b in blocks], self._mutable)
            except Exception:  # interpreter shutdown: nothing left to return blocks to
                pass

    _mutable = False

    @property
    def pool(self) -> "BlockPool":
        return self._pool

    @property
    def blocks(self) -> list[Block]:
        """The blocks (raises once released)."""
        if self._blocks is None:
            raise HandleReleasedError("handle already released")
        return self._blocks

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def sequence_hashes(self) -> list[int | None]:
        return [b.sequence_hash for b in self.blocks]

    @property
    def released(self) -> bool:
        return self._blocks is None

    def __len__(self) -> int:
        return len(self._blocks) if self._blocks is not None else 0

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def __getitem__(self, index: int) -> Block:
        return self.blocks[index]

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._blocks is not None:
            self.release()

    def release(self) -> None:
        """Give the blocks back to the pool; a second release raises HandleReleasedError."""
        self._pool.release(self)

    def _take(self) -> list[Block]:
        """Detach the blocks from this handle (the pool calls this when it takes them back)."""
        blocks = self.blocks
        self._blocks = None
        return blocks


class MutableBlocks(_Blocks):
    """Exclusively owned blocks on their way to being registered."""

    __slots__ = ()
    _mutable = True

    def apply_token_blocks(self, records: Sequence[BlockRecord]) -> None:
        """``apply_token_block`` on each block with the matching record; all or nothing."""
        blocks = self.blocks
        if len(records) != len(blocks):
            raise ValueError(f"{len(records)} records for {len(blocks)} blocks")
        size = blocks[0].block_size if blocks else 0
        # Inlined Block.apply_token_block for each pair (the offload hot path; natively
        # when built), then all or nothing: an invalid pair undoes what was applied.
        done = apply_records(blocks, records, size)
        if done < len(blocks):
            for block in blocks[:done]:
                block.reset()
            blocks[done].apply_token_block(records[done])  # raises the precise error
            raise AssertionError("apply_token_blocks: a record was refused, then accepted")


    def split(self, keep: Sequence[bool]) -> tuple["MutableBlocks | None", "MutableBlocks | None"]:
        """Split into (kept, rest) handles of the same pool; either may be None.

        This handle is consumed unless every block is kept (then it is returned as ``kept``)
        or none is (then it is returned as ``rest``). Used when part of a batch failed, so
        only the good blocks get registered.
        """
        blocks = self.blocks
        if len(keep) != len(blocks):
            raise ValueError(f"{len(keep)} flags for {len(blocks)} blocks")
        if all(keep):
            return self, None
        if not any(keep):
            return None, self
        self._take()
        kept = MutableBlocks(self._pool, [b for b, k in zip(blocks, keep) if k])
        rest = MutableBlocks(self._pool, [b for b, k in zip(blocks, keep) if not k])
        return kept, rest


class ImmutableBlocks(_Blocks):
    """Shared handles on registered blocks.

    The :class:`Block` objects are the pool's own: read them, never call their lifecycle
    methods (``reset`` on a registered block would corrupt the pool's bookkeeping).
    """

    __slots__ = ()
