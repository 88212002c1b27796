"""Consistency checks of a :class:`~kvstrata.logical.pool.BlockPool` (tests and debugging).

Kept apart from the pool because they walk every slot (O(capacity), more for leaf-first
pools): nothing on a hot path calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block import BlockState

if TYPE_CHECKING:
    from .pool import BlockPool


def check_pool_invariants(pool: "BlockPool") -> None:
    """Assert ``pool``'s bookkeeping is consistent; raises ``AssertionError`` naming the
    first inconsistency."""
    free = set(pool._free)
    assert len(free) == len(pool._free), "a slot is on the free list twice"
    assert len(pool._blocks) <= pool.capacity, "more slots made than the capacity"
    assert all(b.block_id == i for i, b in enumerate(pool._blocks)), "slot ids out of place"
    inactive = 0
    for block in pool._blocks:
        assert block.ref_count >= 0, f"block {block.block_id} has negative refs"
        if block.block_id in free:
            assert block.state is BlockState.RESET and block.ref_count == 0, (
                f"free block {block.block_id} is {block.state.name} with {block.ref_count} refs"
            )
        elif block.state is BlockState.REGISTERED:
            assert pool._by_hash.get(block.sequence_hash) is block, (  # type: ignore[arg-type]
                f"registered block {block.block_id} not indexed by its hash"
            )
            inactive += block.ref_count == 0
        else:
            assert block.ref_count > 0, f"unregistered block {block.block_id} leaked"
    assert inactive == pool._inactive, f"inactive count {pool._inactive} != {inactive}"
    assert len(pool._by_hash) <= pool.capacity
    for h, block in pool._by_hash.items():
        assert block.sequence_hash == h and block.state is BlockState.REGISTERED
    if pool._leaf_first:
        for block in pool._by_hash.values():
            kids = sum(
                1 for b in pool._by_hash.values() if b.parent_id == block.block_id
            )
            assert kids == block.children, f"block {block.block_id} child count drifted"
    expected_evictable = {
        b.block_id
        for b in pool._by_hash.values()
        if b.ref_count == 0 and not (pool._leaf_first and b.children)
    }
    members = pool.eviction.members()
    assert members == expected_evictable and len(pool.eviction) == len(members), (
        f"eviction order holds {sorted(members)[:8]}..., expected {sorted(expected_evictable)[:8]}..."
    )

