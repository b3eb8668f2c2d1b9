"""Agent sessions, ours against mlx_lm.server on the same local model, side by side.

    python -m benchmarks.agent_bench [--models embedded,100m] [--sessions 1,4] [--turns 6]
        [--system-words 500] [--turn-words 20-120] [--max-tokens 32]

Starts each server on loopback in turn (same model directory, same BLAS preload, as
``make compare``; one at a time), runs ``loadtest.agent`` against it at every session count, and
prints one Markdown table per model. The defaults fit the 2,048-token context of the CPU
models here; on a GPU pass a model with a longer context and longer sessions. Every process it
starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
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
    p.add_argument("--out", default="agent-bench.md")
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
        rows = []
        # One server at a time: two MLX servers on one GPU compete for its memory (MLX keeps
        # freed buffers cached), which once made both fail.
        for name, (cmd, server_env) in servers.items():
            with server(cmd, port, server_env, work / f"{name}.log"):
                model = [] if name == "ours" else ["--model", str(path)]
                lt = agent.parse([
                    "--url", f"http://127.0.0.1:{port}", *model,
                    "--sessions", args.sessions, "--turns", str(args.turns),
                    "--system-words", str(args.system_words), "--turn-words", args.turn_words,
                    "--max-tokens", str(args.max_tokens),
                ])  # fmt: skip
                rows += [dataclasses.replace(r, label=name) for r in asyncio.run(agent.levels(lt))]
        lines.append(f"### {path.name}\n")
        lines += agent.table(sorted(rows, key=lambda r: (r.sessions, r.label)))
        lines += [f"\n{r.label} at {r.sessions}: {r.first_error}" for r in rows if r.first_error]
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
