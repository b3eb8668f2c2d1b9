"""``python -m loadtest``: load an OpenAI-compatible server and report latency and throughput.

    python -m loadtest --url http://127.0.0.1:8000 --concurrency 1,8,32 --requests 64
    python -m loadtest --url ... --rate 4 --requests 100          # open loop, Poisson arrivals
    python -m loadtest --url ... --compare http://127.0.0.1:8080  # the same load on both, ratios
    python -m loadtest --url ... --shared-prefix-words 1000 --turns 6  # multi-turn, hit rate

Against a veloxquant server it also scrapes /metrics (peak blocks, rejections) and fails the run
(exit 1) if, once idle, any block is still in use or any request still running or waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

from loadtest.probe import Probe
from loadtest.runner import Scenario, check_loopback, run
from loadtest.split import run_split
from loadtest.stats import Record, Summary, markdown, summarize


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--compare", help="a second server: the same load, interleaved, with ratios")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--compare-model", help="model id on the --compare server")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--concurrency", default="8", help="closed loop: levels, e.g. 1,8,32")
    p.add_argument("--rate", type=float, help="open loop: requests per second (Poisson)")
    p.add_argument("--requests", type=int, default=64, help="requests per level (a bound)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds per level (a bound)")
    p.add_argument("--prompt-words", default="16-64", help="prompt length range in words")
    p.add_argument("--max-tokens", default="32-64", help="output length range in tokens")
    p.add_argument(
        "--shared-prefix-words",
        type=int,
        default=0,
        help="a system prompt of this many words shared by every request (prefix caching)",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="conversations of this many turns, each resending its history (chat API)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (sampled traffic)")
    p.add_argument(
        "--logit-bias", type=int, default=0, help="a logit_bias of this many ids on each request"
    )
    p.add_argument(
        "--json-schema",
        action="store_true",
        help="a JSON schema response_format on each request (structured outputs; chat API)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT bound, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput: per-token bound, s")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="closed loop: split each level over this many client processes (one Python "
        "client tops out near 4,000 streamed tok/s; loadtest/split.py)",
    )
    p.add_argument("--api-key")
    p.add_argument("--json", help="write every summary here")
    p.add_argument("--records", help="write every request (start, TTFT, E2E, tokens, status) here")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--plot", help="directory for PNG plots (needs matplotlib)")
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback targets")
    p.add_argument("--no-leak-check", action="store_true")
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between /metrics scrapes of our server during a level (peaks)",
    )
    return p.parse_args(argv)


async def level(
    args,
    url: str,
    model: str | None,
    concurrency: int,
    label: str,
    *,
    seed: int | None = None,
    n_requests: int | None = None,
    records_out: list[Record] | None = None,
) -> Summary:
    """One load level against one server. ``seed``/``n_requests`` override the arguments';
    ``records_out`` collects the per-request records (for merging rounds)."""
    sc = Scenario(
        base_url=url.rstrip("/"),
        model=model,
        api=args.api,
        stream=not args.no_stream,
        concurrency=concurrency,
        rate=args.rate,
        n_requests=args.requests if n_requests is None else n_requests,
        duration=args.duration,
        prompt_words=_range(args.prompt_words),
        max_tokens=_range(args.max_tokens),
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed if seed is None else seed,
        api_key=args.api_key,
        shared_prefix_words=args.shared_prefix_words,
        turns=args.turns,
        logit_bias=args.logit_bias,
        json_schema=args.json_schema,
    )
    limits = httpx.Limits(max_connections=max(concurrency, 64) * 2)
    async with httpx.AsyncClient(limits=limits, timeout=sc.request_timeout) as client:
        probe = Probe(sc.base_url, interval=args.scrape_interval)
        ours = await probe.start(client)
        if args.processes > 1 and sc.rate is None:
            records, wall = await run_split(sc, label, args.processes)
        else:
            records, wall = await run(client, sc, label)
        summary = summarize(label, records, wall, args.slo_ttft, args.slo_tpot, ramp_up=concurrency)
        if records_out is not None:
            records_out.extend(records)
        if args.records:
            t0 = min((r.start for r in records), default=0.0)
            rows = [
                {"label": label, "start_s": r.start - t0, "ttft_s": r.ttft, "e2e_s": r.e2e,
                 "output_tokens": r.output_tokens, "status": r.status, "error": r.error}
                for r in records
            ]  # fmt: skip
            with open(args.records, "a") as fh:
                fh.writelines(json.dumps(row) + "\n" for row in rows)
        if ours:
            summary.server = await probe.stop(client)
    return summary


async def main_async(args) -> int:
    levels = [int(c) for c in args.concurrency.split(",")] if args.rate is None else [0]
    targets = [(args.url, args.model, "a")]
    if args.compare:
        targets.append((args.compare, args.compare_model, "b"))
    for url, _, _ in targets:
        if not args.allow_remote:
            check_loopback(url)
    summaries: list[Summary] = []
    for c in levels:
        # Interleaved: a, b at each level, on the same prompts; new prompts at every level, so
        # neither server answers a later level from its prompt cache.
        for url, model, tag in targets:
            what = f"rate {args.rate}/s" if args.rate else f"c={c}"
            summaries.append(
                await level(args, url, model, c, f"{tag}:{url} {what}", seed=args.seed + 1000 * c)
            )
    print(markdown(summaries))
    if args.compare:
        print("\n| level | out tok/s b/a | TTFT p99 b/a | errors a / b |")
        print("|---|---:|---:|---|")
        for a, b in zip(summaries[::2], summaries[1::2], strict=True):
            tps_ratio = b.output_tokens_per_s / max(a.output_tokens_per_s, 1e-9)
            print(
                f"| {a.label.split()[-1]} | {tps_ratio:.2f} | "
                f"{b.ttft_s['p99'] / max(a.ttft_s['p99'], 1e-9):.2f} | "
                f"{sum(a.errors_by_status.values())} / {sum(b.errors_by_status.values())} |"
            )
    leaks = [s for s in summaries if s.server and not s.server.get("leak_free")]
    for s in summaries:
        if s.server:
            print(f"\n{s.label}: server {json.dumps(s.server)}")
    if args.json:
        Path(args.json).write_text(json.dumps([s.to_json() for s in summaries], indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(summaries) + "\n")
    if args.plot:
        plot(summaries, Path(args.plot))
    if leaks and not args.no_leak_check:
        print(
            "loadtest: LEAK: blocks or requests left once idle: "
            + ", ".join(s.label for s in leaks),
            file=sys.stderr,
        )
        return 1
    return 0


def plot(summaries: list[Summary], directory: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "loadtest: matplotlib not installed; no plots (pip install -e '.[plot]')",
            file=sys.stderr,
        )
        return
    directory.mkdir(parents=True, exist_ok=True)
    by_target: dict[str, list[Summary]] = {}
    for s in summaries:
        by_target.setdefault(s.label.split()[0], []).append(s)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for target, rows in by_target.items():
        xs = [
            int(r.label.rsplit("c=", 1)[-1]) if "c=" in r.label else i for i, r in enumerate(rows)
        ]
        ax1.plot(xs, [r.output_tokens_per_s for r in rows], marker="o", label=target)
        ax2.plot(xs, [r.ttft_s["p99"] for r in rows], marker="o", label=target)
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax2.set(xlabel="concurrency", ylabel="seconds", title="TTFT p99")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(directory / "loadtest.png")


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
