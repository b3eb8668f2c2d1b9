"""Every documented behaviour of BlockPoolAllocator, one test each."""

from collections import deque

import pytest

from tests.pool.helpers import ids, make_pool
from veloxquant_mlx.memory import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.pool import DEFAULT_HISTORY_SIZE


def test_seed_example_runs_verbatim():
    request_id = 42
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
    blocks = pool.allocate(stream="k", n_tokens=40, owner=request_id, format="int2")
    assert [b.n_used for b in blocks] == [16, 16, 8]
    assert all(b.format == "int2" and b.owner == request_id for b in blocks)
    pool.free_all(owner=request_id)
    assert pool.n_free("k") == 128 and pool.stats.blocks_in_use() == 0
    pool.check_invariants()


def test_default_config_and_errors_subclass_builtins():
    pool = BlockPoolAllocator()
    assert pool.config == PoolConfig()
    assert pool.stats.n_blocks == 1024
    assert issubclass(BlockPoolExhaustedError, RuntimeError)
    assert issubclass(OwnerAlreadyActiveError, ValueError)


def test_separate_kv_splits_blocks_k_taking_the_odd_one():
    pool = make_pool(n_blocks=5)
    assert (pool.n_free("k"), pool.n_free("v"), pool.n_free("kv")) == (3, 2, 5)
    assert pool.streams == ("k", "v")
    assert pool.allocate("v", 1, owner=1)[0].stream == "v"


def test_shared_pool_treats_every_stream_as_kv():
    pool = make_pool(n_blocks=4, separate_kv=False)
    k = pool.allocate("k", 4, owner=1)
    v = pool.allocate("v", 4, owner=1)
    assert {b.stream for b in k + v} == {"kv"}
    assert pool.n_free("k") == pool.n_free("v") == pool.n_free() == 2


def test_separate_lists_never_interchange_blocks():
    # k: [0 1 2 3] v: [4 5 6 7]; exhausting k leaves v untouched
    pool = make_pool(n_blocks=8)
    pool.allocate("k", 16, owner=1)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=2)
    assert ids(pool.allocate("v", 16, owner=2)) == [4, 5, 6, 7]


def test_allocate_rounds_up_and_fills_blocks_in_order():
    pool = make_pool(block_size=4)
    blocks = pool.allocate("k", 9, owner=1)
    assert [b.n_used for b in blocks] == [4, 4, 1]
    assert ids(blocks) == [0, 1, 2]
    assert all(b.ever_allocated for b in blocks)


def test_allocate_is_all_or_nothing():
    pool = make_pool(n_blocks=8, block_size=4)  # 4 K blocks
    pool.allocate("k", 8, owner=1)
    before = pool.stats
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 12, owner=2)  # needs 3, 2 free
    after = pool.stats
    assert pool.n_free("k") == 2
    assert pool.blocks_for(2) == []
    assert after.n_exhausted == before.n_exhausted + 1
    assert after.n_allocations == before.n_allocations
    assert 2 not in pool.owner_block_counts()
    pool.check_invariants()


@pytest.mark.parametrize("n_tokens", [0, -1, 1.5, "3", None, True])
def test_allocate_rejects_bad_n_tokens(n_tokens):
    pool = make_pool()
    with pytest.raises(ValueError):
        pool.allocate("k", n_tokens, owner=1)
    assert pool.stats.n_allocations == 0


@pytest.mark.parametrize("stream", ["x", "K", "", None, "kv"])
def test_allocate_rejects_bad_stream_on_separate_pool(stream):
    with pytest.raises(ValueError):
        make_pool().allocate(stream, 1, owner=1)


def test_allocate_rejects_none_owner():
    with pytest.raises(ValueError):
        make_pool().allocate("k", 1, owner=None)


def test_lifo_reuse_hands_back_the_most_recently_freed_block():
    pool = make_pool(n_blocks=8, block_size=4)
    a = pool.allocate("k", 4, owner=1)
    b = pool.allocate("k", 4, owner=2)
    pool.free_all(1)
    pool.free_all(2)
    # k free list (top last): [3 2 0 1]
    again = pool.allocate("k", 4, owner=3)
    assert again[0] is b[0]
    assert pool.allocate("k", 4, owner=4)[0] is a[0]


