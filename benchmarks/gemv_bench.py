"""Decode-step time with the optimized BLAS alone against BLAS + the gemv forwarder (Linux).

    python -m benchmarks.gemv_bench [--pairs N] [--models medium,100m] [--rows 1,2,4,8,16]

Each measurement is a child process (the preload is fixed at its start): one with the library
``--blas auto`` picks, one with the gemv forwarder (``veloxquant_mlx/gemv_forward.py``) in front
of it. The two alternate, pair by pair; figures are medians. A step: one new token for each of
``rows`` sequences over a 128-token KV cache, mlx_lm's own model and cache, float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.child import run_child
from veloxquant_mlx import blas, gemv_forward

CONTEXT, STEPS = 128, 16


def child(name: str, rows: list[int]) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.models import build

    model = build(name)
    out = {}
    for b in rows:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.full((b, CONTEXT), 5), cache=cache))
        token = mx.full((b, 1), 7)
        times = []
        for _ in range(STEPS + 2):
            for c in cache:
                c.offset = CONTEXT  # the same step again: fixed work per measurement
            t0 = time.perf_counter()
            mx.eval(model(token, cache=cache))
            times.append(time.perf_counter() - t0)
        out[str(b)] = statistics.median(times[2:]) * 1000
    print(json.dumps(out))


def measure(name: str, rows: str, preload: str) -> dict[str, float]:
    return run_child("benchmarks.gemv_bench", ["--child", name, "--rows", rows], preload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--models", default="medium,100m")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, [int(r) for r in args.rows.split(",")])
        return
    chosen = blas.select("auto")
    if chosen is None:
        print("gemv_bench: no optimized BLAS found; nothing to compare")
        return
    forwarder = str(gemv_forward.build())
    print(f"gemv_bench: {chosen} alone vs with {forwarder}; median of {args.pairs} process pairs")
    print("| model | rows | BLAS alone ms/step | with forwarder ms/step | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        alone: list[dict[str, float]] = []
        forwarded: list[dict[str, float]] = []
        for _ in range(args.pairs):
            alone.append(measure(name, args.rows, chosen))
            forwarded.append(measure(name, args.rows, f"{forwarder}:{chosen}"))
        for rows in args.rows.split(","):
            a = statistics.median(r[rows] for r in alone)
            f = statistics.median(r[rows] for r in forwarded)
            print(f"| {name} | {rows} | {a:.1f} | {f:.1f} | {a / f:.2f}x |")


if __name__ == "__main__":
    main()
