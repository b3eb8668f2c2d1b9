"""One stream's decode speed, taken apart: where the engine's time per token goes against stock.

    python -m benchmarks.single_stream --shape 1b --max-tokens 256 --repeats 3

Side by side in one process, repeated in turn, each round in another order (the median is
reported):

- ``stock``: mlx_lm's ``generate_step`` with stock ``KVCache`` (the target's reference);
- ``loop/stock``: the same decode written out (sample, ``async_eval``, read the previous token),
  so the two loops below differ from it only in their caches;
- ``loop/dense``, ``loop/paged``: that loop over the engine's ``StepCache`` in each layout,
  each step launched as the engine launches it (paged: once the previous one is done);
- ``engine/dense``, ``engine/paged``: the engine itself, one client, one request at a time.

``*_vs_stock`` is the ratio of medians; ``*_vs_stock_paired`` the median of each round's ratio to
the stock run of the same round (what drift between rounds leaves alone).

``loop/<layout>_same_tokens`` is how many of the last round's greedy tokens that layout's loop
shares with ``loop/stock`` (all of them, unless a read is wrong or bfloat16 parts them late).

``build_ms`` is the host time a loop spends building and launching one step (Python, graph
construction, the launch call): what a GPU step's compute has to hide. The engine's figure
against ``loop/<layout>`` is its own loop's cost (scheduler, sampling, text, delivery); the loop's
against ``loop/stock``, the cache's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.serving import SHAPES, layout_config

BLOCK = 16  # the engine's default block size


def prefill(model: Any, prompt: list[int]) -> tuple[list[Any], list[tuple[Any, Any]], Any]:
    """The prompt through stock caches: (the caches, each layer's K and V, the greedy next
    token, launched)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches: list[Any] = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=caches)[:, -1, :]
    y = mx.argmax(logits, axis=-1).astype(mx.uint32)
    layers = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
    mx.async_eval(y, layers)
    return caches, layers, y


