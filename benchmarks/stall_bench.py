"""How long a long prompt arriving pauses the streams already decoding, per prefill budget.

    python -m benchmarks.stall_bench [--model embedded|100m] [--budgets auto,2048,512,64]
        [--parts 1,4] [--prompt-tokens 1900] [--streams 2] [--repeats 3] [--from-disk]

For each budget (and each ``--parts``: ``--prefill-parts P``, a chunk launched over P steps, a
run of its layers each) it starts our server (``--prefill-budget B``, the prompt tokens a step
carries beside decoding rows; ``auto`` leaves it to the backend's default;
``--stream-interval-ms 0`` so every token is seen as it is made) and measures:

- the long prompt's cold prefill alone: TTFT of a fresh prompt of ``--prompt-tokens`` tokens;
- the stall: ``--streams`` streams decoding, then a fresh long prompt arrives; the longest gap
  between two tokens of any stream while it is prefilled, against the streams' median gap.

With ``--from-disk`` the prompt that arrives is not fresh but a known one whose pages are on
disk: the server runs with ``--prefix-cache-dir``, the cold prompt's pages are sent there
(``POST /admin/prefix-cache/reset`` evicts them, the writer writes them), and the same prompt
plus a few tokens arrives while the streams decode, so the stall is what reading its pages
costs the others.

The target (issue: prefill never stalls decoding) is a stall of at most about a tenth of the
cold prefill on a CPU. Every server it starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.compare import blas_envs, model_dir
from loadtest.proc import free_port, server

ADMIN_KEY = "stall-bench-admin"


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, times: list[float], any_chunk: bool = False
) -> None:
    """Stream ``body``'s completion, appending each text chunk's arrival time to ``times``
    (``any_chunk``: every chunk's, an empty first text or the finish included)."""
    async with client.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                obj = json.loads(line[5:])
                choices = obj.get("choices") or ()
                if choices and (any_chunk or any(c.get("text") for c in choices)):
                    times.append(time.monotonic())


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


async def _to_disk(client: httpx.AsyncClient, base: str, n_pages: int) -> None:
    """Evict every cached page and wait (10 s at most) until the disk holds ``n_pages``."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = await client.post(f"{base}/admin/prefix-cache/reset", headers=admin, timeout=30)
    r.raise_for_status()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = (await client.get(f"{base}/metrics", timeout=30)).text
        pages = [
            ln for ln in text.splitlines() if ln.startswith("veloxquant_prefix_cache_disk_pages")
        ]
        if pages and float(pages[0].split()[-1]) >= n_pages:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the disk tier did not get the pages")


async def measure(
    base: str, prompt_tokens: int, streams: int, seed: int, from_disk: bool = False
) -> dict[str, float]:
    rng = random.Random(seed)
    url = f"{base}/v1/completions"
    long = {"prompt": _prompt(rng, prompt_tokens), "max_tokens": 1, "temperature": 0,
            "stream": True}  # fmt: skip
    async with httpx.AsyncClient() as client:
        first: list[float] = []
        t0 = time.monotonic()
        await _stream(client, url, long, first, any_chunk=True)
        cold = first[0] - t0
        arriving = _prompt(rng, prompt_tokens)
        if from_disk:
            await _to_disk(client, base, prompt_tokens // 16)
            arriving = long["prompt"] + _prompt(rng, 8)
        times: list[list[float]] = [[] for _ in range(streams)]
        body = {"max_tokens": 300, "temperature": 0, "stream": True}
        tasks = [
            asyncio.create_task(_stream(client, url, {**body, "prompt": _prompt(rng, 16)}, t))
            for t in times
        ]
        while min(len(t) for t in times) < 20:
            await asyncio.sleep(0.01)
        arrived: list[float] = []
        sent = time.monotonic()
        await _stream(client, url, {**long, "prompt": arriving}, arrived, any_chunk=True)
        done = arrived[0] + 0.2
        while min(t[-1] for t in times) < done and not all(task.done() for task in tasks):
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gaps_before = [b - a for t in times for a, b in itertools.pairwise(t) if b < sent]
        stall = max(
            (b - a for t in times for a, b in itertools.pairwise(t) if b > sent and a < done),
            default=0.0,
        )
    return {
        "cold_ms": cold * 1000,
        "stall_ms": stall * 1000,
        "stall_over_cold": stall / cold,
        "itl_p50_ms": statistics.median(gaps_before) * 1000 if gaps_before else float("nan"),
        "ttft_loaded_ms": (arrived[0] - sent) * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", choices=("embedded", "100m"))
    p.add_argument("--budgets", default="auto,2048,512,64")
    p.add_argument("--parts", default="1", help="--prefill-parts values, e.g. 1,4")
    p.add_argument("--prompt-tokens", type=int, default=1900)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--from-disk", action="store_true", help="a known prompt, read from disk")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vq-stall-"))
    ours_env, _ = blas_envs()
    rows = []
    try:
        path = model_dir(args.model, work)
        for budget, parts in itertools.product(args.budgets.split(","), args.parts.split(",")):
            port = free_port()
            cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path),
                   "--port", str(port), "--admin-key", ADMIN_KEY,
                   "--stream-interval-ms", "0"]  # fmt: skip
            if args.from_disk:
                cmd += ["--prefix-cache-dir", str(work / f"pages-{budget}")]
            else:
                cmd += ["--no-prefix-caching"]
            if budget != "auto":
                cmd += ["--prefill-budget", budget]
            cmd += ["--prefill-parts", parts]
            with server(cmd, port, ours_env, work / f"ours-{budget}-{parts}.log"):
                base = f"http://127.0.0.1:{port}"
                runs = [
                    asyncio.run(
                        measure(base, args.prompt_tokens, args.streams, seed, args.from_disk)
                    )
                    for seed in range(args.repeats)
                ]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((budget, parts, med))
            print(f"budget {budget}, parts {parts}: {med}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = "known (its pages on disk)" if args.from_disk else "fresh"
    print(f"{args.model} model, a {what} {args.prompt_tokens}-token prompt arriving while "
          f"{args.streams} streams decode (medians of {args.repeats}):\n")  # fmt: skip
    print(
        "| prefill budget | parts | cold prefill ms | stall ms | stall / cold | ITL p50 ms "
        "| loaded TTFT ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for budget, parts, m in rows:
        print(
            f"| {budget} | {parts} | {m['cold_ms']:.0f} | {m['stall_ms']:.0f} | "
            f"{m['stall_over_cold']:.2f} | {m['itl_p50_ms']:.1f} | {m['ttft_loaded_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
