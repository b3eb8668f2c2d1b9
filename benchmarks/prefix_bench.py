"""Prefix caching: time to first token of a request whose long prefix is cached, against cold.

    python -m benchmarks.prefix_bench [--model embedded|100m|PATH] [--prefix-tokens 1980]
                                      [--rounds 5] [--peers mlx_lm] [--out prefix.json]
                                      [--ours-args "..."] [--logs DIR]

For each round a new shared prefix of about ``--prefix-tokens`` tokens (random words) is sent
twice, each time with a different short question, as streaming completions with one output
token: the first request is cold (nothing of it cached), the second finds the prefix cached.
A third request is a cold prompt of about as many tokens as the second had to prefill (its
uncached ones, fresh words): what only the new tokens cost, the base of the target that a
cached turn's TTFT stays within 1.5x of it plus 30 ms.
Measured on our server, then on each peer (``mlx_lm``: mlx_lm.server with its prompt cache) on
the same model, over loopback HTTP, side by side in one run; medians over the rounds, the
``cached_tokens`` each server reported, and hit / cold ratios. Every server it starts is stopped
by pid before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.compare import model_dir
from benchmarks.serving import words_for
from loadtest.proc import free_port, server
from loadtest.runner import WORDS, Scenario, one


def measure(url: str, model: str, words: int, rounds: int, per_token: float) -> dict[str, Any]:
    """``per_token``: words a token of random words takes (``words_for``)."""
    sc = Scenario(base_url=url, model=model, stream=True, temperature=0.0)

    async def go() -> dict[str, Any]:
        cold, hit, cached, new_cold, new_tokens = [], [], [], [], []
        async with httpx.AsyncClient(timeout=300) as client:
            await one(client, sc, model, "warm up", 1)
            for r in range(rounds + 1):  # round 0 warms up the long-prompt kernels
                rng = random.Random(1000 + r)
                prefix = f"round {r}: " + " ".join(rng.choice(WORDS) for _ in range(words))
                a = await one(client, sc, model, f"{prefix}\nQ: what is first?", 1)
                b = await one(client, sc, model, f"{prefix}\nQ: and the last?", 1)
                assert a.ok and b.ok, (a.error, b.error)
                n_new = b.prompt_tokens - b.cached_tokens
                fresh = " ".join(rng.choice(WORDS) for _ in range(max(1, int(n_new * per_token))))
                c = await one(client, sc, model, f"fresh {r}: {fresh}", 1)
                assert c.ok, c.error
                if r:
                    cold.append(a.ttft)
                    hit.append(b.ttft)
                    cached.append(b.cached_tokens)
                    new_cold.append(c.ttft)
                    new_tokens.append((n_new, c.prompt_tokens))
        return {
            "cold_ttft_ms": statistics.median(cold) * 1e3,
            "hit_ttft_ms": statistics.median(hit) * 1e3,
            "ratio": statistics.median(hit) / statistics.median(cold),
            "cached_tokens": statistics.median(cached),
            "prompt_tokens": a.prompt_tokens,
            "new_tokens": statistics.median(n for n, _ in new_tokens),
            "new_cold_tokens": statistics.median(n for _, n in new_tokens),
            "new_cold_ttft_ms": statistics.median(new_cold) * 1e3,
        }

    return asyncio.run(go())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", help="embedded, 100m, or a model directory")
    p.add_argument("--prefix-tokens", type=int, default=1980)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--peers", default="mlx_lm", help="comma list: mlx_lm, or empty")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    p.add_argument("--ours-args", default="", help="extra flags for our server")
    p.add_argument("--logs", help="keep the servers' logs in this directory")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = model_dir(a.model, work) if a.model in ("embedded", "100m") else Path(a.model)
        words = words_for(path, a.prefix_tokens)
        logs = Path(a.logs) if a.logs else work
        logs.mkdir(parents=True, exist_ok=True)
        results: dict[str, Any] = {"model": a.model, "prefix_tokens": a.prefix_tokens}
        port = free_port()
        ours = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path),
                "--port", str(port), "--log-level", "warning", *a.ours_args.split()]  # fmt: skip
        runs = [("ours", ours, port, None)]
        if "mlx_lm" in a.peers.split(","):
            peer_port = free_port()
            peer = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path),
                    "--port", str(peer_port)]  # fmt: skip
            runs.append(("mlx_lm", peer, peer_port, str(path)))  # it serves the path as its id
        for name, cmd, port, served in runs:
            with server(cmd, port, dict(os.environ), logs / f"{name}.log"):
                url = f"http://127.0.0.1:{port}"
                model = served or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
                results[name] = measure(url, model, words, a.rounds, words / a.prefix_tokens)
            print(name, json.dumps(results[name]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(
        "| server | cold TTFT ms | hit TTFT ms | hit / cold | cached tokens | new tokens | "
        "cold TTFT of a prompt that long ms | 1.5x that + 30 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("ours", "mlx_lm"):
        if name in results:
            r = results[name]
            bound = 1.5 * r["new_cold_ttft_ms"] + 30
            print(
                f"| {name} | {r['cold_ttft_ms']:.0f} | {r['hit_ttft_ms']:.0f} | "
                f"{r['ratio']:.2f} | {r['cached_tokens']:.0f} of {r['prompt_tokens']} | "
                f"{r['new_tokens']:.0f} | {r['new_cold_ttft_ms']:.0f} "
                f"({r['new_cold_tokens']:.0f} tokens) | {bound:.0f} |"
            )


if __name__ == "__main__":
    main()
