"""free_all and shrink cost grows linearly with the blocks they touch (ratio, not seconds)."""

import time

from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig


def _best_of(fn, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        best = min(best, fn())
    return best


def _free_all_time(n_blocks: int) -> float:
    pool = BlockPoolAllocator(PoolConfig(block_size=1, n_blocks=2 * n_blocks))
    pool.allocate("k", n_blocks, owner=1)
    t0 = time.perf_counter()
    pool.free_all(1)
    return time.perf_counter() - t0


def _shrink_time(n_blocks: int) -> float:
    pool = BlockPoolAllocator(PoolConfig(block_size=1, n_blocks=2 * n_blocks))
    t0 = time.perf_counter()
    pool.shrink("k", 0)
    return time.perf_counter() - t0


def _one_block_free_all_in_big_pool(n_pool: int) -> float:
    pool = BlockPoolAllocator(PoolConfig(block_size=1, n_blocks=n_pool))
    for owner in range(200):
        pool.allocate("k", 10, owner=owner)
    t0 = time.perf_counter()
    for _ in range(200):
        pool.allocate("k", 1, owner=-1)
        pool.free_all(-1)
    return time.perf_counter() - t0


def test_free_all_is_linear_in_blocks_freed():
    small, large = _best_of(lambda: _free_all_time(4_000)), _best_of(lambda: _free_all_time(64_000))
    # 16x the blocks: linear gives ~16x, quadratic ~256x
    assert large / small < 48


def test_shrink_is_linear_in_blocks_retired():
    small, large = _best_of(lambda: _shrink_time(4_000)), _best_of(lambda: _shrink_time(64_000))
    assert large / small < 48


def test_allocate_and_free_all_do_not_scan_the_pool():
    small = _best_of(lambda: _one_block_free_all_in_big_pool(20_000), 5)
    large = _best_of(lambda: _one_block_free_all_in_big_pool(320_000), 5)
    # 16x the pool: O(1) per call stays near 1x; a scan would be ~16x
    assert large / small < 4
