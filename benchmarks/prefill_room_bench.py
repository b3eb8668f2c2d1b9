"""A prompt's prefill caches with room for the whole prompt, against stock mlx_lm caches.

    python -m benchmarks.prefill_room_bench [--repeats 5]

What the prefill's caches cost besides the forwards, per layer's K and V of a model's geometry:
a cached turn (its cached KV in 5 runs of pages, then 64 new tokens in one chunk) and a long
uncached prompt (8,000 tokens in chunks of 512). Stock: the pages joined into an exact-size
cache, which ``KVCache.update_and_fetch`` copies whole when a chunk does not fit (every 256
tokens it grows); ours (``kv.room``, as the engine's prefill uses it): the pages and the room
for the rest of the prompt joined in one copy, and a long prompt's cache given room for it all
after its first chunk. Milliseconds (medians) and MLX's peak memory above what the inputs hold.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.kv.room import joined, make_room

# (name, layers, KV heads, head dim, dtype)
GEOMETRIES = [("100m", 12, 4, 64, mx.float32), ("1b", 16, 8, 64, mx.bfloat16)]
RUNS = 5  # runs of pages a cached context comes in


def _pieces(layers: int, heads: int, dim: int, dtype: Any, n: int) -> list[list[mx.array]]:
    sizes = [n // RUNS] * (RUNS - 1) + [n - (RUNS - 1) * (n // RUNS)]
    out = [[mx.random.normal((1, heads, s, dim)).astype(dtype) for s in sizes]
           for _ in range(2 * layers)]  # fmt: skip
    mx.eval(out)
    return out


def _chunks(caches: list[KVCache], chunks: list[mx.array]) -> None:
    for new in chunks:
        mx.eval([c.update_and_fetch(new, new) for c in caches])


def cached_turn(pieces: list[list[mx.array]], new: mx.array, room: bool) -> None:
    caches = [KVCache() for _ in range(len(pieces) // 2)]
    n = sum(p.shape[2] for p in pieces[0])
    for i, c in enumerate(caches):
        if room:
            c.keys, c.values = (
                joined(pieces[2 * i], new.shape[2]),
                joined(pieces[2 * i + 1], new.shape[2]),
            )
        else:
            c.keys, c.values = (mx.concatenate(pieces[2 * i + j], axis=2) for j in (0, 1))
        c.offset = n
    _chunks(caches, [new])


def long_prompt(layers: int, chunks: list[mx.array], room: bool) -> None:
    caches = [KVCache() for _ in range(layers)]
    _chunks(caches, chunks[:1])
    if room:
        make_room(caches, sum(c.shape[2] for c in chunks))
        mx.eval([(c.keys, c.values) for c in caches])
    _chunks(caches, chunks[1:])


def measure(run: Any, repeats: int) -> tuple[float, float]:
    times, peaks = [], []
    for _ in range(repeats):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
        peaks.append((mx.get_peak_memory() - base) / 2**20)
    return statistics.median(times), statistics.median(peaks)


def _cases(a: Any, layers: int, heads: int, dim: int, dtype: Any) -> list[tuple[str, Any]]:
    """(label, case(room)) for one geometry: each cached turn, then the long prompt."""
    out: list[tuple[str, Any]] = []
    for n in (int(x) for x in a.cached.split(",")):
        pieces = _pieces(layers, heads, dim, dtype, n)
        new = mx.zeros((1, heads, 64, dim), dtype=dtype)
        out.append((f"cached turn, {n:,} + 64 tokens",
                    functools.partial(cached_turn, pieces, new)))  # fmt: skip
    chunks = [mx.zeros((1, heads, min(512, a.prompt - s), dim), dtype=dtype)
              for s in range(0, a.prompt, 512)]  # fmt: skip
    out.append((f"{a.prompt:,}-token prompt in 512-token chunks",
                functools.partial(long_prompt, layers, chunks)))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cached", default="1700,8000", help="cached turns' contexts, tokens")
    p.add_argument("--prompt", type=int, default=8000, help="the long prompt's tokens")
    a = p.parse_args()
    print("| geometry | case | stock ms | ours ms | ours / stock | stock peak MiB "
          "| ours peak MiB |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, layers, heads, dim, dtype in GEOMETRIES:
        for label, case in _cases(a, layers, heads, dim, dtype):
            stock, stock_peak = measure(functools.partial(case, False), a.repeats)
            ours, ours_peak = measure(functools.partial(case, True), a.repeats)
            print(f"| {name} | {label} | {stock:.1f} | {ours:.1f} | {ours / stock:.2f}x | "
                  f"{stock_peak:,.0f} | {ours_peak:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
