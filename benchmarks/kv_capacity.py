"""How many requests a fixed KV budget runs at once, per ``--kv-format``.

    python -m benchmarks.kv_capacity --n 4 --prompt-words 200 --max-tokens 64

The budget (``--kv-cache-mb``) is sized for ``--n`` requests in full precision: each
request's prompt and ``--max-tokens`` in every layer's K and V, in the model's type. For each
format, one server (ours, over loopback HTTP) with that budget gets ``M`` requests at once,
``M`` = N, ceil(1.8 N) and 3 N (each prompt its own, so the prefix cache shares nothing), and
the benchmark reports how many ran at once (``veloxquant_requests_running``, scraped every 50
ms), how many completed with all their tokens, and the preemptions (``veloxquant_preemptions_
total``): a budget that holds ``M`` runs them all at once with none preempted. Every server it
starts is stopped by pid. Writes a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.proc import free_port, server
from loadtest.runner import WORDS
from veloxquant_mlx.engine.model.default_model import CONFIG

BLOCK_SIZE = 16  # the server's default --block-size


def metric(text: str, name: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return float(s.value)
    return 0.0


async def burst(url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """``prompts`` at once; the peak of requests running meanwhile."""
    peak = 0.0
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def scrape() -> None:
            nonlocal peak
            while not done.is_set():
                text = (await client.get("/metrics")).text
                peak = max(peak, metric(text, "veloxquant_requests_running"))
                await asyncio.sleep(0.05)

        async def one(prompt: str) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return dict(r.json())

        before = metric((await client.get("/metrics")).text, "veloxquant_preemptions_total")
        watcher = asyncio.create_task(scrape())
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - t0
        done.set()
        await watcher
        after = metric((await client.get("/metrics")).text, "veloxquant_preemptions_total")
    full = sum(a["usage"]["completion_tokens"] == max_tokens for a in answers)
    return {
        "peak": int(peak),
        "full": full,
        "preempted": int(after - before),
        "prompt_tokens": max(a["usage"]["prompt_tokens"] for a in answers),
        "tok_s": sum(a["usage"]["completion_tokens"] for a in answers) / seconds,
    }


def serve(model: str | None, fmt: str, budget_mb: float, extra: list[str], log: Path) -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--port", str(port),
           "--kv-cache-mb", f"{budget_mb:.4f}", "--kv-format", fmt, "--max-running", "256",
           "--max-queue", "1024", "--log-level", "warning", *extra]  # fmt: skip
    if model:
        cmd += ["--model", model]
    return port, server(cmd, port, dict(os.environ), log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="a local mlx_lm model (default: the embedded one)")
    p.add_argument("--n", type=int, default=4, help="full-precision requests the budget holds")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--formats", default="auto,int8,int4")
    p.add_argument("--server-args", default="", help="more flags for our server")
    p.add_argument(
        "--recent", type=int, default=0, help="--kv-recent-tokens for the quantized formats"
    )
    p.add_argument("--out", default="kv-capacity")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = a.server_args.split()
    rng = random.Random(0)

    def prompts(m: int) -> list[str]:
        return [" ".join(rng.choice(WORDS) for _ in range(a.prompt_words)) for _ in range(m)]

    # the full-precision geometry: one block's bytes and the layers, from a probe server
    port, ctx = serve(a.model_path, "auto", 64, extra, out / "probe.log")
    with ctx:
        info = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        per_block = metric(info, "veloxquant_kv_bytes_per_block")
        probe = asyncio.run(burst(f"http://127.0.0.1:{port}", prompts(1), a.max_tokens))
    tokens = probe["prompt_tokens"] + a.max_tokens + 1
    blocks = math.ceil(tokens / BLOCK_SIZE)
    config = CONFIG  # every layer's K and V: the layers from the model's config
    if a.model_path:
        config = json.loads((Path(a.model_path) / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    per_request = 2 * layers * blocks * per_block
    budget_mb = a.n * per_request / 2**20
    print(
        f"budget {budget_mb:.2f} MiB: {a.n} requests of {tokens} tokens in full precision "
        f"({per_request / 2**20:.3f} MiB each)"
    )
    print(
        "| format | window | requests at once | ran at once | completed in full | preempted "
        "| tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fmt in a.formats.split(","):
        window = ["--kv-recent-tokens", str(a.recent)] if a.recent and fmt != "auto" else []
        port, ctx = serve(a.model_path, fmt, budget_mb, extra + window, out / f"{fmt}.log")
        with ctx:
            for m in sorted({a.n, math.ceil(1.8 * a.n), 3 * a.n}):
                r = asyncio.run(burst(f"http://127.0.0.1:{port}", prompts(m), a.max_tokens))
                print(
                    f"| {fmt} | {window[1] if window else 0} | {m} | {r['peak']} | "
                    f"{r['full']} | {r['preempted']} | {r['tok_s']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