def layout_with_rows(
    layout: str,
    layers: list[tuple[Any, Any]],
    rows: int,
    n_new: int,
    extra_ids: int = 0,
    codec: Any = None,
    kernel: bool = False,
    recent: int = 0,
    ragged: Any = None,
) -> tuple[Any, int]:
    """A ``kv.paged`` layout holding ``rows`` copies of a prefilled row (``layers``), each
    with blocks for ``n_new`` more tokens, and ``extra_ids`` free block ids: (it, its ids).
    ``fused``: paged, attending through the tables (the model's attention must be routed:
    ``kv.attention.install``). ``codec``: the KV's format (``kv.codec.KVCodec``; None: the
    model's type; ``kernel``: a quantized codec's rows attend through
    ``--quantized-attention fused``'s route, which the model's attention must be routed to;
    ``recent``: a quantized codec's residual window, routed the same way; ``ragged``: how
    masked steps attend, a ``kv.attention.RaggedAttention``, default MLX's)."""
    from veloxquant_mlx.kv.paged import make_kv

    n_layers, start = len(layers), layers[0][0].shape[2]
    blocks = -(-(start + n_new + 1) // BLOCK)
    n_ids = rows * 2 * n_layers * blocks + extra_ids
    fused = layout == "fused"
    kv = make_kv(
        "paged" if fused else layout, n_layers, BLOCK, n_ids, ragged=ragged, fused=fused,
        codec=codec, kernel=kernel, recent=recent,
    )  # fmt: skip
    for r in range(rows):
        first = r * 2 * n_layers * blocks
        table = [[first + s * blocks + b for b in range(blocks)] for s in range(2 * n_layers)]
        kv.put_row(r, layers, table)
    return kv, n_ids


def step_logits(
    model: Any, kv: Any, y: Any, position: int | list[int], n_ids: int, compiled: Any = None
) -> Any:
    """One decode step of every row of ``kv`` at ``position`` (or each row at its own, a
    list: a ragged step) (built, not launched): logits. ``compiled``: a
    ``kv.compiled_step.CompiledStep`` the step goes through (dense only)."""
    from veloxquant_mlx.kv.compiled_step import decode_logits
    from veloxquant_mlx.kv.step import StepBatch

    positions = position if isinstance(position, list) else [position] * y.shape[0]
    batch = kv.step_batch(positions) if len(set(positions)) > 1 else StepBatch(positions)
    kv.begin_step(batch, n_ids - 1)
    logits = decode_logits(model, kv, y, batch, kv.n_layers, compiled)
    assert compiled is None or compiled.failed is None, f"did not compile: {compiled.failed}"
    return logits


def decode_loop(
    model: Any, prompt: list[int], n: int, layout: str
) -> tuple[float, float, list[int]]:
    """Prefill with stock caches, then ``n`` decode steps over ``layout`` ("stock", "dense",
    "paged"); returns (tok/s over the whole call, median host ms per step to build and
    launch, the greedy tokens)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    caches, layers, y = prefill(model, prompt)
    kv, n_ids = (None, 0) if layout == "stock" else layout_with_rows(layout, layers, 1, n)
    position, builds, tokens = len(prompt), [], []
    for _ in range(n):
        b0 = time.perf_counter()
        if kv is not None:
            logits = step_logits(model, kv, y, position, n_ids)
        else:
            logits = model(y[:, None], cache=caches)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        following = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        if kv is not None and kv.launch_after_previous:
            mx.synchronize()  # as the engine launches this layout's steps (kv/paged.py)
        mx.async_eval(following)
        builds.append(time.perf_counter() - b0)
        tokens.append(y.item())
        y, position = following, position + 1
    mx.eval(y)
    return n / (time.perf_counter() - t0), 1000 * statistics.median(builds), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", default="dense,paged", help="of dense, paged, fused")
    p.add_argument("--work", default=None, help="where the model is written (default: a tmp dir)")
    p.add_argument("--out", default=None, help="write single_stream.json here")
    args = p.parse_args()

    import mlx.core as mx

    from benchmarks.step_bench import bench_model, closed_loop, single_stream
    from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig

    path, model, dtype = bench_model(args.shape, args.dtype, args.work, "vq-single-")
    if "fused" in args.layouts.split(","):
        from veloxquant_mlx.kv import attention

        attention.install(model)  # the fused loop's attention goes through the tables
    prompt = [3 + (7 * i) % 1997 for i in range(args.prompt_tokens)]
    n = args.max_tokens
    layouts = [s for s in args.layouts.split(",") if s]
    engines = {
        layout: Engine(
            EngineConfig(
                model=str(path),
                dtype=dtype,
                **layout_config(layout),
                kv_cache_mb=512,
                max_running=1,
                max_queue=4,
            )
        ).start()
        for layout in layouts
    }
    samples: dict[str, list[float]] = {}
    try:
        for engine in engines.values():
            engine.wait_ready(600)
            closed_loop(engine, 1, 1, [prompt], [16])  # warm up
        single_stream(model, prompt, 16)
        for layout in ("stock", *layouts):
            decode_loop(model, prompt, 16, layout)
        print(
            f"single_stream: MLX {mx.__version__} on {mx.default_device()}, {args.shape} "
            f"{dtype}, {args.prompt_tokens}-token prompt, {n} new tokens",
            flush=True,
        )
        runs: list[tuple[str, Any]] = [("stock", lambda: (single_stream(model, prompt, n), None))]
        decoded: dict[str, list[int]] = {}  # each loop's greedy tokens, last round

        def loop_run(layout: str) -> tuple[float, float]:
            rate, build, decoded[layout] = decode_loop(model, prompt, n, layout)
            return rate, build

        for layout in ("stock", *layouts):
            runs.append((f"loop/{layout}", lambda layout=layout: loop_run(layout)))
        for layout, engine in engines.items():
            runs.append(
                (
                    f"engine/{layout}",
                    lambda engine=engine: (closed_loop(engine, 1, 1, [prompt], [n]), None),
                )
            )
        for r in range(args.repeats):
            # each round in another order, so that no variant always runs first or last
            k = r % len(runs)
            for name, run in runs[k:] + runs[:k]:
                rate, build = run()
                samples.setdefault(name, []).append(rate)
                if build is not None:
                    samples.setdefault(f"{name}_build_ms", []).append(build)
            print(json.dumps({k: round(v[-1], 3) for k, v in samples.items()}), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown(30)
    result = {k: statistics.median(v) for k, v in samples.items()}
    for key in [k for k in result if not k.endswith("_ms") and k != "stock"]:
        result[f"{key}_vs_stock"] = result[key] / result["stock"]
        # paired: each round against the stock run just before it (the machine's drift between
        # rounds cancels), then the median over rounds
        pairs = [x / s for x, s in zip(samples[key], samples["stock"], strict=True)]
        result[f"{key}_vs_stock_paired"] = statistics.median(pairs)
    for layout in layouts:
        # How many greedy tokens each layout's loop shares with the loop over stock caches
        # (in bfloat16, kernels that sum in another order may part late on a near tie; a wrong
        # read parts early). A decode that is fast but wrong shows here.
        same = 0
        for a, b in zip(decoded.get(layout, []), decoded.get("stock", []), strict=False):
            if a != b:
                break
            same += 1
        result[f"loop/{layout}_same_tokens"] = same
    print(json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "single_stream.json").write_text(json.dumps({"runs": samples, "median": result}))


if __name__ == "__main__":
    main()
