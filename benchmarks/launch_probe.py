"""Launching a decode step ahead of the previous one: does its first write copy the KV store?

    python -m benchmarks.launch_probe --shape 1b --rows 1,32,128 --extra-mb 4096

A bare decode loop over the engine's KV layouts (``kv.paged``; no engine, no sampling):
``--steps`` greedy steps of R rows at one position, each launched

- ``ahead``: at once, while the previous step may still run (how the dense layout launches);
- ``after``: once the previous step's tokens are ready (``mx.eval``);
- ``sync``: after ``mx.synchronize()`` (how the engine launches a paged step).

Each paged run is made twice, its store holding only the rows' blocks and then
``--extra-mb`` more of free blocks. A store copied at each step's write shows as MLX's peak
memory (above the live set at the first step) rising by the store's size and, with the large
store, as slower steps. Prints one JSON line a run; the order of modes and layouts repeats
``--repeats`` times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.serving import SHAPES
from benchmarks.single_stream import BLOCK, layout_with_rows, prefill, step_logits


def run(
    model: Any, layers: Any, y0: Any, rows: int, layout: str, mode: str, extra_mb: float, n: int
) -> tuple[dict[str, Any], list[int]]:
    """One run from a prefilled row (``single_stream.prefill``): its figures, and row 0's
    greedy tokens (the decode it timed)."""
    import mlx.core as mx

    k = layers[0][0]
    per_id = k.shape[1] * BLOCK * k.shape[3] * k.dtype.size
    kv, n_ids = layout_with_rows(layout, layers, rows, n, int(extra_mb * 2**20 // per_id))
    y = mx.concatenate([y0] * rows)
    mx.eval(y, *([kv.store] if layout == "paged" else [*kv.k, *kv.v]))
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    position, times, tokens = k.shape[2], [], []
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter()
        logits = step_logits(model, kv, y, position, n_ids)
        following = mx.argmax(logits, axis=-1).astype(mx.uint32)
        if mode == "after":
            mx.eval(y)
        elif mode == "sync":
            mx.synchronize()
        mx.async_eval(following)
        tokens.append(y.tolist()[0])
        times.append(time.perf_counter() - a)
        y, position = following, position + 1
    mx.eval(y)
    total = time.perf_counter() - t0
    result = {
        "rows": rows,
        "layout": layout,
        "mode": mode,
        "store_mib": round(kv.nbytes() / 2**20),
        "step_ms": round(1000 * statistics.median(times), 3),
        "tok_s": round(rows * n / total, 1),
        "peak_over_live_mib": round((mx.get_peak_memory() - base) / 2**20, 1),
    }
    del kv
    mx.clear_cache()
    return result, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--extra-mb", type=float, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default=None, help="where the model is written (default: a tmp dir)")
    args = p.parse_args()

    import mlx.core as mx

    from benchmarks.step_bench import bench_model

    _, model, dtype = bench_model(args.shape, args.dtype, args.work, "vq-launch-")
    prompt = [3 + (7 * i) % 1997 for i in range(args.prompt_tokens)]
    _, layers, y0 = prefill(model, prompt)
    print(
        f"launch_probe: MLX {mx.__version__} on {mx.default_device()}, {args.shape} {dtype}",
        flush=True,
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        for _ in range(args.repeats):
            for mode in ("ahead", "after", "sync"):
                for layout, extra in (("paged", 0.0), ("paged", args.extra_mb), ("dense", 0.0)):
                    out, _ = run(model, layers, y0, rows, layout, mode, extra, args.steps)
                    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
