"""Decode attention over ragged rows: what each way of telling rows apart costs.

    python -m benchmarks.attention_bench --shape 8b --rows 8,32,128

Rows of one decode step sit at different positions (they joined at different times), so each
must attend to its own length only. mlx_lm's way is a mask; on MLX's CUDA backend any array
mask moves ``mx.fast.scaled_dot_product_attention`` off its vector kernel onto the unfused
fallback (cuDNN takes only prefill shapes, and no bool masks at all). Timed here, one decode
step's attention over all the shape's layers, bfloat16 on a GPU:

- ``uniform``: no mask, every row the full width (the vector kernel; wrong for ragged rows,
  the floor to compare with);
- ``bool``: the bool mask mlx_lm's caches give (what the engine passed before);
- ``additive``: that mask as 0/-inf in the model's dtype, made once a step for all layers;
- ``rows``: one unmasked call per row over that row's own length (a strided view, no copy),
  the results concatenated;
- ``cudnn2``: the query doubled to length 2 with an additive mask, which MLX hands to cuDNN;
- ``matmul``: ``veloxquant_mlx.kv.attention.matmul_attention`` (``--ragged-attention
  matmul``, the GPU default): each KV head's query heads as the rows of one product, K and V
  read once per KV head in place, where MLX's fallback broadcasts them over the query heads.

With ``--formats int8,int4`` the same rows' K and V quantized (``mx.quantize``, groups of 64,
or 32 for narrower heads) and attended by ``--quantized-attention fused``'s kernels (CUDA
only), each of its steps (``kv.quantized_kernels``: ``tile``, the server's; ``plain``, a warp
per position), with each one's largest difference from the attention over the dequantized
codes.

Then one whole decode step of the shape's model (random weights, the engine's dense
``StepCache``), ragged rows, with the attention done each of those ways.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.serving import SHAPES

Method = Callable[[Any, Any, Any, float, list[int]], Any]


def methods() -> dict[str, Method]:
    import mlx.core as mx

    from veloxquant_mlx.kv.attention import matmul_attention

    sdpa = mx.fast.scaled_dot_product_attention

    def uniform(q: Any, k: Any, v: Any, scale: float, lengths: list[int]) -> Any:
        return sdpa(q, k, v, scale=scale)

    def bool_mask(q: Any, k: Any, v: Any, scale: float, lengths: list[int]) -> Any:
        return sdpa(q, k, v, scale=scale, mask=_bool(lengths, k.shape[2]))

    def additive(q: Any, k: Any, v: Any, scale: float, lengths: list[int]) -> Any:
        return sdpa(q, k, v, scale=scale, mask=_additive(lengths, k.shape[2], q.dtype))

    def rows(q: Any, k: Any, v: Any, scale: float, lengths: list[int]) -> Any:
        outs = [
            sdpa(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale=scale)
            for i, n in enumerate(lengths)
        ]
        return mx.concatenate(outs, axis=0)

    def cudnn2(q: Any, k: Any, v: Any, scale: float, lengths: list[int]) -> Any:
        m = _additive(lengths, k.shape[2], q.dtype)
        out = sdpa(mx.concatenate([q, q], axis=2), k, v, scale=scale, mask=mx.repeat(m, 2, 2))
        return out[:, :, :1]

    def matmul(q: Any, k: Any, v: Any, scale: float, lengths: list[int]) -> Any:
        return matmul_attention(q, k, v, scale, _bool(lengths, k.shape[2]))

    return {"uniform": uniform, "bool": bool_mask, "additive": additive, "rows": rows,
            "cudnn2": cudnn2, "matmul": matmul}  # fmt: skip


_MASKS: dict[Any, Any] = {}  # made once a step, as a step's StepBatch would


def _bool(lengths: list[int], width: int) -> Any:
    import mlx.core as mx

    key = ("b", tuple(lengths), width)
    if key not in _MASKS:
        _MASKS[key] = (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]
    return _MASKS[key]


def _additive(lengths: list[int], width: int, dtype: Any) -> Any:
    import mlx.core as mx

    key = ("a", tuple(lengths), width, dtype)
    if key not in _MASKS:
        m = mx.where(_bool(lengths, width), mx.array(0, dtype), mx.array(-float("inf"), dtype))
        _MASKS[key] = m
    return _MASKS[key]


def attention_only(shape: dict[str, Any], rows: int, width: int, repeats: int, dtype: Any) -> dict:
    import mlx.core as mx

    layers, hq = shape["num_hidden_layers"], shape["num_attention_heads"]
    hkv, d = shape["num_key_value_heads"], shape["head_dim"]
    rng = random.Random(rows)
    lengths = [rng.randint(max(1, width - 128), width) for _ in range(rows)]
    lengths[0] = width
    q = [mx.random.normal((rows, hq, 1, d)).astype(dtype) for _ in range(layers)]
    k = [mx.random.normal((rows, hkv, width, d)).astype(dtype) for _ in range(layers)]
    v = [mx.random.normal((rows, hkv, width, d)).astype(dtype) for _ in range(layers)]
    mx.eval(q, k, v)
    scale = d**-0.5
    out: dict[str, float] = {}
    ref = None
    for name, fn in methods().items():
        _MASKS.clear()
        times = []
        for _ in range(repeats + 2):
            _MASKS.clear()
            t0 = time.perf_counter()
            res = [fn(q[i], k[i], v[i], scale, lengths) for i in range(layers)]
            mx.eval(res)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * statistics.median(times[2:])
        if name == "bool":
            ref = res[0]
        elif ref is not None and name != "uniform":
            out[f"{name}_maxdiff"] = mx.abs(res[0].astype(mx.float32) - ref).max().item()
    return out


def quantized_only(
    shape: dict[str, Any], rows: int, width: int, repeats: int, dtype: Any, fmt: str
) -> dict:
    """The quantized kernels' steps over ragged rows of ``fmt`` ("int8", "int4") codes, every
    layer: ms a step, and each one's largest difference from the dequantized attention."""
    import mlx.core as mx

    from veloxquant_mlx.kv import quantized_attention
    from veloxquant_mlx.kv.quantized_kernels import STEPS

    layers, hq = shape["num_hidden_layers"], shape["num_attention_heads"]
    hkv, d = shape["num_key_value_heads"], shape["head_dim"]
    bits, group = int(fmt.removeprefix("int")), 64 if d % 64 == 0 else 32
    if not quantized_attention.kernel_runs(d, hq // hkv, group):
        return {f"{fmt}_kernel": "does not run here (CUDA only)"}
    rng = random.Random(rows)
    lengths = [rng.randint(max(1, width - 128), width) for _ in range(rows)]
    lengths[0] = width
    lens = mx.array(lengths, dtype=mx.int32)
    q = [mx.random.normal((rows, hq, 1, d)).astype(dtype) for _ in range(layers)]

    def codes() -> tuple[mx.array, ...]:
        x = mx.random.normal((rows, hkv, width, d)).astype(dtype)
        return tuple(mx.quantize(x, group_size=group, bits=bits))

    k = [codes() for _ in range(layers)]
    v = [codes() for _ in range(layers)]
    mx.eval(q, k, v)
    scale = d**-0.5
    want = quantized_attention.dequantized(q[0], k[0], v[0], lens, scale, bits, group)
    out: dict[str, Any] = {}
    for step in STEPS:
        kernel = quantized_attention.QuantizedAttention(step)
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            res = [
                kernel(q[i], k[i], v[i], lens, scale, bits, group, width=width)
                for i in range(layers)
            ]
            mx.eval(res)
            times.append(time.perf_counter() - t0)
        out[f"{fmt}_{step}_ms"] = 1e3 * statistics.median(times[2:])
        diff = mx.abs(res[0].astype(mx.float32) - want.astype(mx.float32)).max().item()
        out[f"{fmt}_{step}_maxdiff"] = diff
    return out


def build_model(shape_name: str, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """A random-weight Llama of the shape, in memory only."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from veloxquant_mlx.engine.model.default_model import CONFIG

    config = {**CONFIG, **SHAPES[shape_name]}
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, config


def model_step(model: Any, config: dict[str, Any], rows: int, width: int, repeats: int,
               dtype: Any) -> dict:  # fmt: skip
    """One decode step of the model over ragged rows, attention each way."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from veloxquant_mlx.kv.dense import DenseKV
    from veloxquant_mlx.kv.step import READ_CHUNK, StepBatch, StepCache

    n_layers = config["num_hidden_layers"]
    hkv, d = config["num_key_value_heads"], config["head_dim"]
    rng = random.Random(rows)
    positions = [rng.randint(max(0, width - 128), width - 1) for _ in range(rows)]
    positions[0] = width - 1
    kv = DenseKV(n_layers)
    prefill = [(mx.random.normal((1, hkv, width, d)).astype(dtype),) * 2 for _ in range(n_layers)]
    for r in range(rows):
        kv.put_row(r, prefill, None)
    y = mx.array([[3 + r] for r in range(rows)])
    original = llama.scaled_dot_product_attention
    current: dict[str, Any] = {}

    def patched(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
                sinks: Any = None) -> Any:  # fmt: skip
        fn = current.get("fn")
        if fn is None or mask is None:
            return original(queries, keys, values, cache, scale, mask, sinks)
        return fn(queries, keys, values, scale, [p + 1 for p in cache.batch.positions_list])

    out: dict[str, float] = {}
    ref = None
    llama.scaled_dot_product_attention = patched
    try:
        for name, fn in [("mask_bool", None), *methods().items()]:
            if name in ("uniform", "bool"):
                continue
            current["fn"] = fn
            times = []
            for _ in range(repeats + 2):
                _MASKS.clear()
                t0 = time.perf_counter()
                batch = StepBatch(positions)
                kv.begin_step(batch, 0)
                caches = [StepCache(kv, i, batch) for i in range(n_layers)]
                logits = model(y, cache=caches)[:, -1, :]
                mx.eval(logits, kv.k, kv.v)
                times.append(time.perf_counter() - t0)
            out[f"step_{name}_ms"] = 1e3 * statistics.median(times[2:])
            logits = logits.astype(mx.float32)
            if ref is None:
                ref = logits
            else:
                out[f"step_{name}_maxdiff"] = mx.abs(logits - ref).max().item()
        # as in serving: every row one position further each step (the keys' width grows), the
        # engine's masked step through MLX's attention, then matmul at exact and chunked widths
        for name, fn, chunk in [("mask_bool", None, 1), ("matmul", methods()["matmul"], 1),
                                ("matmul_chunked", methods()["matmul"], READ_CHUNK)]:  # fmt: skip
            current["fn"] = fn
            times = []
            for i in range(repeats + 2):
                _MASKS.clear()
                t0 = time.perf_counter()
                batch = StepBatch([p + i for p in positions], width_chunk=chunk)
                kv.begin_step(batch, 0)
                caches = [StepCache(kv, j, batch) for j in range(n_layers)]
                mx.eval(model(y, cache=caches)[:, -1, :], kv.k, kv.v)
                times.append(time.perf_counter() - t0)
            out[f"step_growing_{name}_ms"] = 1e3 * statistics.median(times[2:])
        current["fn"] = None
        times = []
        for _ in range(repeats + 2):  # every row at one position: no mask (the floor)
            t0 = time.perf_counter()
            batch = StepBatch([width - 1] * rows)
            caches = [StepCache(kv, i, batch) for i in range(n_layers)]
            mx.eval(model(y, cache=caches)[:, -1, :], kv.k, kv.v)
            times.append(time.perf_counter() - t0)
        out["step_uniform_ms"] = 1e3 * statistics.median(times[2:])
    finally:
        llama.scaled_dot_product_attention = original
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="8,32,128")
    p.add_argument("--width", type=int, default=384, help="the longest row's keys")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-model", action="store_true", help="attention alone")
    p.add_argument("--formats", default="", help="quantized kernels too, e.g. int8,int4")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = p.parse_args()
    import mlx.core as mx

    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model, shape = build_model(a.shape, dtype)
    print(f"attention_bench: MLX {mx.__version__} on {mx.default_device()}, {a.shape} {dtype}")
    for rows in [int(r) for r in a.rows.split(",")]:
        res: dict[str, Any] = {"shape": a.shape, "rows": rows, "width": a.width}
        res.update(attention_only(shape, rows, a.width, a.repeats, dtype))
        for fmt in filter(None, a.formats.split(",")):
            res.update(quantized_only(shape, rows, a.width, a.repeats, dtype, fmt))
        if not a.no_model:
            res.update(model_step(model, shape, rows, a.width, a.repeats, dtype))
        line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as fh:
                fh.write(line + "\n")


if __name__ == "__main__":
    main()
