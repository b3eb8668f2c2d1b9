"""Replicas behind a router, on loopback: one replica alone, two behind SMG's cache-aware policy,
two behind SMG's round robin, the same multi-turn load on each, side by side in one run.

    python -m benchmarks.replicas --concurrency 8 --requests 96 --turns 4 \\
        --shared-prefix-words 300 --out DIR

Replicas join the router by themselves (``--register-with``); the router health-checks
``/ready`` and polls ``/v1/loads``. Reports output tok/s, TTFT p50/p99 and the prefix hit rate
(cached prompt tokens over prompt tokens, from every response's usage). Writes
``replicas.json`` and ``replicas.md`` in ``--out``; every process it starts is stopped by pid.
On one machine the replicas share its cores: the figure that carries over to a fleet is the hit
rate (how well the policy keeps a conversation where its prefix is cached), not the tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.__main__ import level, parse
from loadtest.proc import free_port, server, smg_router


def wait(check: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def ready_workers(url: str) -> int:
    listing = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
    return sum(1 for w in listing if w.get("status") == "ready" and w.get("is_healthy"))


def replica_cmd(port: int, a: argparse.Namespace, router_url: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--port", str(port), "--blas", a.blas,
           "--log-level", "warning", *a.server_args.split()]  # fmt: skip
    return cmd + (["--register-with", router_url] if router_url else [])


def measure(lt: argparse.Namespace, url: str, a: argparse.Namespace, label: str) -> dict:
    asyncio.run(level(lt, url, a.model, 2, "warm-up", n_requests=4))
    s = asyncio.run(level(lt, url, a.model, a.concurrency, label, n_requests=a.requests))
    out = {
        "tok_s": s.output_tokens_per_s,
        "ttft_p50_ms": s.ttft_s["p50"] * 1e3,
        "ttft_p99_ms": s.ttft_s["p99"] * 1e3,
        "errors": float(sum(s.errors_by_status.values())),
        "prefix_hit_rate": s.prefix_hit_rate,
    }
    print(f"{label}: {out}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--shared-prefix-words", type=int, default=300)
    p.add_argument("--prompt-words", default="20-40")
    p.add_argument("--max-tokens", default="16-32")
    p.add_argument("--model", default="veloxquant-tiny-llama")
    p.add_argument("--blas", default="auto")
    p.add_argument("--server-args", default="", help="extra flags for every replica")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lt = parse(["--prompt-words", a.prompt_words, "--max-tokens", a.max_tokens, "--turns",
                str(a.turns), "--shared-prefix-words", str(a.shared_prefix_words), "--api",
                "chat", "--no-leak-check"])  # fmt: skip
    results: dict[str, Any] = {"args": vars(a)}
    port = free_port()
    with server(replica_cmd(port, a, None), port, dict(os.environ), out / "one.log"):
        results["one replica"] = measure(lt, f"http://127.0.0.1:{port}", a, "one replica")
    for policy in ("cache_aware", "round_robin"):
        with smg_router(policy, out / f"smg-{policy}.log") as url, contextlib.ExitStack() as stack:
            for k in range(2):
                port = free_port()
                log = out / f"{policy}-{k}.log"
                stack.enter_context(server(replica_cmd(port, a, url), port, dict(os.environ), log))
            wait(lambda url=url: ready_workers(url) == 2, "two workers in the router")
            name = f"two behind SMG {policy}"
            results[name] = measure(lt, url, a, name)
    (out / "replicas.json").write_text(json.dumps(results, indent=2) + "\n")
    base = results["one replica"]["tok_s"]
    lines = ["| setup | tok/s | vs one | TTFT p50 / p99 ms | prefix hit rate | errors |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in results.items():
        if name == "args":
            continue
        lines.append(
            f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p99_ms']:.0f} | {r['prefix_hit_rate']:.0%} | {r['errors']:.0f} |"
        )
    (out / "replicas.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
