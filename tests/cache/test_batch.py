"""Pool-accounted batching: mlx_lm's BatchGenerator over pool-backed caches, rows joining and
leaving, the deepcopy-then-filter split, and honest padding."""

import copy
import math

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from tests.support.models import tiny_model
from veloxquant_mlx.cache.pool_backed_batch import PoolBackedBatchKVCache
from veloxquant_mlx.memory import PoolBackedKVCache, build_pooled_caches

H, D = 2, 8
PROMPTS = [[1, 5, 9, 3, 7], [2, 8], [11, 4, 6, 10, 12, 13, 14, 15, 16, 17], [3, 3, 3], [9] * 20]
MAX_TOKENS = [40, 300, 20, 280, 60]


def kv(n: int, seed: int, batch: int = 1):
    mx.random.seed(seed)
    return mx.random.normal((batch, H, n, D)), mx.random.normal((batch, H, n, D))


def run_batch_generator(model, pool=None, on_step=None):
    """Two requests start, three join at step 10; rows leave as they finish."""
    gen = BatchGenerator(model, prefill_batch_size=2, completion_batch_size=4)
    out: dict[int, list[int]] = {}
    index_of: dict[int, int] = {}

    def insert(idx):
        caches = [build_pooled_caches(model, pool, owner=100 + i) for i in idx] if pool else None
        uids = gen.insert([PROMPTS[i] for i in idx], [MAX_TOKENS[i] for i in idx], caches=caches)
        for uid, i in zip(uids, idx, strict=True):
            index_of[uid] = i
            out[i] = []

    insert([0, 1])
    step = 0
    while True:
        responses = gen.next_generated()
        step += 1
        if step == 10:
            insert([2, 3, 4])
        elif not responses and step > 10:
            break
        for r in responses:
            out[index_of[r.uid]].append(r.token)
            if r.finish_reason is not None and pool is not None:
                pool.free_all(100 + index_of[r.uid])  # what the engine does in its finally
        if on_step is not None:
            on_step(step)
    gen.close()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama_sliding"])
def test_batch_generator_tokens_match_stock_with_rows_joining_and_leaving(arch, make_pool):
    model = tiny_model(arch)
    pool = make_pool(block_size=16, n_blocks=8192)
    seen_owners: set[int] = set()

    def check(step):
        pool.check_invariants()
        seen_owners.update(pool.owner_block_counts())

    stock = run_batch_generator(model)
    pooled = run_batch_generator(model, pool, on_step=check)
    assert pooled == stock
    assert [len(stock[i]) for i in range(5)] == MAX_TOKENS
    assert seen_owners == {100, 101, 102, 103, 104}


def test_a_filtered_out_row_frees_its_blocks_while_others_run(make_pool):
    model = tiny_model("llama")
    pool = make_pool(block_size=16, n_blocks=8192)
    holding: list[set[int]] = []

    def check(step):
        holding.append({o for o, n in pool.owner_block_counts().items() if n})

    # engine-style free_all is skipped here to see filter() do the work
    gen = BatchGenerator(model, prefill_batch_size=2, completion_batch_size=2)
    caches = [build_pooled_caches(model, pool, owner=o) for o in (1, 2)]
    uids = gen.insert([[1, 2, 3], [4, 5, 6]], [5, 100], caches=caches)
    finished_at = None
    step = 0
    while responses := gen.next_generated():
        step += 1
        check(step)
        for r in responses:
            if r.uid == uids[0] and r.finish_reason:
                finished_at = step
    gen.close()
    assert finished_at is not None
    assert 1 not in holding[finished_at]  # row 1 left the batch: its blocks went back
    assert 2 in holding[finished_at]
    pool.free_all(2)  # the last row's batch is cleared, not filtered: its owner frees it


