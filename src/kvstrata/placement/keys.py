"""Names of blocks in key-addressed tiers (an object store shared by workers).

A block's key carries its whole identity, ``<sequence hash>.<local hash>.<parent hash>`` in
16 hex digits each (``root`` for the first block of a chain)::

    9f3a6c1e22b04d7a.0c1d2e3f40516273.root

so that listing a store tells a worker everything it needs to hold the block in its catalog
and announce it (parent and local hash are what router events carry), without reading a
single object. Two workers storing one block choose the same key (the identity follows from
the tokens), so a store holds each block once. The store adds its own namespace in front
(the compatibility fingerprint and tenant, see :mod:`kvstrata.compat`).

Whoever can write the bucket can also write names: several keys may name one sequence hash.
:func:`chain_consistent` tells the one whose hashes follow kvstrata's chaining rule, which
listings prefer (:mod:`kvstrata.manager.catalog`).
"""

from __future__ import annotations

import re

from ..tokens import chain_hash
from ..types import BlockRecord

__all__ = ["block_key", "chain_consistent", "parse_block_key"]

_KEY = re.compile(r"^([0-9a-f]{16})\.([0-9a-f]{16})\.([0-9a-f]{16}|root)$")


def block_key(record: BlockRecord) -> str:
    """The key of ``record``'s block in a key-addressed tier."""
    parent = "root" if record.parent_hash is None else f"{record.parent_hash:016x}"
    return f"{record.sequence_hash:016x}.{record.local_hash:016x}.{parent}"


def parse_block_key(key: str, block_size: int) -> BlockRecord | None:
    """The record a key names (None for any other name: foreign files, temporary names)."""
    match = _KEY.match(key)
    if match is None:
        return None
    seq, local, parent = match.groups()
    if parent == seq:                      # a block is never its own prefix: not ours
        return None
    return BlockRecord(int(seq, 16), int(local, 16), None if parent == "root" else int(parent, 16),
                       block_size)


def chain_consistent(record: BlockRecord) -> bool:
    """Whether ``record``'s sequence hash follows from its parent and local hash by
    kvstrata's chaining rule (:func:`kvstrata.tokens.chain_hash`, default seed); a first
    block's, under any seed. Blocks of a LoRA adapter or a cache salt (other seeds), or of
    the vLLM connector's secondary KV cache groups (group-keyed hashes), do not follow it
    either, so this ranks the keys that name one sequence hash; it cannot reject one."""
    return chain_hash(record.parent_hash, record.local_hash) == record.sequence_hash
