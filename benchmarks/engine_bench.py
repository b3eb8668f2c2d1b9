"""Engine throughput against mlx_lm's batch_generate (stock caches), same process, alternating.

    python -m benchmarks.engine_bench [--runs N]

Aggregate generated tokens/s for 1, 8 and 32 concurrent requests (64-token prompts, 64 new
tokens each, greedy) on the embedded default model: the engine (pool-backed caches, admission,
detokenizing, events) against ``mlx_lm.batch_generate`` on the same prompts. Then the time from
submit to first token of a request that arrives while 32 others are decoding (median, p99).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time

from veloxquant_mlx.blas import blas_in_use, ensure_blas

PROMPT, NEW = 64, 64


def main() -> None:
    ensure_blas(os.environ.get("VQ_BLAS", "auto"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm

    from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig
    from veloxquant_mlx.engine.model.default_model import ensure_default_model
    from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams

    cache_dir = tempfile.mkdtemp(prefix="vq-bench-")
    atexit.register(shutil.rmtree, cache_dir, True)
    model_dir = ensure_default_model(cache_dir)
    model, tokenizer = mlx_lm.load(str(model_dir))
    model.set_dtype(mx.float32)
    engine = Engine(EngineConfig(model_cache_dir=cache_dir, kv_cache_mb=512, max_running=48))
    engine.start().wait_ready(120)
    greedy = SamplingParams(temperature=0.0)

    def prompts(n: int) -> list[list[int]]:
        return [[(11 * i + 7 * r) % 2000 + 7 for i in range(PROMPT)] for r in range(n)]

    def run_engine(n: int) -> float:
        t0 = time.perf_counter()
        hs = [engine.submit(GenerationRequest(tuple(p), NEW, greedy)) for p in prompts(n)]
        total = sum(len(h.collect(600)[0]) for h in hs)
        return total / (time.perf_counter() - t0)

    def run_stock(n: int) -> float:
        t0 = time.perf_counter()
        out = mlx_lm.batch_generate(
            model,
            tokenizer,
            prompts(n),
            max_tokens=NEW,
            return_token_ids=True,
            completion_batch_size=32,
            prefill_batch_size=8,
            prefill_step_size=512,
        )
        total = sum(len(t) for t in out.token_ids)
        return total / (time.perf_counter() - t0)

    print(
        f"engine_bench: MLX {mx.__version__} on {mx.default_device()}, BLAS {blas_in_use()}; "
        f"median of {args.runs} alternating runs, {PROMPT}-token prompts, {NEW} new tokens"
    )
    print("| concurrent requests | batch_generate tok/s | engine tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for n in (1, 8, 32):
        run_engine(n), run_stock(n)  # warm up
        ours, stock = [], []
        for _ in range(args.runs):
            ours.append(run_engine(n))
            stock.append(run_stock(n))
        s, o = statistics.median(stock), statistics.median(ours)
        print(f"| {n} | {s:.1f} | {o:.1f} | {o / s:.3f} |")

    ttft = []
    for _ in range(args.runs):
        background = [engine.submit(GenerationRequest(tuple(p), 400, greedy)) for p in prompts(32)]
        next(iter(background[0].events(60)))  # the batch is decoding
        for p in prompts(8):
            h = engine.submit(GenerationRequest(tuple(p), 4, greedy))
            tokens, _ = h.collect(600)
            ttft.append(tokens[0].time - h.submitted_at)
        for h in background:
            engine.cancel(h)
            h.collect(60)
    ttft.sort()
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    print(
        f"\nsubmit-to-first-token of a request joining a running batch of 32: "
        f"median {statistics.median(ttft) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms "
        f"over {len(ttft)} requests"
    )
    engine.shutdown(10)


if __name__ == "__main__":
    main()
