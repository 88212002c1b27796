"""Small value types every layer shares: a block's identity and the integer ids around it.

This module imports nothing from kvstrata, so any layer (logical, protocol, placement, events)
can use it without pulling in another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["BlockRecord", "SequenceHash", "BlockId", "JobId", "U64_LIMIT", "is_u64",
           "has_u64_hashes", "hash_problem", "first_bad_record"]

SequenceHash = int
"""A block's chained hash: unsigned 64-bit, equal hashes mean equal token prefixes."""
BlockId = int
"""A slot of one tier's storage (``0 .. capacity-1``), or a block id an engine hands out."""
JobId = int
"""Names one transfer plan; its result comes back under the same id."""

U64_LIMIT = 1 << 64


def is_u64(value: object) -> bool:
    """Whether ``value`` can be a block hash: an int (not a bool) in ``[0, 2**64)``. The one
    rule every layer checks hashes by (the native slot store applies the same)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < U64_LIMIT


def has_u64_hashes(sequence_hash: object, local_hash: object, parent_hash: object) -> bool:
    """Whether these can be one block's hashes (:func:`is_u64`; the parent may be None)."""
    return is_u64(sequence_hash) and is_u64(local_hash) and (
        parent_hash is None or is_u64(parent_hash))


def hash_problem(block: object) -> str | None:
    """What is wrong with the hashes of ``block`` (a :class:`BlockRecord`, or anything with
    its three hash attributes), e.g. ``"local_hash -1 is not an unsigned 64-bit integer"``;
    None if nothing is."""
    for name in ("sequence_hash", "local_hash", "parent_hash"):
        value = getattr(block, name)
        if not (is_u64(value) or (name == "parent_hash" and value is None)):
            return f"{name} {value!r} is not an unsigned 64-bit integer"
    return None


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


def first_bad_record(records: "Sequence[object]", block_size: int) -> int | None:
    """The position of the first item that is not a :class:`BlockRecord` of ``block_size``
    tokens with u64 hashes (None if all are)."""
    for i, record in enumerate(records):
        if not isinstance(record, BlockRecord) or record.block_size != block_size \
                or not has_u64_hashes(record.sequence_hash, record.local_hash,
                                      record.parent_hash):
            return i
    return None
