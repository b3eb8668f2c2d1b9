"""ns per block for the full BlockPoolAllocator against the minimal reference, in one process.

    python -m benchmarks.pool_bench [--rounds N] [--json PATH]

Scenarios: allocate+free_all of 1, 16 and 256 blocks (one request's life), and one-block growth
(PooledKVCache-style: a request grows by one block 64 times, then frees all). The two allocators
alternate round by round; each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

from benchmarks.reference_pool import ReferencePool
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

BLOCK_SIZE = 16
POOL_BLOCKS = 8192


def _alloc_free(pool, n_blocks: int, reps: int) -> Callable[[], float]:
    n_tokens = n_blocks * BLOCK_SIZE

    def run() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            pool.allocate("k", n_tokens, owner=1)
            pool.free_all(1)
        return (time.perf_counter_ns() - t0) / (reps * n_blocks)

    return run


def _growth(pool, steps: int, reps: int) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            for _ in range(steps):
                pool.allocate("k", BLOCK_SIZE, owner=1)
            pool.free_all(1)
        return (time.perf_counter_ns() - t0) / (reps * steps)

    return run


SCENARIOS: dict[str, Callable[[object], Callable[[], float]]] = {
    "allocate+free_all 1 block": lambda p: _alloc_free(p, 1, 20_000),
    "allocate+free_all 16 blocks": lambda p: _alloc_free(p, 16, 4_000),
    "allocate+free_all 256 blocks": lambda p: _alloc_free(p, 256, 300),
    "one-block growth x64": lambda p: _growth(p, 64, 400),
}


def run(rounds: int) -> list[dict[str, float | str]]:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS))
    ref = ReferencePool(BLOCK_SIZE, POOL_BLOCKS)
    results = []
    for name, make in SCENARIOS.items():
        ours, theirs = make(pool), make(ref)
        ours(), theirs()  # warm up
        t_ours, t_ref = [], []
        gc.disable()
        try:
            for _ in range(rounds):
                t_ours.append(ours())
                t_ref.append(theirs())
        finally:
            gc.enable()
        m_ours, m_ref = statistics.median(t_ours), statistics.median(t_ref)
        results.append(
            {"scenario": name, "pool_ns": m_ours, "reference_ns": m_ref, "ratio": m_ours / m_ref}
        )
    pool.check_invariants()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results = run(args.rounds)
    print(
        f"pool_bench: Python {sys.version.split()[0]}, {platform.machine()}, "
        f"{platform.processor() or platform.system()}; median of {args.rounds} alternating rounds"
    )
    print("| scenario | pool ns/block | reference ns/block | ratio |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['scenario']} | {r['pool_ns']:.0f} | {r['reference_ns']:.0f} | "
            f"{r['ratio']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
