"""Small value types every layer shares: a block's identity and the integer ids around it.

This module imports nothing from kvstrata, so any layer (logical, protocol, placement, events)
can use it without pulling in another.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockRecord", "SequenceHash", "BlockId", "JobId", "U64_LIMIT", "is_u64"]

SequenceHash = int
"""A block's chained hash: unsigned 64-bit, equal hashes mean equal token prefixes."""
BlockId = int
"""A slot of one tier's storage (``0 .. capacity-1``), or a block id an engine hands out."""
JobId = int
"""Names one transfer plan; its result comes back under the same id."""

U64_LIMIT = 1 << 64


def is_u64(value: object) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[0, 2**64)``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < U64_LIMIT


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What the outside world needs to know about one full block.

    ``parent_hash`` is the sequence hash of the previous block in the chain (None for the
    first block); ``token_ids`` is optional and only filled when a pool was asked to keep
    tokens (it costs memory).
    """

    sequence_hash: SequenceHash
    local_hash: int
    parent_hash: SequenceHash | None
    block_size: int
    token_ids: tuple[int, ...] | None = None
