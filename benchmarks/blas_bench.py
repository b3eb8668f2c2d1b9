"""Prefill and decode tokens/s with MLX on its bundled BLAS against an optimized one (Linux).

    python -m benchmarks.blas_bench [--pairs N] [--models tiny,medium]

Each measurement is a child process, so the BLAS is fixed at its start: one with nothing
preloaded (the wheel's reference BLAS), one with the library ``--blas auto`` picks. The two
alternate, pair by pair; figures are medians. Prefill: a 512-token prompt in one forward pass.
Decode: 128 greedy steps after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.child import run_child
from veloxquant_mlx import blas

PROMPT, NEW_TOKENS = 512, 128


def child(name: str) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.models import build

    model = build(name)
    prompt = mx.array([(7 * i) % 1000 + 3 for i in range(PROMPT)])
    model(prompt[None, :16], cache=make_prompt_cache(model))  # warm up
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    mx.eval(model(prompt[None, :-1], cache=cache))
    prefill = (PROMPT - 1) / (time.perf_counter() - t0)
    gen = generate_step(prompt[-1:], model, prompt_cache=cache, max_tokens=NEW_TOKENS)
    next(gen)
    t0 = time.perf_counter()
    n = sum(1 for _ in gen)
    decode = n / (time.perf_counter() - t0)
    print(json.dumps({"prefill": prefill, "decode": decode, "blas": blas.blas_in_use()}))


def child_matmul() -> None:
    import mlx.core as mx

    rows = {}
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        a = mx.random.normal((512, 768)).astype(dtype)
        b = mx.random.normal((768, 2048)).astype(dtype)
        mx.eval(a, b, a @ b)
        t0 = time.perf_counter()
        for _ in range(3):
            mx.eval(a @ b)
        rows[str(dtype).rsplit(".", 1)[-1]] = (time.perf_counter() - t0) / 3 * 1000
    print(json.dumps(rows))


def measure(name: str, preload: str | None) -> dict:
    return run_child("benchmarks.blas_bench", ["--child", name], preload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "matmul":
        child_matmul()
        return
    if args.child:
        child(args.child)
        return
    chosen = blas.select("auto")
    if chosen is None:
        print("blas_bench: no optimized BLAS found; nothing to compare")
        return
    print(f"blas_bench: bundled vs {chosen}; median of {args.pairs} alternating process pairs")
    print("| model | phase | bundled | optimized | speed-up |")
    print("|---|---|---:|---:|---:|")
    bundled, optimized = measure("matmul", None), measure("matmul", chosen)
    for dtype, ms in bundled.items():
        print(
            f"| 512x768x2048 matmul | {dtype} | {ms:.1f} ms | {optimized[dtype]:.1f} ms | "
            f"{ms / optimized[dtype]:.2f}x |"
        )
    for name in args.models.split(","):
        runs: dict[str, list[dict]] = {"bundled": [], "optimized": []}
        for _ in range(args.pairs):
            runs["bundled"].append(measure(name, None))
            runs["optimized"].append(measure(name, chosen))
        for phase in ("prefill", "decode"):
            b = statistics.median(r[phase] for r in runs["bundled"])
            o = statistics.median(r[phase] for r in runs["optimized"])
            print(f"| {name} | {phase} | {b:.1f} tok/s | {o:.1f} tok/s | {o / b:.2f}x |")


if __name__ == "__main__":
    main()
