"""One KV block's identity and lifecycle (Dynamo KVBM semantics).

States and the calls that move between them::

    Reset --init_sequence--> Partial --add_token(s)/pop_token(s)--> Partial
    Partial --commit (exactly full)--> Complete
    Reset --apply_token_block (a full block's identity)--> Complete
    Complete --register (through the pool; hash not live there)--> Registered
    any --reset--> Reset

An invalid transition raises :class:`BlockStateError` and changes nothing. A :class:`Block` is
a *view* of one slot of a pool's :class:`~kvstrata.logical.slots.SlotStore` (the slot's
fields live in the store's columns; views are made when asked for and hold nothing else);
engine code reaches blocks through the handles the pool hands out. ``Block(id, size)`` alone
makes a view of a slot of its own one-block store (tests, tools).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Iterable

import numpy as np

from ..tokens import DEFAULT_SEED, TokenError, chain_hash, local_block_hash
from ..types import BlockRecord, hash_problem, is_u64
from . import slots as _slots
from .slots import SlotStore


class BlockState(IntEnum):
    RESET = 0
    PARTIAL = 1
    COMPLETE = 2
    REGISTERED = 3


class BlockStateError(RuntimeError):
    """A lifecycle call that is not allowed in the block's current state."""

    def __init__(self, block_id: int, state: BlockState, action: str, why: str = "") -> None:
        detail = f": {why}" if why else ""
        super().__init__(f"block {block_id}: cannot {action} in state {state.name}{detail}")
        self.block_id = block_id
        self.state = state
        self.action = action


class BlockHashError(ValueError):
    """A hash that is not an unsigned 64-bit integer was given for a block's identity."""


