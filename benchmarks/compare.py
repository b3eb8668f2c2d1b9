"""``make compare``: our server against mlx_lm.server on the same local model, side by side.

    python -m benchmarks.compare [--models embedded,100m] [--concurrency 1,8,32] [--requests 64]

Starts both servers on loopback (same model directory, same BLAS preload), runs the same
closed-loop load on each at every concurrency (interleaved: ours, theirs), records peak resident
memory of both processes, then a memory-pressure run on ours (offered KV well over its
``--kv-cache-mb``), and prints one Markdown report (also written to ``--out``). Every process it
starts is stopped by pid before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loadtest.__main__ import level, parse
from loadtest.proc import free_port, peak_rss_mb, server
from loadtest.stats import Record, Summary, percentile, summarize
from veloxquant_mlx.blas import select


@dataclass(slots=True)
class Side:
    """One server's figures at one level, over all rounds."""

    summary: Summary
    steady_ttft_p99: float  # TTFT p99 without each round's first burst
    leak_free: bool


def side_by_side(
    lt: argparse.Namespace, path: str, c: int, rounds: int, requests: int
) -> tuple[Side, Side, list[float]]:
    """``rounds`` rounds at concurrency ``c``, alternating which server goes first; each round
    sends both servers the same fresh prompts (a new seed per level and round, so no server
    answers from a prompt cache). Returns ours, theirs and the per-round tok/s ratios."""
    per_round = max(requests // rounds, 2 * c)  # a burst of c, then at least c more
    records: dict[str, list[Record]] = {"ours": [], "theirs": []}
    steady: dict[str, list[float]] = {"ours": [], "theirs": []}
    wall = {"ours": 0.0, "theirs": 0.0}
    leak_free, ratios = True, []
    for r in range(rounds):
        seed = lt.seed + 1000 * c + r
        order = ["ours", "theirs"] if r % 2 == 0 else ["theirs", "ours"]
        tps = {}
        for who in order:
            url, model = (lt.url, None) if who == "ours" else (lt.compare, path)
            got: list[Record] = []
            s = asyncio.run(
                level(lt, url, model, c, f"{who} c={c} round {r + 1}", seed=seed,
                      n_requests=per_round, records_out=got)
            )  # fmt: skip
            records[who] += got
            wall[who] += s.duration_s
            tps[who] = s.output_tokens_per_s
            late = sorted(got, key=lambda x: x.start)[c:]
            steady[who] += [x.ttft for x in late if x.ok and x.ttft is not None]
            if who == "ours":
                leak_free = leak_free and bool(s.server.get("leak_free"))
        ratios.append(tps["ours"] / max(tps["theirs"], 1e-9))
    out = []
    for who in ("ours", "theirs"):
        s = summarize(who, records[who], wall[who], lt.slo_ttft, lt.slo_tpot)
        out.append(Side(s, percentile(steady[who], 0.99), leak_free))
    return out[0], out[1], ratios


def table(rows: list[tuple[int, Side, Side, list[float]]]) -> list[str]:
    lines = [
        "| concurrency | ours tok/s | mlx_lm.server tok/s | ratio (rounds) | TTFT p50 ms ours / "
        "theirs | TTFT p99 ms ours / theirs | p99 ratio | p99 ratio after ramp-up | "
        "errors ours/theirs | pool free after |",
        "|---:|---:|---:|---|---|---|---:|---:|---|---|",
    ]
    for c, a, b, ratios in rows:
        sa, sb = a.summary, b.summary
        spread = ", ".join(f"{x:.2f}" for x in ratios)
        lines.append(
            f"| {c} | {sa.output_tokens_per_s:.1f} | {sb.output_tokens_per_s:.1f} | "
            f"**{sa.output_tokens_per_s / max(sb.output_tokens_per_s, 1e-9):.2f}** ({spread}) | "
            f"{sa.ttft_s['p50'] * 1e3:.0f} / {sb.ttft_s['p50'] * 1e3:.0f} | "
            f"{sa.ttft_s['p99'] * 1e3:.0f} / {sb.ttft_s['p99'] * 1e3:.0f} | "
            f"**{sa.ttft_s['p99'] / max(sb.ttft_s['p99'], 1e-9):.2f}** | "
            f"{a.steady_ttft_p99 / max(b.steady_ttft_p99, 1e-9):.2f} | "
            f"{sum(sa.errors_by_status.values())}/{sum(sb.errors_by_status.values())} | "
            f"{'yes' if a.leak_free else 'NO'} |"
        )
    return lines


MODELS = ("embedded", "100m")  # what ``model_dir`` makes


def model_dir(name: str, work: Path) -> Path:
    if name == "embedded":
        from veloxquant_mlx.engine.model.default_model import ensure_default_model

        return ensure_default_model(work / "cache")
    target = work / "model-100m"
    subprocess.run([sys.executable, "scripts/make_random_model.py", str(target)], check=True)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}"
    )
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=64, help="per server and level, all rounds")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per level")
    p.add_argument("--max-tokens", default="32-64")
    p.add_argument("--out", default="loadtest-compare.md")
    p.add_argument("--only-pressure", action="store_true", help="just the memory-pressure run")
    p.add_argument("--skip-pressure", action="store_true", help="no memory-pressure run")
    p.add_argument("--blas-gemv", action="store_true", help="ours with its (opt-in) gemv forwarder")
    p.add_argument(
        "--keep-work",
        action="store_true",
        help="keep the work folder (models, server logs); by default it is removed after a run "
        "that succeeds and kept, with its path printed, after one that fails",
    )
    args = p.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"--models: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
    work = Path(tempfile.mkdtemp(prefix="vq-compare-"))
    try:
        run(args, work)
    except BaseException:
        print(f"compare: failed; models and server logs kept in {work}", file=sys.stderr)
        raise
    if args.keep_work:
        print(f"compare: models and server logs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


def blas_envs() -> tuple[dict[str, str], dict[str, str]]:
    """The environments of ours and of mlx_lm.server: both on the same BLAS, theirs with it
    preloaded, ours choosing it itself (its default --blas auto picks the same library)."""
    ours_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VQ_BLAS_ACTIVE")}
    env = dict(ours_env)
    blas = select("auto")
    if blas:
        env["LD_PRELOAD"] = blas
        env["VQ_BLAS_ACTIVE"] = blas
    return ours_env, env


def run(args: argparse.Namespace, work: Path) -> None:
    ours_env, env = blas_envs()
    blas = env.get("LD_PRELOAD")
    import mlx.core as mx
    import mlx_lm

    lines = [
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores; Python "
        f"{platform.python_version()}, MLX {mx.__version__}, mlx-lm {mlx_lm.__version__}; "
        f"BLAS {Path(blas).name if blas else 'bundled'} for both"
        f"{' (ours adds its gemv forwarder)' if args.blas_gemv else ''}; "
        "both servers float32 weights.",
        "",
    ]
    for name in [] if args.only_pressure else args.models.split(","):
        path = model_dir(name, work)
        ours_port, theirs_port = free_port(), free_port()
        ours_cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path),
                    "--port", str(ours_port), "--admin-key", "compare-admin",
                    "--kv-cache-mb", "512", "--max-running", "32",
                    *(["--blas-gemv"] if args.blas_gemv else [])]  # fmt: skip
        theirs_cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path),
                      "--port", str(theirs_port)]  # fmt: skip
        ours_log, theirs_log = work / f"ours-{name}.log", work / f"theirs-{name}.log"
        with server(ours_cmd, ours_port, ours_env, ours_log) as ours, \
                server(theirs_cmd, theirs_port, env, theirs_log) as theirs:  # fmt: skip
            lt = parse([
                "--url", f"http://127.0.0.1:{ours_port}",
                "--compare", f"http://127.0.0.1:{theirs_port}",
                "--concurrency", args.concurrency, "--requests", str(args.requests),
                "--max-tokens", args.max_tokens, "--compare-model", str(path),
            ])  # fmt: skip
            rows = [
                (c, *side_by_side(lt, str(path), c, args.rounds, args.requests))
                for c in (int(x) for x in args.concurrency.split(","))
            ]
            rss = (peak_rss_mb(ours.pid), peak_rss_mb(theirs.pid))
        lines.append(f"### {name} model (`{path.name}`)\n")
        lines += table(rows)
        lines.append(
            f"\nPeak resident memory: ours {rss[0]:.0f} MiB, mlx_lm.server {rss[1]:.0f} MiB.\n"
        )
    if not args.skip_pressure:
        lines += pressure(work, ours_env, env)
    report = "\n".join(lines)
    Path(args.out).write_text(report + "\n")
    print(report)


