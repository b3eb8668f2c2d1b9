"""How much a quantized KV format changes a model's next-token distribution, teacher-forced.

    python -m benchmarks.kv_quality --models tiny,medium --contexts 1024,8192

For each model, context length and format, one token sequence of that length is run twice in
chunks of ``--chunk`` tokens: with full-precision caches (mlx_lm's ``KVCache``) and with the
keys and values quantized and dequantized in the format (MLX's group-wise affine quantization,
the codec ``--kv-format`` serves with; ``WindowCache``), attended in full-precision arithmetic:
the same numbers as attending over the codes (on a CPU equal to mlx_lm's ``QuantizedKVCache`` to
the last digit printed, in float32), on any backend (MLX 0.32.4's CUDA quantized attention
computes wrong outputs: DESIGN-NOTES.md). Every position attends over quantized keys and values,
its own included: what a served decode step does for every generated token (a served prompt's
own prefill attends in full precision, so this is the harder case). At every position it
compares the two next-token distributions: KL(full || quantized) in nats, mean, max and the mean
over the last quarter of the context (the deepest positions), and how often the two argmaxes
agree. Both runs see the same tokens (teacher-forced), so one early near-tie does not decide the
rest.

With ``--recent N`` (``--kv-recent-tokens``) each position sees its newest N tokens in full
precision and the older ones quantized and dequantized (``WindowCache``: the same mixture the
served window attends over, in full-precision arithmetic; tests/engine/test_kv_format.py checks
that the served attention equals it).

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
from mlx_lm.models.cache import KVCache

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


class WindowCache:
    """A chunk's view of a residual window: every key twice, quantized-and-dequantized and in
    full precision, and a mask that gives each query the quantized copy of keys older than
    its newest ``recent`` and the full-precision copy of those (``recent`` 0: the quantized
    copy alone, causal)."""

    def __init__(self, bits: int, group: int, recent: int) -> None:
        # (not ``bits``: mlx_lm's attention would take the cache for a quantized one)
        self.n_bits, self.group, self.recent = bits, group, recent
        self.k: mx.array | None = None
        self.v: mx.array | None = None
        self.offset = 0

    def _dq(self, x: mx.array) -> mx.array:
        q = mx.quantize(x, group_size=self.group, bits=self.n_bits)
        return mx.dequantize(*q, group_size=self.group, bits=self.n_bits)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.k = k if self.k is None else mx.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else mx.concatenate([self.v, v], axis=2)
        self.offset = self.k.shape[2]
        if not self.recent:
            return self._dq(self.k), self._dq(self.v)
        keys = mx.concatenate([self._dq(self.k), self.k], axis=2)
        values = mx.concatenate([self._dq(self.v), self.v], axis=2)
        return keys, values

    @property
    def state(self) -> tuple[Any, Any]:
        return self.k, self.v

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None) -> mx.array:
        total = self.offset + n  # called before update_and_fetch
        t = mx.arange(total - n, total)[:, None]
        j = mx.arange(total)[None, :]
        if not self.recent:
            return j <= t
        old = j <= t - self.recent
        new = (j > t - self.recent) & (j <= t)
        return mx.concatenate([old, new], axis=1)


def compare(
    model: Any, tokens: list[int], bits: int, group: int, chunk: int, recent: int = 0
) -> dict[str, float]:
    """Teacher-forced statistics of ``bits``-bit KV (group ``group``; the newest ``recent``
    tokens in full precision) against full precision."""
    n_layers = len(model.layers)
    full = [KVCache() for _ in range(n_layers)]
    quant = [WindowCache(bits, group, recent) for _ in range(n_layers)]
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
    p.add_argument("--recent", default="0", help="residual windows to try, e.g. 0,64")
    p.add_argument("--dtype", default="float32", help="the model's (bfloat16 on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(f"device {mx.default_device()}, {a.dtype}, teacher-forced, chunks of {a.chunk}")
    print(
        "| model | context | format | group | window | KL mean (nats) | KL max "
        "| KL mean, last quarter | argmax agreement | s |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in a.models.split(","):
        model = build(name, a.dtype)
        head = model.layers[0].self_attn.head_dim
        vocab = model.args.vocab_size
        for context in (int(c) for c in a.contexts.split(",")):
            key = mx.random.key(a.seed + context)
            tokens = mx.random.randint(3, vocab, (context,), key=key).tolist()
            for fmt in a.formats.split(","):
                combos = [
                    (int(g), int(r))
                    for g in a.group_sizes.split(",")
                    for r in a.recent.split(",")
                    if head % int(g) == 0
                ]
                for group, recent in combos:
                    t0 = time.perf_counter()
                    s = compare(model, tokens, FORMATS[fmt], group, a.chunk, recent)
                    print(
                        f"| {name} | {context} | {fmt} | {group} | {recent} | {s['kl_mean']:.2e} | "
                        f"{s['kl_max']:.2e} | {s['kl_deep']:.2e} | {100 * s['agree']:.2f}% | "
                        f"{time.perf_counter() - t0:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