def test_deepcopy_then_filter_leaves_each_row_with_one_owner_of_its_blocks(make_pool):
    pool = make_pool(block_size=16, n_blocks=1024)
    singles = [PoolBackedKVCache(pool, owner=o) for o in (1, 2, 3)]
    for i, c in enumerate(singles):
        c.update_and_fetch(*kv(10 + 10 * i, i))
    batch = PoolBackedKVCache.merge(singles)
    held = {o: pool.n_blocks_for(o) for o in (1, 2, 3)}
    assert held == {1: 4, 2: 4, 3: 4}  # 30 slots per row (padding included) -> 2 blocks x K,V

    # what PromptProcessingBatch.split does
    moved = copy.deepcopy(batch)
    assert moved.pool is batch.pool
    batch.filter([0, 2])
    moved.filter([1])
    assert {o: pool.n_blocks_for(o) for o in (1, 2, 3)} == held  # nothing freed, nothing copied
    assert batch.owners == [1, 3] and moved.owners == [2]
    mx.eval(batch.keys, moved.keys)
    assert batch.keys.shape[0] == 2 and moved.keys.shape[0] == 1

    moved.filter([])  # row 2 leaves its last holder: freed
    assert pool.n_blocks_for(2) == 0
    batch.release()
    assert pool.n_blocks_for(1) == pool.n_blocks_for(3) == 0


def test_left_shift_on_filter_frees_the_columns_it_drops(make_pool):
    pool = make_pool(block_size=16, n_blocks=1024)
    singles = [PoolBackedKVCache(pool, owner=o) for o in (1, 2)]
    singles[0].update_and_fetch(*kv(40, 0))
    singles[1].update_and_fetch(*kv(4, 1))
    batch = PoolBackedKVCache.merge(singles)  # 40 slots: row 2 has 36 of left padding
    assert pool.n_blocks_for(2) == 2 * math.ceil(40 / 16)
    batch.filter([1])  # only the short row stays; the padding shifts out
    assert batch.keys.shape[2] == 4
    assert pool.n_blocks_for(2) == 2 and pool.n_blocks_for(1) == 0
    batch.release()


def test_extend_moves_rows_and_repads(make_pool):
    pool = make_pool(block_size=16, n_blocks=1024)
    a = [PoolBackedKVCache(pool, owner=1)]
    b = [PoolBackedKVCache(pool, owner=2)]
    a[0].update_and_fetch(*kv(50, 0))
    b[0].update_and_fetch(*kv(3, 1))
    batch_a, batch_b = PoolBackedKVCache.merge(a), PoolBackedKVCache.merge(b)
    batch_a.extend(batch_b)
    assert batch_a.owners == [1, 2] and batch_b.owners == []
    width = batch_a.keys.shape[2]
    assert pool.n_blocks_for(2) == 2 * math.ceil(width / 16)  # the short row pays for padding
    batch_a.release()
    assert pool.n_blocks_for(1) == pool.n_blocks_for(2) == 0


def test_batch_growth_charges_every_row(make_pool):
    pool = make_pool(block_size=16, n_blocks=4096)
    singles = [PoolBackedKVCache(pool, owner=o) for o in range(4)]
    batch = PoolBackedKVCache.merge(singles)  # all empty: the engine's normal start
    assert isinstance(batch, PoolBackedBatchKVCache) and batch.keys is None
    batch.update_and_fetch(*kv(3, 0, batch=4))
    assert batch.keys.shape[2] == 256
    assert [pool.n_blocks_for(o) for o in range(4)] == [2 * 16] * 4
    assert batch.n_blocks_held() == 4 * 2 * 16
    batch.release()
    batch.release()


def test_merge_rejects_foreign_caches(make_pool):
    from mlx_lm.models.cache import KVCache

    pool = make_pool(block_size=16, n_blocks=64)
    with pytest.raises(ValueError):
        PoolBackedBatchKVCache.merge([PoolBackedKVCache(pool, owner=1), KVCache()])
    with pytest.raises(ValueError):
        PoolBackedBatchKVCache.merge([])
