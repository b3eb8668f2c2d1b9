"""A conversation's first turn after a restart, with and without ``--prefix-cache-dir``.

    python -m benchmarks.restart_bench [--model embedded|100m | --model-path DIR]
        [--context-words 450] [--new-words 30] [--repeats 3] [--ours-args "..."] [--logs DIR]
        [--in-memory] [--on-hit]

For each repeat: a server with ``--prefix-cache-dir`` (a fresh directory) answers a chat of
``--context-words`` words (streamed, greedy, 32 tokens) and is stopped with SIGTERM (a clean
stop writes its cached pages); a new server on the same directory gets the next turn (the
conversation, the answer and ``--new-words`` more): it read the directory's conversations into
memory before it was ready (``--prefix-cache-preload-gb``; the time its log gives is reported);
a server without the directory gets the same turn cold. ``--on-hit`` adds a restarted server
that preloads nothing (``--prefix-cache-preload-gb 0``) and reads the pages on the hit. It
reports the TTFTs, their ratio to cold (target: restarted <= 1/3), the tokens the restarted
server found cached, and that the answers are the cold one's tokens. ``--in-memory``
adds a control: one server (no directory) answers the first turn and then the next, which
finds the conversation in its prefix cache in memory; its TTFT and whether its answer is the
cold one's (a difference there too is the reused pages' numerics, not the disk). Every server
is stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.compare import blas_envs, model_dir
from loadtest.proc import free_port, server


def stream_chat(base: str, messages: list[dict], max_tokens: int = 32) -> tuple[float, str, int]:
    """(TTFT in ms, the answer, usage.prompt_tokens_details.cached_tokens) of one stream."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.monotonic()
    ttft, text, cached = None, [], 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            for choice in obj.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft or time.monotonic() - t0
                    text.append(content)
            usage = obj.get("usage") or {}
            cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or cached
    return (ttft or time.monotonic() - t0) * 1000, "".join(text), cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", choices=("embedded", "100m"))
    p.add_argument("--model-path", help="a local mlx_lm model directory instead of --model")
    p.add_argument("--context-words", type=int, default=450)
    p.add_argument("--new-words", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ours-args", default="", help="extra flags for every server")
    p.add_argument("--logs", help="keep the servers' logs in this directory")
    p.add_argument("--in-memory", action="store_true", help="add the same-server control")
    p.add_argument("--on-hit", action="store_true", help="add a restart that reads on the hit")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vq-restart-"))
    logs = Path(args.logs) if args.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    env, _ = blas_envs()
    rows = []
    try:
        path = Path(args.model_path) if args.model_path else model_dir(args.model, work)
        for rep in range(args.repeats):
            rng = random.Random(rep)
            vocab = ["alpha", "beta", "gamma", "delta", "omega", "tool", "result", "file", "line"]
            context = " ".join(rng.choice(vocab) for _ in range(args.context_words))
            messages = [{"role": "system", "content": "You are a coding agent. " + context},
                        {"role": "user", "content": "Read the file."}]  # fmt: skip
            disk = work / f"pages-{rep}"
            runs: dict[str, float] = {}

            def start(extra: list[str], name: str, rep: int = rep):
                port = free_port()
                cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path),
                       "--port", str(port), "--admin-key", "restart-bench-admin",
                       *args.ours_args.split(), *extra]  # fmt: skip
                return port, server(cmd, port, env, logs / f"{name}-{rep}.log")

            port, ctx = start(["--prefix-cache-dir", str(disk)], "first")
            with ctx:
                runs["first"], answer, _ = stream_chat(f"http://127.0.0.1:{port}", messages)
            more = " ".join(rng.choice(vocab) for _ in range(args.new_words))
            follow = [*messages, {"role": "assistant", "content": answer},
                      {"role": "user", "content": more}]  # fmt: skip
            disk2 = work / f"pages-{rep}-again"  # as the first server left it, for --on-hit
            if args.on_hit:
                shutil.copytree(disk, disk2)
            port, ctx = start(["--prefix-cache-dir", str(disk)], "restarted")
            with ctx:
                base = f"http://127.0.0.1:{port}"
                runs["restarted"], warm_answer, cached = stream_chat(base, follow)
            log_text = (logs / f"restarted-{rep}.log").read_text(errors="replace")
            preload = re.search(r"read from disk into memory in ([0-9.]+) s", log_text)
            runs["preload_s"] = float(preload.group(1)) if preload else 0.0
            if args.on_hit:
                extra = ["--prefix-cache-dir", str(disk2), "--prefix-cache-preload-gb", "0"]
                port, ctx = start(extra, "on-hit")
                with ctx:
                    runs["on_hit"], hit_answer, _ = stream_chat(f"http://127.0.0.1:{port}", follow)
                runs["on_hit_same"] = float(hit_answer == warm_answer)
            port, ctx = start([], "cold")
            with ctx:
                runs["cold"], cold_answer, _ = stream_chat(f"http://127.0.0.1:{port}", follow)
            kept_same = None
            if args.in_memory:
                port, ctx = start([], "kept")
                with ctx:
                    base = f"http://127.0.0.1:{port}"
                    stream_chat(base, messages)
                    runs["kept"], kept_answer, _ = stream_chat(base, follow)
                kept_same = kept_answer == cold_answer
            rows.append((runs, cached, warm_answer == cold_answer, kept_same))
            print(f"repeat {rep}: {runs}, cached {cached}, same {warm_answer == cold_answer}, "
                  f"in memory same {kept_same}", file=sys.stderr)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold = statistics.median(r[0]["cold"] for r in rows)
    warm = statistics.median(r[0]["restarted"] for r in rows)
    print(f"{path.name}, a {args.context_words}-word conversation, medians of {args.repeats}:\n")
    print("| first turn after a restart | TTFT ms | / cold | cached tokens | same answer |")
    print("|---|---:|---:|---:|---|")
    print(f"| cold (no --prefix-cache-dir) | {cold:.0f} | 1.00 | 0 | - |")
    print(
        f"| restarted on --prefix-cache-dir | {warm:.0f} | {warm / cold:.2f} | "
        f"{statistics.median(r[1] for r in rows):.0f} | {all(r[2] for r in rows)} |"
    )
    preload = statistics.median(r[0]["preload_s"] for r in rows)
    if args.on_hit:
        hit = statistics.median(r[0]["on_hit"] for r in rows)
        same = all(r[0]["on_hit_same"] for r in rows)
        print(f"| restarted, pages read on the hit (--prefix-cache-preload-gb 0) | {hit:.0f} | "
              f"{hit / cold:.2f} | - | {same} (as restarted) |")  # fmt: skip
    if args.in_memory:
        kept = statistics.median(r[0]["kept"] for r in rows)
        print(
            f"| the same server, cached in memory (control) | {kept:.0f} | {kept / cold:.2f} "
            f"| - | {all(r[3] for r in rows)} |"
        )
    print(f"\nThe restarted server's preload at start (its log): {preload:.2f} s (median).")


if __name__ == "__main__":
    main()