def test_reuse_is_counted_per_block():
    pool = make_pool(n_blocks=8, block_size=4)
    pool.allocate("k", 8, owner=1)
    pool.free_all(1)
    pool.allocate("k", 12, owner=2)  # 2 reused + 1 fresh
    stats = pool.stats
    assert stats.n_reused == 2
    assert stats.n_allocations == 2


def test_repeated_allocate_for_active_owner_grows_it():
    pool = make_pool()
    first = pool.allocate("k", 4, owner=1)
    second = pool.allocate("k", 4, owner=1)
    assert pool.blocks_for(1) == first + second
    assert pool.n_blocks_for(1) == 2


def test_register_owner_detects_collisions():
    pool = make_pool()
    pool.register_owner(1)
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)
    pool.allocate("k", 1, owner=1)  # the registered owner growing is fine
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)
    pool.free_all(1)
    pool.register_owner(1)  # released: the id may be used again


def test_register_owner_raises_for_owner_with_blocks():
    pool = make_pool()
    pool.allocate("k", 1, owner=5)
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(5)


def test_release_owner_clears_a_registration_without_blocks():
    pool = make_pool()
    pool.register_owner(1)
    pool.release_owner(1)
    pool.register_owner(1)
    pool.release_owner(99)  # unknown: ignored


def test_release_owner_never_orphans_blocks():
    pool = make_pool()
    blocks = pool.allocate("k", 4, owner=1)
    pool.release_owner(1)
    assert pool.blocks_for(1) == blocks
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)
    pool.free_all(1)
    pool.check_invariants()


def test_free_returns_blocks_and_counts_calls():
    pool = make_pool(block_size=4)
    blocks = pool.allocate("k", 12, owner=1)
    pool.free(blocks[:1])
    assert pool.blocks_for(1) == blocks[1:]
    assert blocks[0].owner is None and blocks[0].n_used == 0
    pool.free(blocks[1:])
    stats = pool.stats
    assert stats.n_frees == 2
    assert stats.blocks_in_use() == 0
    assert pool.owner_block_counts() == {}
    pool.check_invariants()


def test_free_twice_is_harmless():
    pool = make_pool()
    blocks = pool.allocate("k", 4, owner=1)
    pool.free(blocks)
    pool.free(blocks + blocks)
    assert pool.n_free("k") == 4
    pool.check_invariants()


def test_free_with_owner_skips_blocks_handed_to_someone_else():
    pool = make_pool(n_blocks=2, block_size=4)  # 1 K block
    stale = pool.allocate("k", 4, owner=1)
    pool.free_all(1)
    reused = pool.allocate("k", 4, owner=2)
    assert reused[0] is stale[0]
    pool.free(stale, owner=1)  # the holder's request is gone: nothing happens
    assert pool.blocks_for(2) == reused
    pool.free(reused, owner=2)
    assert pool.blocks_for(2) == []
    pool.check_invariants()


def test_free_rejects_foreign_blocks_before_changing_anything():
    pool, other = make_pool(), make_pool()
    mine = pool.allocate("k", 4, owner=1)
    theirs = other.allocate("k", 4, owner=1)
    with pytest.raises(ValueError):
        pool.free(mine + theirs)
    assert pool.blocks_for(1) == mine
    with pytest.raises(ValueError):
        pool.free([Block(block_id=0)])


def test_free_all_is_idempotent_and_counts_once():
    pool = make_pool(block_size=4)
    pool.allocate("k", 8, owner=1)
    pool.allocate("v", 8, owner=1)
    pool.free_all(1)
    pool.free_all(1)
    pool.free_all(12345)
    stats = pool.stats
    assert stats.n_frees == 1
    assert pool.n_free("k") == 4 and pool.n_free("v") == 4
    pool.check_invariants()


