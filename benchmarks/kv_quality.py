"""How much a quantized KV format changes a model's next-token distribution, teacher-forced.

    python -m benchmarks.kv_quality --models tiny,medium --contexts 1024,8192

For each model, context length and format, one token sequence of that length is run twice in
chunks of ``--chunk`` tokens: with full-precision caches (mlx_lm's ``KVCache``) and with
mlx_lm's ``QuantizedKVCache`` of the format (MLX's group-wise affine quantization, the codec
``--kv-format`` serves with). Every position attends over quantized keys and values, its own
included: what a served decode step does for every generated token (a served prompt's own
prefill attends in full precision, so this is the harder case). At every position it compares
the two next-token distributions: KL(full || quantized) in nats, mean, max and the mean over
the last quarter of the context (the deepest positions), and how often the two argmaxes agree.
Both runs see the same tokens (teacher-forced), so one early near-tie does not decide the rest.

Models: ``tiny`` (the embedded default's shape), ``medium``, ``100m`` (benchmarks.models),
``1b`` and ``8b`` (benchmarks.serving's shapes, in ``--dtype``; for a GPU); all random-weight,
so the figures say what the codec does to attention over these models' keys and values, not
what it does to a trained model's (whose keys have outlier channels): no perplexity here.
Writes a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from benchmarks.models import CONFIGS

FORMATS = {"int8": 8, "int4": 4}


def build(name: str, dtype: str) -> Any:
    from mlx_lm.models import llama

    from benchmarks.serving import SHAPES
    from veloxquant_mlx.engine.model.default_model import CONFIG

    config = CONFIGS[name] if name in CONFIGS else {**CONFIG, **SHAPES[name]}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def compare(model: Any, tokens: list[int], bits: int, group: int, chunk: int) -> dict[str, float]:
    """Teacher-forced statistics of ``bits``-bit KV (group ``group``) against full precision."""
    n_layers = len(model.layers)
    full = [KVCache() for _ in range(n_layers)]
    quant = [QuantizedKVCache(group_size=group, bits=bits) for _ in range(n_layers)]
    kls: list[mx.array] = []
    agree: list[mx.array] = []
    for start in range(0, len(tokens), chunk):
        x = mx.array([tokens[start : start + chunk]])
        lp = model(x, cache=full)[0].astype(mx.float32)
        lq = model(x, cache=quant)[0].astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        lq = lq - mx.logsumexp(lq, axis=-1, keepdims=True)
        kls.append((mx.exp(lp) * (lp - lq)).sum(axis=-1))
        agree.append(mx.argmax(lp, axis=-1) == mx.argmax(lq, axis=-1))
        mx.eval(kls[-1], agree[-1], [c.state for c in full], [c.state for c in quant])
    kl = mx.concatenate(kls)
    same = mx.concatenate(agree)
    deep = kl[3 * kl.shape[0] // 4 :]
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "kl_deep": deep.mean().item(),
        "agree": same.astype(mx.float32).mean().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,medium")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--group-sizes", default="32,64", help="those that divide the head width")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtype", default="float32", help="the model's (bfloat16 on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(f"device {mx.default_device()}, {a.dtype}, teacher-forced, chunks of {a.chunk}")
    print(
        "| model | context | format | group | KL mean (nats) | KL max | KL mean, last quarter "
        "| argmax agreement | s |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in a.models.split(","):
        model = build(name, a.dtype)
        head = model.layers[0].self_attn.head_dim
        vocab = model.args.vocab_size
        for context in (int(c) for c in a.contexts.split(",")):
            key = mx.random.key(a.seed + context)
            tokens = mx.random.randint(3, vocab, (context,), key=key).tolist()
            for fmt in a.formats.split(","):
                for group in (int(g) for g in a.group_sizes.split(",")):
                    if head % group:
                        continue
                    t0 = time.perf_counter()
                    s = compare(model, tokens, FORMATS[fmt], group, a.chunk)
                    print(
                        f"| {name} | {context} | {fmt} | {group} | {s['kl_mean']:.2e} | "
                        f"{s['kl_max']:.2e} | {s['kl_deep']:.2e} | {100 * s['agree']:.2f}% | "
                        f"{time.perf_counter() - t0:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