class Block:
    """A slot of a pool: its state, tokens (while Partial) and identity (once Complete).

    A view: two views of one slot are equal and see the same fields.
    """

    __slots__ = ("_store", "block_id")

    def __init__(self, block_id: int, block_size: int | None = None, *,
                 store: SlotStore | None = None) -> None:
        if store is None:
            if block_size is None:
                raise TypeError("Block(block_id, block_size) or Block(block_id, store=...)")
            store = SlotStore(block_id + 1, block_size)
        self._store = store
        self.block_id = block_id

    def __repr__(self) -> str:
        return (
            f"Block(id={self.block_id}, {self.state.name}, hash={self.sequence_hash}, "
            f"refs={self.ref_count})"
        )

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Block) and other._store is self._store
                and other.block_id == self.block_id)

    def __hash__(self) -> int:
        return hash((id(self._store), self.block_id))

    # -- fields (read-only: the pool and these methods write the store) ---------------------
    @property
    def block_size(self) -> int:
        return self._store.block_size

    @property
    def state(self) -> BlockState:
        return BlockState(self._store.state[self.block_id])

    @property
    def tokens(self) -> list[int] | None:
        return self._store.tokens.get(self.block_id)

    @property
    def seed(self) -> int:
        return self._store.seeds.get(self.block_id, DEFAULT_SEED)

    @property
    def parent_hash(self) -> int | None:
        s, i = self._store, self.block_id
        return s.parent[i] if s.flags[i] & _slots.HAS_PARENT else None

    @property
    def local_hash(self) -> int | None:
        s, i = self._store, self.block_id
        return s.local[i] if s.state[i] >= _slots.COMPLETE else None

    @property
    def sequence_hash(self) -> int | None:
        s, i = self._store, self.block_id
        return s.seq[i] if s.state[i] >= _slots.COMPLETE else None

    @property
    def priority(self) -> int:
        return self._store.prio[self.block_id]

    @property
    def ref_count(self) -> int:
        return self._store.refs[self.block_id]

    @property
    def release_tick(self) -> int:
        return self._store.tick[self.block_id]

    @property
    def children(self) -> int:
        """How many registered children in this pool point at this block."""
        return self._store.kids[self.block_id]

    @property
    def policy_state(self) -> int:
        """The eviction policy's value for this block (e.g. an access count)."""
        return self._store.count[self.block_id]

    @property
    def cached_record(self) -> BlockRecord | None:
        """The record applied to this block (``apply_token_block``) until it is registered."""
        return self._store.pending.get(self.block_id)

    # -- transitions -----------------------------------------------------------------------
    def init_sequence(self, seed: int = DEFAULT_SEED, parent_hash: int | None = None) -> None:
        """Reset -> Partial: start filling this block, continuing ``parent_hash``'s chain."""
        if self.state is not BlockState.RESET:
            raise BlockStateError(self.block_id, self.state, "init_sequence", "must be Reset")
        if parent_hash is not None and not is_u64(parent_hash):
            raise BlockHashError(f"parent hash {parent_hash!r} is not an unsigned 64-bit integer")
        s, i = self._store, self.block_id
        s.state[i] = _slots.PARTIAL
        s.tokens[i] = []
        if seed != DEFAULT_SEED:
            s.seeds[i] = seed
        if parent_hash is None:
            s.flags[i] = 0
        else:
            s.parent[i] = parent_hash
            s.flags[i] = _slots.HAS_PARENT

    def add_tokens(self, tokens: Iterable[int]) -> None:
        """Append tokens while Partial; all or nothing if they would overflow the block."""
        self._require(BlockState.PARTIAL, "add_tokens")
        new = list(tokens)
        for i, token in enumerate(new):
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not (
                0 <= token <= 0xFFFFFFFF
            ):
                raise TokenError(f"token id must be an int in [0, 2**32-1], got {token!r}")
            new[i] = int(token)
        held = self.tokens
        assert held is not None
        if len(held) + len(new) > self.block_size:
            raise BlockStateError(
                self.block_id, self.state, "add_tokens",
                f"{len(held)} + {len(new)} tokens exceed block size {self.block_size}",
            )
        held.extend(new)

    def add_token(self, token: int) -> None:
        self.add_tokens((token,))

    def pop_tokens(self, count: int = 1) -> list[int]:
        """Remove the last ``count`` tokens while Partial."""
        self._require(BlockState.PARTIAL, "pop_tokens")
        held = self.tokens
        assert held is not None
        if not 0 <= count <= len(held):
            raise BlockStateError(
                self.block_id, self.state, "pop_tokens",
                f"cannot pop {count} of {len(held)} tokens",
            )
        popped = held[len(held) - count :]
        del held[len(held) - count :]
        return popped

    def pop_token(self) -> int:
        return self.pop_tokens(1)[0]

    def commit(self) -> None:
        """Partial -> Complete: the block is exactly full; its hashes are computed now."""
        self._require(BlockState.PARTIAL, "commit")
        held = self.tokens
        assert held is not None
        if len(held) != self.block_size:
            raise BlockStateError(
                self.block_id, self.state, "commit",
                f"holds {len(held)} of {self.block_size} tokens",
            )
        seed = self.seed
        local = local_block_hash(held, seed)
        s, i = self._store, self.block_id
        s.local[i] = local
        s.seq[i] = chain_hash(self.parent_hash, local, seed)
        s.seeds.pop(i, None)
        s.state[i] = _slots.COMPLETE

    def apply_token_block(self, record: BlockRecord) -> None:
        """Reset -> Complete from a full block's identity (the offload / onboard path)."""
        if self.state is not BlockState.RESET:
            raise BlockStateError(self.block_id, self.state, "apply_token_block", "must be Reset")
        if record.block_size != self.block_size or (
            record.token_ids is not None and len(record.token_ids) != self.block_size
        ):
            raise BlockStateError(
                self.block_id, self.state, "apply_token_block",
                f"token block of size {record.block_size} does not fill a block of {self.block_size}",
            )
        problem = hash_problem(record)
        if problem is not None:
            raise BlockHashError(f"block {self.block_id}: {problem}")
        done = self._store.ops.apply([self.block_id], [record], self.block_size)
        assert done == 1, "apply_token_block: a checked record was refused"

    def reset(self) -> None:
        """Any -> Reset, clearing tokens and identity (references are left as they are)."""
        self._store.ops.reset([self.block_id], self.ref_count, False)

    # -- views -----------------------------------------------------------------------------
    def record(self, keep_tokens: bool = False) -> BlockRecord:
        """This block's identity as a :class:`BlockRecord` (Complete or Registered only)."""
        if self.state < BlockState.COMPLETE:
            raise BlockStateError(self.block_id, self.state, "describe", "has no identity yet")
        tokens = self.tokens
        cached = self.cached_record
        if cached is not None and (cached.token_ids is not None) == (
            keep_tokens and tokens is not None
        ):
            return cached
        s, i = self._store, self.block_id
        kept = tuple(tokens) if keep_tokens and tokens is not None else None
        return BlockRecord(s.seq[i], s.local[i], self.parent_hash, s.block_size, kept)

    def _require(self, state: BlockState, action: str) -> None:
        if self.state is not state:
            raise BlockStateError(self.block_id, self.state, action, f"must be {state.name}")
