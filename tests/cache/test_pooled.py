"""PooledKVCache: block checkout in lock-step with appends, at block granularity."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
    PooledKVCache,
)


def test_seed_example_runs_verbatim():
    request_id = 7
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=512))
    inner = KVCacheBuilder().with_method("kivi").with_head_dim(128).build()
    cache = PooledKVCache(inner, pool, owner=request_id, format="int2")
    mx.random.seed(0)
    for _ in range(300):
        cache.append_key(mx.random.normal((128,)).astype(mx.float16))
        cache.append_value(mx.random.normal((128,)).astype(mx.float16))
    assert cache.attend(mx.random.normal((128,)).astype(mx.float16)).shape == (128,)
    assert cache.n_blocks_held() == 2 * 19  # ceil(300 / 16) per stream
    assert {b.format for b in pool.blocks_for(request_id)} == {"int2"}
    assert cache.memory_bytes() < 0.6 * 300 * 128 * 2 * 2  # compressed, fp16 window included
    cache.release()  # return blocks to the pool for reuse by the next request
    assert pool.stats.blocks_in_use() == 0 and pool.owner_block_counts() == {}


def test_one_pool_call_per_block_not_per_token(make_pool):
    pool = make_pool(block_size=16, n_blocks=64)
    cache = PooledKVCache(KVCacheBuilder().with_head_dim(64).build(), pool, owner=1)
    for _ in range(64):
        cache.append_key(mx.ones((64,)))
    stats = pool.stats
    assert stats.n_allocations == 4  # one per block, none per token
    assert cache.n_blocks_held() == 4
    cache.release()


def test_fragmentation_is_exact_at_every_step(make_pool):
    pool = make_pool(block_size=4, n_blocks=16)  # 8 K blocks
    cache = PooledKVCache(KVCacheBuilder().with_head_dim(32).build(), pool, owner=1)
    for n in range(1, 14):
        cache.append_key(mx.ones((32,)))
        partial = 1 if n % 4 else 0
        assert pool.stats.fragmentation() == partial / 16, n
        pool.check_invariants()
    cache.append_key(mx.ones((7, 32)))  # 13 -> 20 tokens: one bulk append fills and adds
    assert cache.n_blocks_held() == 5 and pool.stats.fragmentation() == 0.0
    cache.release()


def test_exhaustion_appends_nothing(make_pool):
    pool = make_pool(block_size=4, n_blocks=2)  # one K block
    cache = PooledKVCache(KVCacheBuilder().with_head_dim(32).build(), pool, owner=1)
    cache.append_key(mx.ones((4, 32)))
    with pytest.raises(BlockPoolExhaustedError):
        cache.append_key(mx.ones((32,)))
    assert cache.n_keys() == 4
    cache.release()


def test_reset_clears_blocks_and_length(make_pool):
    pool = make_pool(block_size=16, n_blocks=64)
    cache = PooledKVCache(
        KVCacheBuilder().with_method("int8").with_head_dim(64).build(), pool, owner=3
    )
    cache.append(mx.ones((20, 64)), mx.ones((20, 64)))
    assert len(cache) == 20 and cache.n_blocks_held() == 4
    cache.reset()
    assert len(cache) == 0 and cache.n_blocks_held() == 0 and cache.memory_bytes() == 0
    cache.append(mx.ones((1, 64)), mx.ones((1, 64)))  # usable again
    assert cache.n_blocks_held() == 2
    cache.release()
    cache.release()


def test_inner_must_be_a_veloxquant_cache(make_pool):
    with pytest.raises(ValueError):
        PooledKVCache(object(), make_pool(), owner=1)
