"""Loops over a batch of a pool's blocks, on the pool's hot paths.

Each function here has a pure-Python version (the reference, always available) and, when the
optional extension ``kvstrata.logical._blockops`` is built (``pip install -e .``), a native
one that does the same stores straight into the blocks' slots: a pool's eviction resets a
dozen slots per block, ``apply_token_blocks`` five, a release two, and in Python each store is
a bytecode round trip. Both versions have the same effects and raise the same errors; the
tests of ``tests/logical`` run on both (``use_native``).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Sequence

from ..tokens import DEFAULT_SEED
from ..types import BlockRecord
from .block import Block, BlockState

__all__ = ["NATIVE", "use_native", "reset_all", "apply_records", "release_registered",
           "mark_registered", "register_new"]

_RESET, _COMPLETE, _REGISTERED = BlockState.RESET, BlockState.COMPLETE, BlockState.REGISTERED


_FUNCTIONS = ("setup", "reset", "apply", "release", "mark", "register_new", "lfu_insert",
              "lfu_victims", "recent_victims", "recent_prune", "lru_shadow_serve",
              "lfu_shadow_serve")


def _load():
    try:
        from . import _blockops
        for name in _FUNCTIONS:          # a stale build (an older .c) counts as not built
            getattr(_blockops, name)
        _blockops.setup(Block, BlockRecord, _RESET, _COMPLETE, _REGISTERED, DEFAULT_SEED)
    except (ImportError, TypeError, AttributeError):
        return None
    return _blockops


_native = _load()
NATIVE = _native is not None
"""Whether the native loops are available."""


def native():
    """The native module when it is in use, else None (for the aged-LFU and adaptive
    orders' loops, which keep their Python versions next to their data structures in
    eviction.py and adaptive.py)."""
    return _native


def use_native(enabled: bool) -> bool:
    """Turn the native loops on or off (tests, benchmarks); returns the previous setting.
    Turning them on when the extension is not built raises ``RuntimeError``."""
    global _native
    previous = _native is not None
    if enabled:
        native = _load()
        if native is None:
            raise RuntimeError("the native block loops (kvstrata.logical._blockops) are not built")
        _native = native
    else:
        _native = None
    return previous


def reset_all(blocks: list[Block], ref_count: int, plain: bool = False) -> None:
    """``Block.reset()`` on each block and its references set to ``ref_count``. ``plain``:
    leave ``parent_id``, ``children`` and ``policy_state`` alone (pools that never set them)."""
    if _native is not None:
        _native.reset(blocks, ref_count, plain)
        return
    state, seed = _RESET, DEFAULT_SEED
    for block in blocks:
        block.ref_count = ref_count
        block.state = state
        block.tokens = None
        block.seed = seed
        block.parent_hash = None
        block.local_hash = None
        block.sequence_hash = None
        block.priority = 0
        if not plain:
            block.parent_id = -1
            block.children = 0
        block.cached_record = None
        if not plain:
            block.policy_state = 0


def apply_records(blocks: list[Block], records: Sequence[BlockRecord], size: int) -> int:
    """``apply_token_block``'s stores for ``blocks[i]`` from ``records[i]`` while the pair is
    valid (the block Reset, the record of ``size`` tokens and its tokens, if any, that many);
    returns how many were applied (stops at the first invalid pair)."""
    done = 0
    if _native is not None:
        done = _native.apply(blocks, records, size)
        if done == len(blocks):
            return done
    reset, complete = _RESET, _COMPLETE
    for block, record in zip(blocks[done:], records[done:]):
        if block.state is not reset or record.block_size != size:
            break
        tokens = record.token_ids
        if tokens is not None:
            if len(tokens) != size:
                break
            block.tokens = list(tokens)
        block.state = complete
        block.sequence_hash = record.sequence_hash
        block.local_hash = record.local_hash
        block.parent_hash = record.parent_hash
        block.cached_record = record
        done += 1
    return done


def release_registered(blocks: list[Block], tick: int) -> tuple[int, list[Block]]:
    """Drop one reference from each block; those left with none get ``release_tick`` =
    the next tick after ``tick``, in order. Returns the last tick and those blocks."""
    if _native is not None and tick < 2**62:
        out = _native.release(blocks, tick)
        if out is not None:
            return out
    idle: list[Block] = []
    for block in blocks:
        refs = block.ref_count - 1
        block.ref_count = refs
        if refs == 0:
            tick += 1
            block.release_tick = tick
            idle.append(block)
        else:
            assert refs > 0, f"block {block.block_id} released more than acquired"
    return tick, idle


def mark_registered(blocks: list[Block]) -> None:
    """Set each block's state to Registered."""
    if _native is not None:
        _native.mark(blocks, _REGISTERED)
        return
    state = _REGISTERED
    for block in blocks:
        block.state = state


_state_of = attrgetter("state")
_hash_of = attrgetter("sequence_hash")
_record_of = attrgetter("cached_record")


def register_new(blocks: list[Block], by_hash: dict[int, Block], tiers: dict[int, int] | None,
                 bit: int, remove=None) -> tuple[list[BlockRecord], bool] | None:
    """Register a batch in bulk when nothing is deduplicated: if every block is Complete
    with its record at hand and no hash is in ``by_hash`` or twice in the batch, index each
    (``by_hash[h] = block``) and mark it Registered, in order. With ``remove`` (a leaf-first
    pool's ``eviction.remove``), each block is also linked to its parent held here, as
    ``BlockPool._link_parent``. If ``tiers`` (a registry's map) holds none of the hashes
    either, set ``tiers[h] = bit`` too. Returns the records and whether ``tiers`` was
    updated; None, with nothing changed, otherwise."""
    if _native is not None:
        return _native.register_new(blocks, by_hash, tiers, bit, remove)
    if list(map(_state_of, blocks)).count(_COMPLETE) != len(blocks):
        return None
    hashes = list(map(_hash_of, blocks))
    stored = list(map(_record_of, blocks))
    if not all(stored) or not by_hash.keys().isdisjoint(hashes):
        return None
    if remove is None:
        size = len(by_hash)
        by_hash.update(zip(hashes, blocks))
        if len(by_hash) != size + len(hashes):       # a hash twice in the batch: undo
            for h in hashes:
                by_hash.pop(h, None)
            return None
        mark_registered(blocks)
    else:
        if len(set(hashes)) != len(hashes):
            return None
        get, state = by_hash.get, _REGISTERED
        for block, h in zip(blocks, hashes):
            by_hash[h] = block
            block.state = state
            parent_hash = block.parent_hash
            if parent_hash is not None:               # BlockPool._link_parent, inlined
                parent = get(parent_hash)
                if parent is not None and parent is not block:
                    block.parent_id = parent.block_id
                    parent.children += 1
                    if parent.children == 1 and parent.ref_count == 0:
                        remove(parent)
    tiers_new = tiers is not None and tiers.keys().isdisjoint(hashes)
    if tiers_new:
        tiers.update(dict.fromkeys(hashes, bit))  # type: ignore[union-attr]
    return stored, tiers_new
