"""What a format per request costs the batch (``--kv-formats``): decode throughput of one
server's requests in one format against a mixed server's, the same requests.

    python -m benchmarks.kv_mix --clients 8 --requests 32 --max-tokens 64 --rounds 2

Three servers, each over loopback HTTP, each with the same ``--kv-cache-mb``: ``own`` is
``--kv-format OWN`` alone, ``float`` the model's type alone, ``mixed`` is ``--kv-format OWN
--kv-formats auto``. The same ``--requests`` prompts go ``--clients`` at a time to each
(non-streamed completions, greedy): to ``own`` and ``float`` in their one format; to
``mixed`` all in OWN (the mixed layout with one format running: what having the choice
costs), then every other one in the model's type (``--other``: rows of two formats in each
step). Rounds alternate the order of the servers. Prints a markdown row per server and
traffic, and each round's ratios: the mixed server's one-format traffic to ``own``'s, its
two-format traffic to the mean of ``own`` and ``float``.
Every server it starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.kv_capacity import serve
from loadtest.runner import WORDS


async def burst(url: str, prompts: list[str], formats: list[str | None], args: Any) -> float:
    """Completion tok/s of ``prompts`` (``formats[i]`` as the i-th's ``kv_format``), at most
    ``args.clients`` in flight."""
    gate = asyncio.Semaphore(args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt: str, fmt: str | None) -> int:
            body: dict[str, Any] = {
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            if fmt is not None:
                body["kv_format"] = fmt
            async with gate:
                r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p, f) for p, f in zip(prompts, formats, strict=True)))
    return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="a local mlx_lm model (default: the embedded one)")
    p.add_argument("--own", default="int8", help="the servers' --kv-format")
    p.add_argument("--other", default="fp32", help="the model's type, as a request names it")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-mb", type=float, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-args", default="", help="more flags for every server")
    p.add_argument(
        "--kv-recent-tokens", type=int, default=0,
        help="a residual window for the servers that hold --own (the float server has none)",
    )  # fmt: skip
    p.add_argument("--out", default="kv-mix")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = a.server_args.split()
    rng = random.Random(0)
    window = ["--kv-recent-tokens", str(a.kv_recent_tokens)] if a.kv_recent_tokens else []
    servers = {
        "own": (a.own, window),
        "float": ("auto", []),
        "mixed": (a.own, ["--kv-formats", "auto", *window]),
    }
    n = a.requests
    print("| round | server | traffic | tok/s |")
    print("|---:|---|---|---:|")
    ratios: dict[str, list[float]] = {"mixed, one format": [], "mixed, two formats": []}
    for r in range(a.rounds):
        # each round its own prompts (the prefix cache shares nothing between servers' runs)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(a.prompt_words)) for _ in range(n)]
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        got: dict[str, float] = {}
        for name in order:
            fmt, more = servers[name]
            port, ctx = serve(a.model_path, fmt, a.kv_cache_mb, extra + more, out / f"{name}.log")
            url = f"http://127.0.0.1:{port}"
            with ctx:
                asyncio.run(burst(url, prompts[: a.clients], [None] * a.clients, a))  # warm
                traffics: list[tuple[str, list[str | None]]] = [("one format", [None] * n)]
                if name == "mixed":
                    traffics.append(("two formats", [a.other if i % 2 else None for i in range(n)]))
                for label, formats in traffics:
                    tok_s = asyncio.run(burst(url, prompts, formats, a))
                    key = name if name != "mixed" else f"mixed, {label}"
                    got[key] = tok_s
                    print(f"| {r + 1} | {name} | {label} | {tok_s:.0f} |", flush=True)
        ratios["mixed, one format"].append(got["mixed, one format"] / got["own"])
        ratios["mixed, two formats"].append(
            got["mixed, two formats"] / ((got["own"] + got["float"]) / 2)
        )
    print()
    against = {"mixed, one format": "own", "mixed, two formats": "mean(own, float)"}
    for key, values in ratios.items():
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"{key} / {against[key]}: {each} (median {statistics.median(values):.2f})")


if __name__ == "__main__":
    main()
