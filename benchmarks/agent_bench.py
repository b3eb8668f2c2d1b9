"""Agent sessions, ours against mlx_lm.server on the same local model, side by side.

    python -m benchmarks.agent_bench [--models embedded,100m] [--sessions 1,4] [--turns 6]
        [--system-words 500] [--turn-words 20-120] [--max-tokens 32] [--rounds 1]

Starts each server on loopback in turn (same model directory, same BLAS preload, as
``make compare``; one at a time), runs ``loadtest.agent`` against it at every session count, and
prints one Markdown table per model. With ``--rounds N`` it does that N times, each round
starting with the other server, and adds each round's ratios (ours / mlx_lm.server) and
their medians: single sessions on a small CPU swing 10-30% run to run. The defaults fit the
2,048-token context of the CPU models here; on a GPU pass a model with a longer context and
longer sessions. Every process it starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.compare import MODELS, blas_envs, model_dir
from loadtest import agent
from loadtest.proc import free_port, server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="embedded", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--model-path", help="a local mlx_lm model directory instead of --models")
    p.add_argument("--sessions", default="1,4")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=500)
    p.add_argument("--turn-words", default="20-120")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-mb", default="512", help="our KV budget")
    p.add_argument("--ours-args", default="", help="extra flags for our server")
    p.add_argument("--peers", default="mlx_lm", choices=("mlx_lm", "none"))
    p.add_argument("--rounds", type=int, default=1, help="repeats, alternating who goes first")
    p.add_argument("--out", default="agent-bench.md")
    p.add_argument(
        "--logs", help="keep the servers' logs here (with --ours-args '--log-level debug', "
        "python -m benchmarks.slow_steps reads where the slow steps' time went)"
    )  # fmt: skip
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vq-agent-"))
    try:
        lines = run(args, work)
    except BaseException:
        print(f"agent_bench: failed; models and server logs kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def run(args: argparse.Namespace, work: Path) -> list[str]:
    ours_env, env = blas_envs()
    paths = (
        [Path(args.model_path)]
        if args.model_path
        else [model_dir(n, work) for n in args.models.split(",")]
    )
    lines: list[str] = []
    for path in paths:
        port = free_port()
        servers = {
            "ours": ([sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path),
                      "--port", str(port), "--admin-key", "agent-admin",
                      "--kv-cache-mb", args.kv_cache_mb, *args.ours_args.split()], ours_env),
            "mlx_lm.server": ([sys.executable, "-m", "mlx_lm", "server", "--model", str(path),
                               "--port", str(port)], env),
        }  # fmt: skip
        if args.peers == "none":
            del servers["mlx_lm.server"]
        rounds: list[list[agent.AgentSummary]] = []
        for r in range(args.rounds):
            order = list(servers.items())
            if r % 2:
                order.reverse()
            rows = []
            # One server at a time: two MLX servers on one GPU compete for its memory (MLX keeps
            # freed buffers cached), which once made both fail.
            for name, (cmd, server_env) in order:
                logs = Path(args.logs) if args.logs else work
                logs.mkdir(parents=True, exist_ok=True)
                with server(cmd, port, server_env, logs / f"{name}-{r + 1}.log"):
                    model = [] if name == "ours" else ["--model", str(path)]
                    lt = agent.parse([
                        "--url", f"http://127.0.0.1:{port}", *model,
                        "--sessions", args.sessions, "--turns", str(args.turns),
                        "--system-words", str(args.system_words),
                        "--turn-words", args.turn_words, "--max-tokens", str(args.max_tokens),
                    ])  # fmt: skip
                    found = asyncio.run(agent.levels(lt))
                    rows += [dataclasses.replace(s, label=name) for s in found]
            rounds.append(rows)
            first = f", round {r + 1} ({order[0][0]} first)" if args.rounds > 1 else ""
            lines.append(f"### {path.name}{first}\n")
            lines += agent.table(sorted(rows, key=lambda s: (s.sessions, s.label)))
            lines += [
                f"\n{s.label} at {s.sessions}: {s.first_error}" for s in rows if s.first_error
            ]
            lines.append("")
        if args.rounds > 1 and len(servers) > 1:
            lines += ratios(path.name, rounds)
    return lines


def ratios(name: str, rounds: list[list[agent.AgentSummary]]) -> list[str]:
    """Per session count: each round's ours / mlx_lm.server for throughput and TTFT p50 and
    p99, and the median of the rounds."""
    lines = [
        f"### {name}: ours / mlx_lm.server by round (median)\n",
        "| sessions | tok/s | TTFT p50 | TTFT p99 |",
        "|---:|---|---|---|",
    ]
    levels = sorted({s.sessions for rows in rounds for s in rows})
    for level in levels:
        cells = []
        for field in ("tok_s", "ttft_p50", "ttft_p99"):
            found = []
            for rows in rounds:
                by = {s.label: s for s in rows if s.sessions == level}
                ours, theirs = by.get("ours"), by.get("mlx_lm.server")
                if ours and theirs and getattr(theirs, field):
                    found.append(getattr(ours, field) / getattr(theirs, field))
            each = " / ".join(f"{x:.2f}x" for x in found)
            cells.append(f"{each} (**{statistics.median(found):.2f}x**)" if found else "-")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return [*lines, ""]


if __name__ == "__main__":
    main()
