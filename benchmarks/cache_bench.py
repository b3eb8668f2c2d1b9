"""Decode throughput with build_pooled_caches against stock mlx_lm caches, in one process.

    python -m benchmarks.cache_bench [--runs N] [--models tiny,medium] [--quick]

Single sequence: prefill once, then each run restores that prefilled state into fresh caches
(stock KVCache or pool-backed) and times 128 decode steps; runs alternate stock/pooled and the
figure is the median. Batched: mlx_lm's BatchGenerator decoding 8 and 32 rows (32-token prompts,
64 new tokens each) with stock caches (BatchKVCache) or pool-backed ones
(PoolBackedBatchKVCache), generation tokens/s, alternating.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.models import build, n_params
from veloxquant_mlx.blas import blas_in_use, ensure_blas
from veloxquant_mlx.cache.pool_backed import build_pooled_caches
from veloxquant_mlx.pool import BlockPoolAllocator, PoolConfig

NEW_TOKENS = 128
BATCH_NEW_TOKENS = 64  # batched runs are many rows: fewer steps keep `make bench` under 10 min
BATCH_PROMPT = 32


def _prefilled_state(model: Any, prompt: list[int]) -> list[tuple[mx.array, mx.array, int]]:
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return [(c.keys, c.values, c.offset) for c in cache]


def _decode_tps(model: Any, last_token: int, caches: list[Any], state: list[Any]) -> float:
    for c, (k, v, offset) in zip(caches, state, strict=True):
        c.state = (mx.array(k), mx.array(v), offset)  # fresh copies: decode writes in place
    gen = generate_step(mx.array([last_token]), model, prompt_cache=caches, max_tokens=NEW_TOKENS)
    next(gen)  # the prompt's last token: not decode
    t0 = time.perf_counter()
    n = sum(1 for _ in gen)
    return n / (time.perf_counter() - t0)


def single(model: Any, prompt_len: int, runs: int) -> tuple[float, float]:
    prompt = [(7 * i) % 1000 + 3 for i in range(prompt_len)]
    state = _prefilled_state(model, prompt)
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1 << 16))

    def pooled(run: int) -> float:
        tps = _decode_tps(model, prompt[-1], build_pooled_caches(model, pool, owner=run), state)
        pool.free_all(run)
        return tps

    result = _alternate(
        runs, lambda _: _decode_tps(model, prompt[-1], make_prompt_cache(model), state), pooled
    )
    assert pool.stats.blocks_in_use() == 0
    return result


def _alternate(
    runs: int, stock: Callable[[int], float], pooled: Callable[[int], float]
) -> tuple[float, float]:
    """Median tokens/s of ``stock`` and ``pooled`` run in turn; run 0 warms up and is dropped."""
    stock_tps, pooled_tps = [], []
    for run in range(runs + 1):
        s, p = stock(run), pooled(run)
        if run:
            stock_tps.append(s)
            pooled_tps.append(p)
    return statistics.median(stock_tps), statistics.median(pooled_tps)


def _batch_tps(model: Any, rows: int, make_caches: Callable[[int], Any] | None) -> float:
    gen = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows)
    prompts = [[(13 * i + r) % 1000 + 3 for i in range(BATCH_PROMPT)] for r in range(rows)]
    caches = [make_caches(r) for r in range(rows)] if make_caches else None
    gen.insert(prompts, [BATCH_NEW_TOKENS] * rows, caches=caches)
    with gen.stats() as stats:
        while gen.next_generated():
            pass
    gen.close()
    return stats.generation_tps


def batched(model: Any, rows: int, runs: int) -> tuple[float, float]:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1 << 16))

    def pooled(_: int) -> float:
        tps = _batch_tps(model, rows, lambda r: build_pooled_caches(model, pool, owner=r))
        for r in range(rows):
            pool.free_all(r)
        return tps

    result = _alternate(runs, lambda _: _batch_tps(model, rows, None), pooled)
    assert pool.stats.blocks_in_use() == 0
    return result


def main() -> None:
    ensure_blas(os.environ.get("VQ_BLAS", "auto"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 runs")
    args = parser.parse_args()
    names = ["tiny"] if args.quick else args.models.split(",")
    runs = 3 if args.quick else args.runs
    print(
        f"cache_bench: {platform.machine()} {platform.system()}, MLX {mx.__version__}, "
        f"device {mx.default_device()}, BLAS {blas_in_use()}; median of {runs} alternating runs"
    )
    print("| model | scenario | stock tok/s | pooled tok/s | ratio |")
    print("|---|---|---:|---:|---:|")
    for name in names:
        model = build(name)
        label = f"{name} ({n_params(model) / 1e6:.1f}M)"
        for prompt_len in (128, 512):
            s, p = single(model, prompt_len, runs)
            print(f"| {label} | decode, prompt {prompt_len} | {s:.1f} | {p:.1f} | {p / s:.3f} |")
        if name == "tiny":
            for rows in (8, 32):
                s, p = batched(model, rows, runs)
                print(
                    f"| {label} | batched decode, {rows} rows | {s:.1f} | {p:.1f} | {p / s:.3f} |"
                )


if __name__ == "__main__":
    main()
