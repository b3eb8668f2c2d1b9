"""What one prefill chunk of a cached agent turn costs, by prefill attention route: the
model's forward over a chunk of new tokens after a long cached context, as the engine's
prefill runs it.

    python -m benchmarks.chunk_bench --shape 8b --context 0,6000,16000 --chunk 64,512
    python -m benchmarks.chunk_bench --shape 8b --routes ...   (the attention alone)

The engine's prefill (``engine.loop.prefill``) gives a turn stock mlx_lm caches that hold its
cached context with room for the rest (``kv.room``), routes their attention (``vq_route``,
``--prefill-attention``) and computes the output head for the last position only
(``engine.loop.last_logits``). Timed here, per (context, chunk) and route (``matmul``:
``kv.chunk_attention.grouped_attention``; ``buckets``:
``kv.chunk_attention.bucketed_attention``;
``sdpa``: MLX's own, on CUDA cuDNN, which builds a graph per new shape): that forward's median
over ``--repeats`` after one warm-up, and of building its graph (the model's Python call),
with the bytes it must read (weights + the context's K and V) over ``--peak-gbs`` as the
floor. ``--routes`` times the attention alone over all layers instead, the first call (cold)
apart. A chunk's cost should be its tokens' (and the context's reads), not a constant.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.serving import write_model


def _caches(model: Any, context: int, room: int, route: str | None) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.kv.room import joined

    args = model.args
    heads = args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = model.model.embed_tokens.weight.dtype
    mx.random.seed(context)  # the same context for every route
    caches = []
    for _ in range(args.num_hidden_layers):
        c = KVCache()
        c.vq_route = route  # type: ignore[attr-defined]
        if context:
            k, v = (mx.random.normal((1, heads, context, dim)).astype(dtype) for _ in (0, 1))
            c.keys, c.values, c.offset = joined([k], room), joined([v], room), context
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches if context])
    return caches


def chunk_logits(model: Any, context: int, chunk: int, route: str | None) -> Any:
    """The logits of a chunk's last position after ``context`` cached tokens (random KV, the
    same for every route), its attention routed by ``route`` (``vq_route``)."""
    import mlx.core as mx

    from veloxquant_mlx.engine.loop import last_logits

    caches = _caches(model, context, chunk, route)
    tokens = mx.array([[(7 * i) % 1000 + 3 for i in range(chunk)]])
    with last_logits.position(model, chunk - 1):
        logits = model(tokens, cache=caches)
    return logits[0, -1]


def forward_ms(
    model: Any, context: int, chunk: int, route: str | None, repeats: int
) -> tuple[float, float]:
    """The median ms of one chunk's forward (logits of its last position) after ``context``
    cached tokens, the caches' offsets put back after each, and of building its graph (the
    model's Python call, before the evaluation)."""
    import mlx.core as mx

    from veloxquant_mlx.engine.loop import last_logits

    caches = _caches(model, context, chunk, route)
    tokens = mx.array([[(7 * i) % 1000 + 3 for i in range(chunk)]])
    times, builds = [], []
    for i in range(repeats + 1):
        for c in caches:
            if context:
                c.offset = context
            else:
                c.keys = c.values = None
                c.offset = 0
        t0 = time.perf_counter()
        with last_logits.position(model, chunk - 1):
            logits = model(tokens, cache=caches)
        t1 = time.perf_counter()
        mx.eval(logits, [(c.keys, c.values) for c in caches])
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
            builds.append((t1 - t0) * 1e3)
    return statistics.median(times), statistics.median(builds)


def attention_variants(model: Any, context: int, chunk: int, repeats: int) -> dict:
    """Each route's ms for the chunk's attention over every layer: the first call (``cold``:
    on CUDA cuDNN builds a graph for a new shape) and the median of ``repeats`` after it, and
    its largest difference from MLX's own (``grouped``: MLX's softmax in one pass, the
    ``matmul`` prefill route; ``passes``: the powers-of-two softmax in five passes over float32
    scores, a CPU's; ``sdpa``: MLX's own, cuDNN on CUDA; ``buckets``:
    ``kv.chunk_attention.bucketed_attention``). The keys are a slice of a buffer with room after
    them, as in a prefill cache."""
    import mlx.core as mx

    from veloxquant_mlx.kv.chunk_attention import bucketed_attention, grouped_attention

    args = model.args
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = model.model.embed_tokens.weight.dtype
    length = context + chunk
    shape = (1, args.num_key_value_heads, length + 1000, dim)
    kr, vr = (mx.random.normal(shape).astype(dtype) for _ in (0, 1))
    k, v = kr[:, :, :length], vr[:, :, :length]
    q = mx.random.normal((1, args.num_attention_heads, chunk, dim)).astype(dtype)
    mx.eval(kr, vr, q)
    scale = dim**-0.5
    routes = {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
        "grouped": lambda: grouped_attention(q, k, v, scale, "causal", exp2=False),
        "passes": lambda: grouped_attention(q, k, v, scale, "causal", exp2=True),
        "buckets": lambda: bucketed_attention(q, k, v, scale, "causal"),
    }
    want = routes["sdpa"]().astype(mx.float32)
    out = {}
    for name, route in routes.items():
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            outs = [route() for _ in range(args.num_hidden_layers)]
            mx.eval(outs)
            times.append((time.perf_counter() - t0) * 1e3)
        diff = float(mx.abs(outs[0].astype(mx.float32) - want).max())
        out[name] = (times[0], statistics.median(times[1:]), diff)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", default="0,2000,6000")
    p.add_argument("--chunk", default="64,128,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-gbs", type=float, default=0.0, help="the device's memory GB/s")
    p.add_argument("--work", default="bench-work")
    p.add_argument("--routes", action="store_true", help="the attention routes alone")
    a = p.parse_args()
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    from veloxquant_mlx.engine.loop import last_logits
    from veloxquant_mlx.kv import attention

    path = write_model(Path(a.work) / f"model-{a.shape}", a.shape, a.dtype)
    model = mlx_lm.load(str(path))[0]
    attention.install(model)
    last_logits.install(model)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    args = model.args
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * dim * 2
    print(f"{mx.default_device()}; weights {weights / 1e9:.2f} GB")
    contexts = [int(x) for x in a.context.split(",")]
    chunks = [int(x) for x in a.chunk.split(",")]
    if a.routes:
        print("| context | chunk | route | cold ms | warm ms | max diff from sdpa |\n"
              "|---:|---:|---|---:|---:|---:|")  # fmt: skip
        for context in contexts:
            for chunk in chunks:
                got = attention_variants(model, context, chunk, a.repeats)
                for name, (cold, warm, diff) in got.items():
                    cells = [context, chunk, name, f"{cold:.2f}", f"{warm:.2f}", f"{diff:.3g}"]
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)
                mx.clear_cache()
        return
    routes = {"matmul": "exp", "buckets": "buckets", "sdpa": None}
    print("| context | chunk | prefill attention | forward ms | its graph's build ms | floor ms "
          "| forward / floor |\n|---:|---:|---|---:|---:|---:|---:|")  # fmt: skip
    for context in contexts:
        for chunk in chunks:
            floor = (weights + per_token * context) / (a.peak_gbs * 1e6) if a.peak_gbs else 0.0
            for name, route in routes.items():
                fwd, build = forward_ms(model, context, chunk, route, a.repeats)
                ratio = f"{fwd / floor:.1f}x" if floor else "-"
                cells = [context, chunk, name, f"{fwd:.2f}", f"{build:.2f}",
                         f"{floor:.2f}" if floor else "-", ratio]  # fmt: skip
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            mx.clear_cache()


if __name__ == "__main__":
    main()
