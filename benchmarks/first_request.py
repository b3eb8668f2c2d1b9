"""A fresh server's first chat requests: what the first one pays that later ones do not.

    python -m benchmarks.first_request [--model embedded|100m | --model-path DIR]
        [--requests 4] [--words 60] [--repeats 3] [--ours-args "..."]

For each repeat a new server (``--blas auto``'s library, like ``benchmarks.compare``) answers
``--requests`` streamed chat requests of ``--words`` words each, one after another, each with
its own words (no prefix shared past the template); it reports the median time to the first
chunk with text of each request's position: the first against the rest. Every server is
stopped by pid.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.compare import blas_envs, model_dir
from benchmarks.restart_bench import stream_chat
from loadtest.proc import free_port, server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", choices=("embedded", "100m"))
    p.add_argument("--model-path", help="a local mlx_lm model directory instead of --model")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ours-args", default="", help="extra flags for the server")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vq-first-"))
    env, _ = blas_envs()
    ttfts: list[list[float]] = [[] for _ in range(args.requests)]
    hits: list[list[int]] = [[] for _ in range(args.requests)]
    try:
        path = Path(args.model_path) if args.model_path else model_dir(args.model, work)
        for rep in range(args.repeats):
            port = free_port()
            cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path),
                   "--port", str(port), "--admin-key", "first-request-admin",
                   *args.ours_args.split()]  # fmt: skip
            rng = random.Random(rep)
            vocab = ["alpha", "beta", "gamma", "delta", "omega", "tool", "result", "file"]
            with server(cmd, port, env, work / f"server-{rep}.log"):
                for i in range(args.requests):
                    words = " ".join(rng.choice(vocab) for _ in range(args.words))
                    messages = [{"role": "user", "content": f"{rep}.{i} {words}"}]
                    base = f"http://127.0.0.1:{port}"
                    ttft, _, cached = stream_chat(base, messages, max_tokens=8)
                    ttfts[i].append(ttft)
                    hits[i].append(cached)
            times = ", ".join(f"{t[-1]:.0f}" for t in ttfts)
            found = ", ".join(str(h[-1]) for h in hits)
            print(f"repeat {rep}: TTFT ms {times}; cached tokens {found}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rest = statistics.median(t for ts in ttfts[1:] for t in ts) if args.requests > 1 else 0.0
    print(f"{path.name}, {args.words}-word chat requests, medians of {args.repeats} servers:\n")
    print("| request on a fresh server | TTFT ms | / later requests |")
    print("|---|---:|---:|")
    for i, ts in enumerate(ttfts):
        med = statistics.median(ts)
        ratio = f"{med / rest:.2f}" if rest else "-"
        print(f"| {i + 1} | {med:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
