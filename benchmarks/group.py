"""One model over mx.distributed against one process, on this machine's loopback: the same
closed-loop load on a single ``veloxquant-serve`` and on a group of ``--ranks`` ranks (ring
backend), side by side in one run.

    python -m benchmarks.group --concurrency 1,8 --requests 48 --out DIR [--pipeline]
        [--model PATH] [--ranks 2]

Reports output tok/s and TTFT p50/p99 per level and the group's ratio to one process; writes
``group.json`` and ``group.md`` in ``--out``; every process it starts is stopped by pid. On one
machine the ranks share its cores and talk over loopback: the figure is the cost of the
group's per-step broadcast and collectives, not the speed of machines that each hold a shard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from loadtest.__main__ import level, parse
from loadtest.proc import free_port, ring_hostfile, server, stop


@contextmanager
def group_server(cmd: list[str], port: int, ranks: int, out: Path):
    """``cmd`` as ``ranks`` ranks of one ring group on loopback; rank 0 serves on ``port``."""
    hostfile = ring_hostfile(out, ranks)
    procs: list[subprocess.Popen] = []
    try:
        for rank in reversed(range(ranks)):
            env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
            args = cmd + (["--port", str(port)] if rank == 0 else [])
            with open(out / f"rank{rank}.log", "w") as fh:
                procs.append(subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a rank exited; see {out}/rank*.log")
            with suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield
    finally:
        for proc in reversed(procs):  # rank 0 first: it drains the group
            stop(proc, 60)


def measure(lt: argparse.Namespace, url: str, levels: list[int], n: int, name: str) -> dict:
    asyncio.run(level(lt, url, None, 2, "warm-up", n_requests=4))
    out: dict[str, Any] = {}
    for c in levels:
        s = asyncio.run(level(lt, url, None, c, f"{name} c={c}", n_requests=n))
        out[str(c)] = {
            "tok_s": s.output_tokens_per_s,
            "ttft_p50_ms": s.ttft_s["p50"] * 1e3,
            "ttft_p99_ms": s.ttft_s["p99"] * 1e3,
            "errors": float(sum(s.errors_by_status.values())),
        }
        print(f"{name} c={c}: {out[str(c)]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--pipeline", action="store_true")
    p.add_argument("--model", help="a local mlx_lm model (default: the embedded one)")
    p.add_argument("--max-tokens", default="32-64")
    p.add_argument("--blas", default="auto")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in a.concurrency.split(",")]
    lt = parse(["--max-tokens", a.max_tokens, "--no-leak-check"])
    cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--blas", a.blas, "--log-level",
           "warning", *(["--model", a.model] if a.model else [])]  # fmt: skip
    results: dict[str, Any] = {"args": vars(a)}
    port = free_port()
    with server([*cmd, "--port", str(port)], port, dict(os.environ), out / "one.log"):
        results["one process"] = measure(lt, f"http://127.0.0.1:{port}", levels, a.requests, "one")
    mode = "pipeline" if a.pipeline else "tensor"
    name = f"{a.ranks} ranks, {mode}"
    port = free_port()
    with group_server([*cmd, *(["--pipeline"] if a.pipeline else [])], port, a.ranks, out):
        results[name] = measure(lt, f"http://127.0.0.1:{port}", levels, a.requests, name)
    (out / "group.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| setup | clients | tok/s | vs one | TTFT p50 / p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for setup in ("one process", name):
        for c in levels:
            r, base = results[setup][str(c)], results["one process"][str(c)]
            lines.append(
                f"| {setup} | {c} | {r['tok_s']:.0f} | {r['tok_s'] / base['tok_s']:.2f}x | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['errors']:.0f} |"
            )
    (out / "group.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