def test_free_all_leaves_other_owners_alone():
    pool = make_pool(block_size=4)
    a = pool.allocate("k", 4, owner=1)
    b = pool.allocate("k", 4, owner=2)
    pool.free_all(1)
    assert a[0].owner is None
    assert pool.blocks_for(2) == b and b[0].owner == 2


def test_blocks_for_returns_a_new_list_in_allocation_order():
    pool = make_pool(block_size=4)
    k = pool.allocate("k", 4, owner=1)
    v = pool.allocate("v", 4, owner=1)
    listed = pool.blocks_for(1)
    assert listed == k + v
    listed.clear()
    assert pool.blocks_for(1) == k + v
    assert pool.blocks_for(999) == []


def test_n_free_default_stream_is_k_and_rejects_unknown():
    pool = make_pool(n_blocks=6)
    pool.allocate("v", 1, owner=1)
    assert pool.n_free() == 3
    with pytest.raises(ValueError):
        pool.n_free("q")


def test_grow_on_exhaustion_adds_just_the_shortfall():
    pool = make_pool(n_blocks=4, block_size=4, grow=True)  # 2 K blocks
    blocks = pool.allocate("k", 20, owner=1)  # needs 5
    stats = pool.stats
    assert len(blocks) == 5
    assert (stats.n_grown, stats.n_blocks, stats.n_exhausted) == (3, 7, 0)
    assert pool.n_free("k") == 0 and pool.n_free("v") == 2
    assert len(pool.history) == 1  # growth is recorded
    pool.check_invariants()


def test_growth_capped_by_max_blocks_raises_and_grows_nothing():
    pool = make_pool(n_blocks=4, block_size=4, grow=True, max_blocks=6)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 20, owner=1)  # would need 7 blocks in all
    stats = pool.stats
    assert (stats.n_blocks, stats.n_grown, stats.n_exhausted) == (4, 0, 1)
    assert len(pool.allocate("k", 16, owner=1)) == 4  # 2 + 2 grown = cap 6
    assert pool.stats.n_blocks == 6


def test_max_blocks_is_ignored_without_growth():
    pool = make_pool(n_blocks=4, max_blocks=100)
    pool.allocate("k", 8, owner=1)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=1)


def test_grown_ids_never_collide_with_retired_ones():
    pool = make_pool(n_blocks=4, block_size=4, grow=True)
    assert pool.shrink("k", 0) == 2
    blocks = pool.allocate("k", 4, owner=1)
    assert ids(blocks) == [4]


def test_shrink_retires_only_free_blocks():
    pool = make_pool(n_blocks=8, block_size=4)
    held = pool.allocate("k", 8, owner=1)  # 2 of 4 K blocks
    assert pool.shrink("k", 0) == 2
    assert pool.n_free("k") == 0
    assert pool.blocks_for(1) == held
    stats = pool.stats
    assert (stats.n_blocks, stats.n_retired) == (6, 2)
    assert pool.n_total("k") == 2 and pool.n_total("v") == 4
    pool.free_all(1)
    assert pool.n_free("k") == 2
    pool.check_invariants()


def test_shrink_to_a_larger_target_is_a_noop():
    pool = make_pool(n_blocks=8)
    assert pool.shrink("v", 10) == 0
    assert pool.shrink("v", 4) == 0
    assert pool.stats.n_retired == 0
    assert len(pool.history) == 0


@pytest.mark.parametrize("target", [-1, 1.5, None])
def test_shrink_rejects_bad_target(target):
    with pytest.raises(ValueError):
        make_pool().shrink("k", target)


def test_shrink_on_shared_pool_uses_kv():
    pool = make_pool(n_blocks=8, separate_kv=False)
    assert pool.shrink("v", 3) == 5
    assert pool.n_free("k") == 3


def test_retired_blocks_cannot_be_freed_or_marked():
    pool = make_pool(n_blocks=8)
    block = pool.allocate("k", 1, owner=1)[0]
    pool.free_all(1)
    pool.shrink("k", 0)
    with pytest.raises(ValueError):
        pool.mark_used(block, 1)
    with pytest.raises(ValueError):
        pool.free([block])


