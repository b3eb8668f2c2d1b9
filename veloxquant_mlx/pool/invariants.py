"""A full recount of a pool's state, for tests and debugging."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from veloxquant_mlx.pool.allocator import BlockPoolAllocator


def check_pool_locked(pool: BlockPoolAllocator) -> None:
    """Assert every invariant of ``pool`` by recounting (caller holds ``pool._lock``). O(blocks).

    Conservation (each live block is free xor owned), no duplicates on free lists, disjoint
    owners, the fresh prefix of each free list, per-owner and total fragmentation, counters
    against state, and growth within ``max_blocks``.
    """
    stats = pool._stats
    free_ids: set[int] = set()
    for stream, free in pool._free.items():
        for block in free:
            assert block.owner is None, f"free block {block.block_id} has an owner"
            assert block.stream == stream, f"block {block.block_id} on the wrong list"
            assert block.n_used == 0, f"free block {block.block_id} has n_used"
            assert block.block_id not in free_ids, f"block {block.block_id} freed twice"
            assert pool._blocks.get(block.block_id) is block, "free block not live"
            free_ids.add(block.block_id)
    for stream, free in pool._free.items():
        n_fresh = pool._n_fresh[stream]
        assert all(not b.ever_allocated for b in free[:n_fresh]), "fresh prefix drifted"
        assert all(b.ever_allocated for b in free[n_fresh:]), "reused block not marked"
    owned_ids: set[int] = set()
    n_fragmented = 0
    for owner, record in pool._owners.items():
        n_owner_fragmented = 0
        for block_id, block in record.blocks.items():
            assert block.block_id == block_id, f"block {block_id} filed under another id"
            assert block.owner == owner, f"block {block_id} owner mismatch"
            assert block.ever_allocated, f"owned block {block_id} not marked allocated"
            assert block_id not in owned_ids, f"block {block_id} has two owners"
            assert pool._blocks.get(block_id) is block, "owned block not live"
            assert 0 <= block.n_used <= pool._block_size
            owned_ids.add(block_id)
            n_owner_fragmented += 0 < block.n_used < pool._block_size
        assert record.n_fragmented == n_owner_fragmented, f"owner {owner!r} fragments"
        n_fragmented += n_owner_fragmented
    assert not free_ids & owned_ids, "a block is both free and owned"
    assert free_ids | owned_ids == set(pool._blocks), "blocks lost (neither free nor owned)"
    assert stats.n_blocks == len(pool._blocks), "n_blocks != live blocks"
    for stream, n_total in pool._n_total_by_stream.items():
        n_live = sum(1 for b in pool._blocks.values() if b.stream == stream)
        assert n_total == n_live, f"stream {stream} total drifted"
    assert stats._blocks_in_use == len(owned_ids), "blocks_in_use != owned blocks"
    assert stats._fragmented_count == n_fragmented, "fragmented count drifted"
    assert stats.peak_blocks_in_use >= stats._blocks_in_use, "peak below current use"
    cap = pool.config.max_blocks
    if pool.config.grow_on_exhaustion and cap is not None:
        assert len(pool._blocks) <= max(cap, pool.config.n_blocks), "grew past max_blocks"
