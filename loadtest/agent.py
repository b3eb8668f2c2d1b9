"""Agent sessions: a few long, growing conversations that resend everything each turn.

    python -m loadtest.agent --url URL [--compare URL] [--sessions 1,4] [--turns 8]
        [--system-words 1500] [--turn-words 50-400] [--max-tokens 48] [--think-ms 0]

Each of S sessions opens with a system prompt (instructions and tool definitions: a few
thousand tokens, the same for every session, as an agent's is) and a task; every later turn adds
the previous answer and either a tool result or a user message (``--turn-words``), and resends
the whole conversation (chat API, streaming), so the context grows turn by turn. Sessions run
concurrently, each waiting for its answer (and ``--think-ms``) before its next turn. Reported per
server: throughput, TTFT p50/p99 (and by turn), TTFT per new prompt token (what a turn costs
beyond its cached prefix), inter-token latency p50/p99, the prefix-cache hit rate and, where the
server exports it, the peak KV bytes held. With ``--compare`` both servers run every level, in
alternating order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass

import httpx

from loadtest.probe import scrape
from loadtest.runner import WORDS, _streamed, check_loopback, resolve_model
from loadtest.stats import Record, percentile

TOOLS = ("read_file", "write_file", "run_tests", "search_code", "list_dir", "git_diff")


@dataclass(frozen=True, slots=True)
class AgentScenario:
    base_url: str
    model: str | None = None
    sessions: int = 4
    turns: int = 8
    system_words: int = 1500
    turn_words: tuple[int, int] = (50, 400)
    max_tokens: int = 48
    think_ms: float = 0.0
    seed: int = 0
    api_key: str | None = None
    request_timeout: float = 600.0


def system_prompt(sc: AgentScenario) -> str:
    """Instructions and tool definitions of about ``system_words`` words, the same for every
    session and run with the same seed."""
    rng = random.Random(sc.seed + 11)
    parts = ["You are a coding agent. Use the tools to complete the task. Tools:"]
    n = 0
    while n < sc.system_words:
        tool = rng.choice(TOOLS)
        words = " ".join(rng.choice(WORDS) for _ in range(40))
        spec = {"name": tool, "description": words, "parameters": {"path": "string"}}
        parts.append(json.dumps(spec))
        n += 48
    return "\n".join(parts)


def turn_text(sc: AgentScenario, session: int, turn: int) -> str:
    """Turn ``turn``'s new message: the task, then tool results and user messages in turn."""
    rng = random.Random(sc.seed * 1_000_003 + session * 1_009 + turn)
    body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*sc.turn_words)))
    if turn == 0:
        return f"Task {session}: {body}"
    if turn % 2:
        return f"Tool result ({rng.choice(TOOLS)}):\n{body}"
    return f"User: {body}"


@dataclass(slots=True)
class Turn:
    session: int
    turn: int
    record: Record


@dataclass(slots=True)
class KVPeak:
    """The most KV the server reported holding while the level ran (``/metrics``)."""

    peak: float | None = None


async def _watch_kv(client: httpx.AsyncClient, url: str, out: KVPeak, stop: asyncio.Event) -> None:
    """Live KV bytes every 0.2 s, plus the pool's high-water mark when it rose during the level:
    a level shorter than the scrape interval still reports the KV it held."""
    mark0: float | None = None
    while True:
        done = stop.is_set()  # one last scrape after the level, for the high-water mark
        m = await scrape(client, url)
        if m is not None and "veloxquant_kv_cache_used_bytes" in m:
            seen = [m["veloxquant_kv_cache_used_bytes"]]
            mark = m.get("veloxquant_block_pool_peak_blocks_in_use", 0.0)
            if mark0 is None:
                mark0 = mark
            elif mark > mark0:
                seen.append(mark * m.get("veloxquant_kv_bytes_per_block", 0.0))
            out.peak = max(out.peak or 0.0, *seen)
        if done:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def run(client: httpx.AsyncClient, sc: AgentScenario) -> tuple[list[Turn], float, KVPeak]:
    """Every session's turns; returns them, the wall time and the KV peak seen."""
    model = await resolve_model(client, sc)  # type: ignore[arg-type]
    system = system_prompt(sc)
    url = f"{sc.base_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {sc.api_key}"} if sc.api_key else {}
    turns: list[Turn] = []
    kv = KVPeak()
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_kv(client, sc.base_url, kv, stop))

    async def session(s: int) -> None:
        messages: list[dict] = [{"role": "system", "content": system}]
        for t in range(sc.turns):
            messages.append({"role": "user", "content": turn_text(sc, s, t)})
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": sc.max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rec = Record(start=time.monotonic())
            try:
                await _streamed(client, url, body, headers, sc.request_timeout, rec)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:200]
            rec.end = time.monotonic()
            turns.append(Turn(s, t, rec))
            if not rec.ok:
                return
            messages.append({"role": "assistant", "content": rec.text})
            if sc.think_ms:
                await asyncio.sleep(sc.think_ms / 1000)

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(session(s) for s in range(sc.sessions)))
    finally:
        stop.set()
        await watcher
    return turns, time.monotonic() - t0, kv


