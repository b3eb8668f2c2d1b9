"""The softmax of attention on a CPU: MLX's ``exp`` against powers of two (grouped attention).

    python -m benchmarks.softmax_bench [--models embedded,100m] [--cached 0,1000,2000]
        [--new 1,64,200,512]

First the element cost of ``mx.exp`` and ``mx.power(2, x)`` (ns an element, 2M float32), then
one forward of each model: ``new`` tokens over ``cached`` tokens already in stock mlx_lm
caches, with mlx_lm's attention (``mx.fast.scaled_dot_product_attention``) and with
``kv.chunk_attention.grouped_attention`` with the softmax as powers of two by MLX
(``--attention-softmax exp2``) and by numpy on the host (``host``, the CPU default for prefill
chunks; a decode step keeps MLX's), alternating, the median of ``--repeats``. ``new`` = 1 is a
decode step. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.compare import MODELS, model_dir


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median milliseconds of ``fn`` evaluated."""
    import mlx.core as mx

    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def element_costs(repeats: int) -> tuple[float, float]:
    """Nanoseconds an element of ``mx.exp`` and of ``mx.power(2, x)``."""
    import mlx.core as mx

    n = 2_000_000
    x = mx.random.uniform(-20.0, 0.0, (n,))
    two = mx.array(2.0)
    mx.eval(x)
    return (
        timed(lambda: mx.exp(x), repeats) * 1e6 / n,
        timed(lambda: mx.power(two, x), repeats) * 1e6 / n,
    )


def forward_ms(model: Any, cached: int, new: int, repeats: int, route: str) -> float:
    """One forward of ``new`` tokens over ``cached`` tokens (stock caches, prefilled in
    512-token chunks first), attention by MLX's (``route`` "mlx") or by ``grouped_attention``
    ("exp2", "host")."""
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.kv.chunk_attention import grouped_attention

    def ours(q: Any, k: Any, v: Any, cache: Any, scale: float, mask: Any, sinks: Any = None):
        return grouped_attention(q, k, v, scale, mask, True, route == "host")

    module = __import__(type(model).__module__, fromlist=["x"])
    original = base.scaled_dot_product_attention
    times = []
    try:
        module.scaled_dot_product_attention = original if route == "mlx" else ours
        for _ in range(repeats):
            cache = make_prompt_cache(model)
            prompt = mx.array([[5] * cached])
            for i in range(0, cached, 512):
                model(prompt[:, i : i + 512], cache=cache)
                mx.eval([c.state for c in cache])
            t = time.perf_counter()
            mx.eval(model(mx.array([[7] * new]), cache=cache)[:, -1, :])
            times.append(time.perf_counter() - t)
    finally:
        module.scaled_dot_product_attention = original
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="embedded", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--cached", default="0,1000,2000")
    p.add_argument("--new", default="1,64,200,512")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import mlx.core as mx
    from mlx_lm import load

    exp_ns, pow_ns = element_costs(args.repeats * 3)
    device = mx.default_device()
    print(f"mx.exp {exp_ns:.1f} ns an element, mx.power(2, x) {pow_ns:.1f} ns ({device})")
    print()
    print("| model | cached | new | MLX's attention ms | exp2 ms | host ms | exp2 speed-up | "
          "host speed-up |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    work = Path(tempfile.mkdtemp(prefix="vq-softmax-"))
    try:
        for name in args.models.split(","):
            model, _ = load(str(model_dir(name, work)))
            for cached in (int(c) for c in args.cached.split(",")):
                for new in (int(n) for n in args.new.split(",")):
                    stock, exp2, host = (forward_ms(model, cached, new, args.repeats, route)
                                         for route in ("mlx", "exp2", "host"))  # fmt: skip
                    print(f"| {name} | {cached} | {new} | {stock:.1f} | {exp2:.1f} | "
                          f"{host:.1f} | {stock / exp2:.2f}x | {stock / host:.2f}x |")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
