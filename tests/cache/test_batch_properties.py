"""Random sequences of batch-cache operations: accounting never drifts from the buffers."""

from __future__ import annotations

import copy
import math

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veloxquant_mlx.cache.pool_backed_batch import PoolBackedBatchKVCache
from veloxquant_mlx.memory import BlockPoolAllocator, PoolBackedKVCache, PoolConfig

H, D, BS, STEP = 2, 4, 4, 8

ops = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 9)),
        st.tuples(st.just("filter"), st.integers(0, 2**16)),
        st.tuples(st.just("extend"), st.lists(st.integers(0, 12), min_size=1, max_size=3)),
        st.tuples(st.just("split"), st.integers(0, 2**16)),
    ),
    max_size=12,
)


def kv(rows: int, n: int):
    return mx.ones((rows, H, n, D)), mx.ones((rows, H, n, D))


def merged(pool, owners, lengths):
    singles = []
    for owner, n in zip(owners, lengths, strict=True):
        c = PoolBackedKVCache(pool, owner=owner, step=STEP)
        if n:
            c.update_and_fetch(*kv(1, n))
        singles.append(c)
    batch = PoolBackedKVCache.merge(singles)
    batch.step = STEP
    return batch


def check(pool: BlockPoolAllocator, batches: list[PoolBackedBatchKVCache], dropped: set[int]):
    pool.check_invariants()
    live: dict[int, int] = {}
    for b in batches:
        cap = 0 if b.keys is None else b.keys.shape[2]
        for owner in b.owners:
            live[owner] = 2 * math.ceil(cap / BS)
    for owner, expected in live.items():
        assert pool.n_blocks_for(owner) == expected, (owner, expected)
    for owner in dropped - set(live):
        assert pool.n_blocks_for(owner) == 0, owner


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.integers(0, 12), min_size=1, max_size=4), script=ops)
def test_accounting_follows_every_batch_operation(first, script):
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=100_000))
    next_owner = len(first)
    batches = [merged(pool, list(range(len(first))), first)]
    dropped: set[int] = set()
    check(pool, batches, dropped)
    for op, arg in script:
        b = batches[0]
        rows = len(b.owners)
        if op == "step" and rows:
            b.update_and_fetch(*kv(rows, arg))
        elif op == "filter" and rows:
            keep = [i for i in range(rows) if (arg >> i) & 1]
            dropped |= {o for i, o in enumerate(b.owners) if i not in keep}
            b.filter(keep)
        elif op == "extend":
            owners = list(range(next_owner, next_owner + len(arg)))
            next_owner += len(arg)
            b.extend(merged(pool, owners, arg))
        elif op == "split" and rows > 1:
            moved = [i for i in range(rows) if (arg >> i) & 1]
            stay = [i for i in range(rows) if i not in moved]
            if moved and stay:
                other = copy.deepcopy(b)  # what PromptProcessingBatch.split does
                b.filter(stay)
                other.filter(moved)
                batches.append(other)
        check(pool, batches, dropped)
    for b in batches:
        b.release()
    assert pool.stats.blocks_in_use() == 0 and pool.owner_block_counts() == {}