@dataclass(frozen=True, slots=True)
class AgentSummary:
    label: str
    sessions: int
    turns_ok: int
    errors: int
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    ttft_first_turn: float  # p50 of turn 0 (cold: nothing cached yet but the system prompt)
    ttft_last_turn: float  # p50 of the last turn (the longest context)
    ms_per_new_token: float  # p50 over turns >= 1 of TTFT / (prompt - cached tokens)
    itl_p50: float
    itl_p99: float
    hit_rate: float  # cached / prompt tokens over turns >= 1
    peak_kv_bytes: float | None
    mean_prompt_tokens_last: float
    first_error: str = ""  # the first failed turn's status and message


def summarize(label: str, sc: AgentScenario, turns: list[Turn], wall: float, kv: KVPeak):
    ok = [t for t in turns if t.record.ok]
    recs = [t.record for t in ok]
    ttfts = [r.ttft for r in recs if r.ttft is not None]
    later = [t.record for t in ok if t.turn >= 1]
    per_new = [
        r.ttft * 1000 / max(1, r.prompt_tokens - r.cached_tokens)
        for r in later
        if r.ttft is not None and r.prompt_tokens
    ]
    itls = [b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    prompt = sum(r.prompt_tokens for r in later)
    last = max((t.turn for t in ok), default=0)

    def turn_p50(k: int) -> float:
        return percentile([t.record.ttft for t in ok if t.turn == k and t.record.ttft], 0.5)

    return AgentSummary(
        label=label,
        sessions=sc.sessions,
        turns_ok=len(ok),
        errors=len(turns) - len(ok),
        tok_s=sum(r.output_tokens for r in recs) / max(wall, 1e-9),
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p99=percentile(ttfts, 0.99),
        ttft_first_turn=turn_p50(0),
        ttft_last_turn=turn_p50(last),
        ms_per_new_token=percentile(per_new, 0.5),
        itl_p50=percentile(itls, 0.5),
        itl_p99=percentile(itls, 0.99),
        hit_rate=sum(r.cached_tokens for r in later) / prompt if prompt else float("nan"),
        peak_kv_bytes=kv.peak,
        first_error=next(
            (f"{t.record.status}: {t.record.error}" for t in turns if not t.record.ok), ""
        ),
        mean_prompt_tokens_last=(
            sum(t.record.prompt_tokens for t in ok if t.turn == last)
            / max(1, sum(1 for t in ok if t.turn == last))
        ),
    )


def table(rows: list[AgentSummary]) -> list[str]:
    """A Markdown table of the summaries (times in ms)."""
    out = [
        "| server | sessions | turns ok / errors | tok/s | TTFT p50 | TTFT p99 | TTFT turn 1 "
        "| TTFT last turn | ms per new prompt token | ITL p50 | ITL p99 | hit rate "
        "| peak KV MiB | last prompt tokens |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in rows:
        kv = "-" if s.peak_kv_bytes is None else f"{s.peak_kv_bytes / 2**20:.1f}"
        out.append(
            f"| {s.label} | {s.sessions} | {s.turns_ok} / {s.errors} | {s.tok_s:.1f} "
            f"| {s.ttft_p50 * 1000:.0f} | {s.ttft_p99 * 1000:.0f} "
            f"| {s.ttft_first_turn * 1000:.0f} | {s.ttft_last_turn * 1000:.0f} "
            f"| {s.ms_per_new_token:.2f} | {s.itl_p50 * 1000:.0f} | {s.itl_p99 * 1000:.0f} "
            f"| {s.hit_rate:.0%} | {kv} | {s.mean_prompt_tokens_last:.0f} |"
        )
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--compare", help="a second server: the same sessions, alternating")
    p.add_argument("--model", help="model id (default: the first of /v1/models)")
    p.add_argument("--compare-model", help="model id on the --compare server")
    p.add_argument("--sessions", default="1,4", help="comma-separated levels")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--turn-words", default="50-400", help="LO-HI words a turn adds")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--think-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("--allow-remote", action="store_true", help="load a non-loopback server")
    return p.parse_args(argv)


async def levels(args: argparse.Namespace) -> list[AgentSummary]:
    lo, _, hi = args.turn_words.partition("-")
    targets = [("ours", args.url, args.model)]
    if args.compare:
        targets.append(("compare", args.compare, args.compare_model))
    if not args.allow_remote:
        for _, url, _ in targets:
            check_loopback(url)
    out: list[AgentSummary] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        for i, n in enumerate(int(x) for x in args.sessions.split(",")):
            order = targets if i % 2 == 0 else list(reversed(targets))
            for label, url, model in order:
                sc = AgentScenario(
                    url, model, n, args.turns, args.system_words, (int(lo), int(hi or lo)),
                    args.max_tokens, args.think_ms, args.seed + i, args.api_key,
                )  # fmt: skip
                turns, wall, kv = await run(client, sc)
                out.append(summarize(label, sc, turns, wall, kv))
                print(f"{label} at {n} sessions: done in {wall:.1f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows = asyncio.run(levels(args))
    print("\n".join(table(sorted(rows, key=lambda r: (r.sessions, r.label)))))
    for r in rows:
        if r.first_error:
            print(f"{r.label} at {r.sessions} sessions, first error: {r.first_error}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in rows], fh, indent=1)
    return 0 if all(r.errors == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
