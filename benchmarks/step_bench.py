"""The engine in process against mlx_lm, per KV layout and launch mode: tok/s and peak memory.

    python -m benchmarks.step_bench --shape 1b --concurrency 1,32,128 --max-tokens 64-192

No HTTP: ``c`` client threads keep ``c`` requests in the engine (closed loop) until ``--per-level``
requests have finished, for each ``--layouts`` x ``--launch`` variant; side by side in the same
process, mlx_lm's ``BatchGenerator`` with every request inserted up front (batch ``c``) and, at
one client, ``generate_step`` with stock caches (single-stream decode). Peak memory is MLX's
(``mx.get_peak_memory``) over the run, beside the model's own bytes.

``--attention sdpa,matmul`` also runs each variant per ragged-attention mode
(``kv/attention.py``; ``auto`` alone by default), keyed ``LAYOUT/LAUNCH/MODE``.

``--launch ahead`` starts a step as soon as it is built, one step ahead of the tokens being read;
``after`` waits for the previous step to finish first; ``auto`` (the default) is the engine's:
the layout's choice (dense ahead, paged after: ``kv/paged.py`` says why).
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.serving import SHAPES, layout_config, write_model


def bench_model(
    shape: str, dtype: str | None, work: str | None, prefix: str
) -> tuple[Path, Any, str]:
    """A random-weight model of ``shape`` written under ``work`` (default: a tmp dir, removed
    when the process exits: an 8B shape is 16 GB) and loaded: (its directory, the model, its
    dtype: bfloat16 on a GPU, float32 on a CPU unless given)."""
    import mlx.core as mx
    import mlx_lm

    dtype = dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    if work is None:
        work = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, work, True)
    target = Path(work)
    path = write_model(target / f"{shape}-{dtype}", shape, dtype)
    model, _ = mlx_lm.load(str(path))
    return path, model, dtype


def closed_loop(engine: Any, c: int, n: int, prompts: list[list[int]], lengths: list[int]) -> float:
    """``c`` threads each submitting the next request when theirs finishes; output tok/s."""
    from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    lock = threading.Lock()
    state = {"next": 0, "tokens": 0}

    def client() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= n:
                    return
                state["next"] += 1
            h = engine.submit(GenerationRequest(tuple(prompts[i]), lengths[i], greedy))
            tokens, _ = h.collect(600)
            with lock:
                state["tokens"] += len(tokens)

    threads = [threading.Thread(target=client) for _ in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return state["tokens"] / (time.perf_counter() - t0)


def library(model: Any, c: int, prompts: list[list[int]], lengths: list[int]) -> float:
    """BatchGenerator alone, every request inserted up front, at most ``c`` decoding: tok/s.

    Its prefill batch is at most ``c`` too: a prefilled batch joins the decoding one whole, so
    with 8 (as here before 2026-12-02, eighth session) "one client" decoded three requests at
    once (575 tok/s on the H200's 1B shape, against stock ``generate_step``'s 377)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model, stop_tokens=[], completion_batch_size=c, prefill_batch_size=min(c, 8)
    )
    t0 = time.perf_counter()
    gen.insert(prompts, lengths)
    produced, total = 0, sum(lengths)
    while produced < total:
        _, responses = gen.next()
        produced += len(responses)
    mx.synchronize()
    rate = produced / (time.perf_counter() - t0)
    gen.close()
    return rate


def single_stream(model: Any, prompt: list[int], n: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    count = sum(1 for _ in generate_step(mx.array(prompt), model, max_tokens=n))
    return count / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", default="128", help="N or LO-HI (varied lengths)")
    p.add_argument("--per-level", type=int, default=0, help="requests per level (default 3c)")
    p.add_argument("--layouts", default="dense,paged")
    p.add_argument("--launch", default="auto", help="auto (the layout's), ahead, after")
    p.add_argument("--peers", default="library,stock")
    p.add_argument("--attention", default="auto", help="ragged attention modes, e.g. sdpa,matmul")
    p.add_argument("--kv-cache-mb", type=float, default=1024)
    p.add_argument("--work", default=None, help="where the model is written (default: a tmp dir)")
    p.add_argument("--out", default=None, help="write step_bench.json here")
    args = p.parse_args()

    import mlx.core as mx

    from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig

    path, model, dtype = bench_model(args.shape, args.dtype, args.work, "vq-step-")
    model_bytes = mx.get_active_memory()
    lo, _, hi = args.max_tokens.partition("-")
    bounds = (int(lo), int(hi or lo))
    peers = [s for s in args.peers.split(",") if s]
    levels = [int(c) for c in args.concurrency.split(",")]
    results: list[dict[str, Any]] = []
    print(
        f"step_bench: MLX {mx.__version__} on {mx.default_device()}, {args.shape} {dtype}, "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} new tokens; model "
        f"{model_bytes / 2**20:.0f} MiB",
        flush=True,
    )
    for c in levels:
        n = args.per_level or 3 * c
        rng = random.Random(c)
        prompts = [[rng.randrange(3, 2000) for _ in range(args.prompt_tokens)] for _ in range(n)]
        lengths = [rng.randint(*bounds) for _ in range(n)]
        row: dict[str, Any] = {"clients": c, "requests": n}
        if "library" in peers:
            library(model, c, prompts[: min(n, 2 * c)], lengths[: min(n, 2 * c)])  # warm up
            mx.reset_peak_memory()
            row["library"] = library(model, c, prompts, lengths)
            row["library_peak_mib"] = mx.get_peak_memory() / 2**20
        if "stock" in peers and c == 1:
            single_stream(model, prompts[0], 16)
            row["stock_single"] = single_stream(model, prompts[0], bounds[1])
        modes = args.attention.split(",")
        variants = [
            (layout, launch, mode)
            for layout in args.layouts.split(",")
            for launch in args.launch.split(",")
            for mode in modes
        ]
        for layout, launch, mode in variants:
            key = f"{layout}/{launch}" + (f"/{mode}" if len(modes) > 1 else "")
            while key in row:  # a mode given twice (to alternate the order): its second run
                key += "+"
            engine = Engine(
                EngineConfig(
                    model=str(path),
                    dtype=dtype,
                    **layout_config(layout),
                    ragged_attention=mode,
                    kv_cache_mb=args.kv_cache_mb,
                    max_running=max(c, 1),
                    max_queue=4 * n,
                    launch_after_previous={"ahead": False, "after": True}.get(launch),
                )
            ).start()
            try:
                engine.wait_ready(600)
                closed_loop(engine, c, min(n, 2 * c), prompts, lengths)  # warm up
                mx.reset_peak_memory()
                rate = closed_loop(engine, c, n, prompts, lengths)
                row[key] = rate
                print(f"  c={c} {key}: {rate:.0f} tok/s", flush=True)
                row[f"{key}_peak_mib"] = mx.get_peak_memory() / 2**20
                row[f"{key}_preemptions"] = engine.stats().preemptions_total
            finally:
                engine.shutdown(30)
                mx.clear_cache()
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