def test_mark_used_keeps_fragmentation_consistent():
    pool = make_pool(n_blocks=8, block_size=4)
    (block,) = pool.allocate("k", 4, owner=1)  # full: not fragmented
    assert pool.stats.fragmentation() == 0.0
    pool.mark_used(block, 2)
    assert pool.stats.fragmentation() == 1 / 8
    pool.mark_used(block, 3)
    assert pool.stats.fragmentation() == 1 / 8
    pool.mark_used(block, 4)
    assert pool.stats.fragmentation() == 0.0
    pool.mark_used(block, 0)  # allocated but empty: not counted (n_used > 0 is required)
    assert pool.stats.fragmentation() == 0.0
    pool.check_invariants()


def test_mark_used_on_free_block_updates_n_used_only():
    pool = make_pool(block_size=4)
    (block,) = pool.allocate("k", 2, owner=1)
    pool.free([block])
    pool.mark_used(block, 3)
    assert block.n_used == 3
    assert pool.stats.fragmentation() == 0.0


@pytest.mark.parametrize("n_used", [-1, 5, 1.0])
def test_mark_used_rejects_out_of_range(n_used):
    pool = make_pool(block_size=4)
    (block,) = pool.allocate("k", 2, owner=1)
    with pytest.raises(ValueError):
        pool.mark_used(block, n_used)
    assert block.n_used == 2


def test_peak_blocks_in_use_is_a_high_water_mark():
    pool = make_pool(n_blocks=8, block_size=4)
    pool.allocate("k", 12, owner=1)
    pool.free_all(1)
    pool.allocate("k", 4, owner=2)
    assert pool.stats.peak_blocks_in_use == 3


def test_history_is_a_bounded_deque_of_independent_snapshots():
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=4), history_size=3)
    assert isinstance(pool.history, deque) and pool.history.maxlen == 3
    assert BlockPoolAllocator().history.maxlen == DEFAULT_HISTORY_SIZE
    for _ in range(5):
        pool.record_history()
    assert len(pool.history) == 3
    pool.allocate("k", 4, owner=1)
    snap = pool.history[-1]
    assert snap.blocks_in_use() == 0  # taken before the allocation, not a live view
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 8, owner=2)
    assert pool.history[-1].n_exhausted == 1
    assert all(isinstance(s, AllocationStats) for s in pool.history)


def test_stats_property_is_a_snapshot():
    pool = make_pool()
    before = pool.stats
    pool.allocate("k", 1, owner=1)
    assert before.n_allocations == 0 and pool.stats.n_allocations == 1


def test_owner_block_counts_is_a_frozen_copy():
    pool = make_pool(block_size=4)
    pool.allocate("k", 8, owner="a")
    pool.register_owner("b")
    counts = pool.owner_block_counts()
    assert counts == {"a": 2, "b": 0}
    counts["a"] = 99
    assert pool.owner_block_counts()["a"] == 2


def test_empty_pool_raises_on_allocate_and_reports_zero_fragmentation():
    pool = make_pool(n_blocks=0)
    assert pool.stats.fragmentation() == 0.0
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=1)


def test_config_must_be_a_pool_config():
    with pytest.raises(ValueError):
        BlockPoolAllocator({"n_blocks": 4})  # type: ignore[arg-type]


def test_transfer_hands_blocks_over_in_place(make_pool):
    pool = make_pool(block_size=4, n_blocks=16, separate_kv=False)
    mine = pool.allocate("kv", 12, owner=1)  # 3 blocks
    other = pool.allocate("kv", 4, owner=2)
    assert pool.transfer(mine[:2] + other, owner=1, new_owner=-1) == 2  # another's is skipped
    assert [b.owner for b in mine] == [-1, -1, 1] and other[0].owner == 2
    assert pool.owner_block_counts() == {1: 1, 2: 1, -1: 2}
    assert pool.stats.blocks_in_use() == 4 and pool.stats.n_frees == 0
    pool.check_invariants()
    assert pool.transfer(mine[2:], owner=1, new_owner=-1) == 1
    assert 1 not in pool.owner_block_counts()  # its last block went: no longer active
    pool.free_all(2)
    pool.free(mine, owner=-1)
