"""Many threads on one pool: the totals add up and the invariants hold at the end."""

import random
import threading

from veloxquant_mlx.pool import BlockPoolAllocator, BlockPoolExhaustedError, PoolConfig

N_THREADS = 8
N_OPS = 3000


def test_concurrent_allocate_free_shrink_and_reads_keep_the_pool_consistent():
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=400))
    errors: list[BaseException] = []
    counts = {"allocations": 0, "exhausted": 0, "retired": 0}
    counts_lock = threading.Lock()
    start = threading.Barrier(N_THREADS)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        owners = [seed * 1000 + i for i in range(4)]  # each thread owns its ids
        local = {"allocations": 0, "exhausted": 0, "retired": 0}
        try:
            start.wait()
            for _ in range(N_OPS):
                op = rng.random()
                owner = rng.choice(owners)
                if op < 0.5:
                    try:
                        pool.allocate(rng.choice("kv"), rng.randint(1, 24), owner=owner)
                        local["allocations"] += 1
                    except BlockPoolExhaustedError:
                        local["exhausted"] += 1
                elif op < 0.65:
                    blocks = pool.blocks_for(owner)
                    pool.free(blocks[: len(blocks) // 2])
                elif op < 0.85:
                    pool.free_all(owner)
                elif op < 0.88:
                    local["retired"] += pool.shrink(rng.choice("kv"), rng.randint(60, 200))
                else:
                    stats = pool.stats
                    assert 0 <= stats.blocks_in_use() <= stats.n_blocks
                    assert 0.0 <= stats.fragmentation() <= 1.0
                    pool.owner_block_counts()
            for owner in owners:
                pool.free_all(owner)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        with counts_lock:
            for key, value in local.items():
                counts[key] += value

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    pool.check_invariants()
    stats = pool.stats
    assert stats.n_allocations == counts["allocations"]
    assert stats.n_exhausted == counts["exhausted"]
    assert stats.n_retired == counts["retired"]
    assert stats.n_blocks == 400 - counts["retired"]
    assert stats.blocks_in_use() == 0
    assert pool.n_free("k") + pool.n_free("v") == stats.n_blocks
    assert pool.owner_block_counts() == {}
