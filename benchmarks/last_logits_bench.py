"""A cached turn's prefill forward with every position's logits, and with the last one's alone.

    python -m benchmarks.last_logits_bench [--shapes 100m-32k,qwen-0.5b] [--cached 1600]
                                           [--new 128] [--repeats 5]

For each shape (random weights, float32 on a CPU, the device's default elsewhere), the KV of
``--cached`` tokens is made once; then the forward of ``--new`` tokens over it is timed, its
first token's logits evaluated, with the output head over every position (what an mlx_lm
model does) and over the sampled position alone (``engine.loop.last_logits``), alternated,
the cache trimmed back after each; attention as the engine's prefill takes it on this device
(``kv.attention``: on a CPU the exp2 softmax). Prints the medians and their ratio, and the
head's share of the model's weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

from benchmarks.models import LARGE_CONFIG
from veloxquant_mlx.blas import blas_in_use, ensure_blas
from veloxquant_mlx.engine.loop import last_logits
from veloxquant_mlx.kv import attention

SHAPES: dict[str, dict[str, Any]] = {
    # the 100m model's layers with a Llama-2-sized vocabulary
    "100m-32k": {**LARGE_CONFIG, "vocab_size": 32000, "tie_word_embeddings": False},
    "qwen-0.5b": {  # Qwen2.5-0.5B's shape
        **LARGE_CONFIG,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


def measure(config: dict[str, Any], cached: int, new: int, repeats: int) -> dict[str, float]:
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    weights = sum(v.size for _, v in tree_flatten(model.parameters()))
    head = config["vocab_size"] * config["hidden_size"]
    assert last_logits.install(model)
    attention.install(model)  # the engine's prefill attention for this device, as it serves
    route = attention.choose("auto").prefill_route
    caches = [KVCache() for _ in model.layers]
    for cache in caches:
        cache.vq_route = route  # type: ignore[attr-defined]
    context = mx.random.randint(3, config["vocab_size"], (1, cached))
    mx.eval(model(context, cache=caches))
    tokens = mx.random.randint(3, config["vocab_size"], (1, new))
    times: dict[str, list[float]] = {"all": [], "last": []}
    for _ in range(repeats + 1):  # the first round warms up
        for kind in ("all", "last"):
            t0 = time.perf_counter()
            if kind == "last":
                with last_logits.position(model, new - 1):
                    logits = last_logits.row(model(tokens, cache=caches), new - 1)
            else:
                logits = model(tokens, cache=caches)[:, -1, :]
            mx.eval(logits)
            times[kind].append(time.perf_counter() - t0)
            for c in caches:
                c.trim(new)
    all_ms = statistics.median(times["all"][1:]) * 1e3
    last_ms = statistics.median(times["last"][1:]) * 1e3
    return {
        "params_m": weights / 1e6,
        "head_share": head / weights,
        "all_ms": all_ms,
        "last_ms": last_ms,
        "ratio": last_ms / all_ms,
    }


def main() -> None:
    ensure_blas(os.environ.get("VQ_BLAS", "auto"))  # the server's BLAS (may re-execute)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="100m-32k,qwen-0.5b")
    p.add_argument("--cached", type=int, default=1600)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(
        f"{a.new} new tokens over {a.cached} cached, {mx.default_device()}, BLAS "
        f"{blas_in_use()}, medians of {a.repeats}"
    )
    print()
    print(
        "| shape | weights | head's share | every position's logits ms | the last one's ms "
        "| ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in a.shapes.split(","):
        r = measure(SHAPES[name], a.cached, a.new, a.repeats)
        print(
            f"| {name} | {r['params_m']:.0f}M | {r['head_share']:.0%} | {r['all_ms']:.0f} | "
            f"{r['last_ms']:.0f} | {r['ratio']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
