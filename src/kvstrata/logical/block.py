"""One KV block's identity and lifecycle (Dynamo KVBM semantics).

States and the calls that move between them::

    Reset --init_sequence--> Partial --add_token(s)/pop_token(s)--> Partial
    Partial --commit (exactly full)--> Complete
    Reset --apply_token_block (a full block's identity)--> Complete
    Complete --register (through the pool; hash not live there)--> Registered
    any --reset--> Reset

An invalid transition raises :class:`BlockStateError` and changes nothing. A :class:`Block` is
owned by its pool; engine code reaches it through the handles the pool hands out.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Iterable

import numpy as np

from ..tokens import DEFAULT_SEED, TokenError, chain_hash, local_block_hash
from ..types import BlockRecord


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


class Block:
    """A slot of a pool: its state, tokens (while Partial) and identity (once Complete)."""

    __slots__ = (
        "block_id",
        "block_size",
        "state",
        "tokens",
        "seed",
        "parent_hash",
        "local_hash",
        "sequence_hash",
        "priority",
        "ref_count",
        "release_tick",
        "parent_id",
        "children",
        "cached_record",
        "policy_state",
    )

    def __init__(self, block_id: int, block_size: int) -> None:
        self.block_id = block_id
        self.block_size = block_size
        self.state = BlockState.RESET
        self.tokens: list[int] | None = None
        self.seed = DEFAULT_SEED
        self.parent_hash: int | None = None
        self.local_hash: int | None = None
        self.sequence_hash: int | None = None
        self.priority = 0
        self.ref_count = 0
        # Pool bookkeeping: recency stamp, the parent's slot in this pool (-1 if none) and
        # how many registered children in this pool point at this block.
        self.release_tick = 0
        self.parent_id = -1
        self.children = 0
        self.cached_record: BlockRecord | None = None
        # Scratch value owned by the pool's eviction policy (e.g. an access count).
        self.policy_state = 0

    def __repr__(self) -> str:
        return (
            f"Block(id={self.block_id}, {self.state.name}, hash={self.sequence_hash}, "
            f"refs={self.ref_count})"
        )

    # -- transitions -----------------------------------------------------------------------
    def init_sequence(self, seed: int = DEFAULT_SEED, parent_hash: int | None = None) -> None:
        """Reset -> Partial: start filling this block, continuing ``parent_hash``'s chain."""
        if self.state is not BlockState.RESET:
            raise BlockStateError(self.block_id, self.state, "init_sequence", "must be Reset")
        self.state = BlockState.PARTIAL
        self.tokens = []
        self.seed = seed
        self.parent_hash = parent_hash

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
        assert self.tokens is not None
        if len(self.tokens) + len(new) > self.block_size:
            raise BlockStateError(
                self.block_id, self.state, "add_tokens",
                f"{len(self.tokens)} + {len(new)} tokens exceed block size {self.block_size}",
            )
        self.tokens.extend(new)

    def add_token(self, token: int) -> None:
        self.add_tokens((token,))

    def pop_tokens(self, count: int = 1) -> list[int]:
        """Remove the last ``count`` tokens while Partial."""
        self._require(BlockState.PARTIAL, "pop_tokens")
        assert self.tokens is not None
        if not 0 <= count <= len(self.tokens):
            raise BlockStateError(
                self.block_id, self.state, "pop_tokens",
                f"cannot pop {count} of {len(self.tokens)} tokens",
            )
        popped = self.tokens[len(self.tokens) - count :]
        del self.tokens[len(self.tokens) - count :]
        return popped

    def pop_token(self) -> int:
        return self.pop_tokens(1)[0]

    def commit(self) -> None:
        """Partial -> Complete: the block is exactly full; its hashes are computed now."""
        self._require(BlockState.PARTIAL, "commit")
        assert self.tokens is not None
        if len(self.tokens) != self.block_size:
            raise BlockStateError(
                self.block_id, self.state, "commit",
                f"holds {len(self.tokens)} of {self.block_size} tokens",
            )
        self.local_hash = local_block_hash(self.tokens, self.seed)
        self.sequence_hash = chain_hash(self.parent_hash, self.local_hash, self.seed)
        self.state = BlockState.COMPLETE

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
        self.state = BlockState.COMPLETE
        self.sequence_hash = record.sequence_hash
        self.local_hash = record.local_hash
        self.parent_hash = record.parent_hash
        self.tokens = list(record.token_ids) if record.token_ids is not None else None
        self.cached_record = record

    def reset(self) -> None:
        """Any -> Reset, clearing tokens and identity."""
        self.state = BlockState.RESET
        self.tokens = None
        self.seed = DEFAULT_SEED
        self.parent_hash = None
        self.local_hash = None
        self.sequence_hash = None
        self.priority = 0
        self.parent_id = -1
        self.children = 0
        self.cached_record = None
        self.policy_state = 0

    # -- views -----------------------------------------------------------------------------
    def record(self, keep_tokens: bool = False) -> BlockRecord:
        """This block's identity as a :class:`BlockRecord` (Complete or Registered only)."""
        if self.state < BlockState.COMPLETE:
            raise BlockStateError(self.block_id, self.state, "describe", "has no identity yet")
        cached = self.cached_record
        if cached is not None and (cached.token_ids is not None) == (
            keep_tokens and self.tokens is not None
        ):
            return cached
        assert self.sequence_hash is not None and self.local_hash is not None
        tokens = tuple(self.tokens) if keep_tokens and self.tokens is not None else None
        return BlockRecord(
            self.sequence_hash, self.local_hash, self.parent_hash, self.block_size, tokens
        )

    def _require(self, state: BlockState, action: str) -> None:
        if self.state is not state:
            raise BlockStateError(self.block_id, self.state, action, f"must be {state.name}")