def pressure(work: Path, ours_env: dict[str, str], env: dict[str, str]) -> list[str]:
    """Offered KV well over our budget: everything served, KV within budget, 429 only at the
    queue bound; the same load on mlx_lm.server for its peak memory."""
    from veloxquant_mlx.engine.model.default_model import ensure_default_model

    path = ensure_default_model(work / "cache")
    load = ["--requests", "96", "--concurrency", "48", "--max-tokens", "200-300",
            "--prompt-words", "100-200"]  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(path), "--port", str(port),
           "--admin-key", "compare-admin", "--kv-cache-mb", "8", "--max-queue", "256"]  # fmt: skip
    with server(cmd, port, ours_env, work / "pressure.log") as proc:
        lt = parse(["--url", f"http://127.0.0.1:{port}", *load])
        s = asyncio.run(level(lt, lt.url, None, 48, "pressure c=48"))
        rss = peak_rss_mb(proc.pid)
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port", str(port)]
    with server(cmd, port, env, work / "pressure-theirs.log") as proc:
        lt = parse(["--url", f"http://127.0.0.1:{port}", "--model", str(path), *load])
        t = asyncio.run(level(lt, lt.url, str(path), 48, "pressure mlx_lm.server c=48"))
        rss_theirs = peak_rss_mb(proc.pid)
    srv = s.server
    per_block = srv.get("kv_capacity_bytes", 0) / max(srv.get("blocks_total", 1), 1)
    # worst case offered at once: 48 rows of ~500 tokens, 4 layers, K and V, 256-slot growth
    offered = 48 * 2 * 4 * ((500 + 255) // 16 + 1) * per_block
    mib = 2**20
    return [
        "### Memory pressure (`--kv-cache-mb 8`, 48 concurrent long requests, 96 in all)\n",
        f"Ours: served {s.ok}/{s.requests}, errors {s.errors_by_status or 'none'}; "
        f"peak KV in use {srv.get('peak_kv_bytes', 0) / mib:.1f} MiB "
        f"of {srv.get('kv_capacity_bytes', 0) / mib:.1f} MiB "
        f"(offered at once, worst case: about {offered / mib:.0f} MiB); "
        f"peak running {srv.get('peak_running', 0):.0f}, "
        f"peak waiting {srv.get('peak_waiting', 0):.0f}; "
        f"rejections {srv.get('rejections') or 'none'}; "
        f"pool free after: {'yes' if srv.get('leak_free') else 'NO'}; peak RSS {rss:.0f} MiB; "
        f"{s.output_tokens_per_s:.1f} tok/s.\n",
        f"mlx_lm.server, same load (no KV bound): served {t.ok}/{t.requests}, errors "
        f"{t.errors_by_status or 'none'}; peak RSS {rss_theirs:.0f} MiB; "
        f"{t.output_tokens_per_s:.1f} tok/s.",
    ]


if __name__ == "__main__":
    main()
