"""``python -m loadtest.soak --minutes N``: a bounded soak of our server on loopback.

Starts its own server process (so it can read its memory), then for N minutes runs mixed
traffic from ``--clients`` threads: full streams, chat, seeded sampling, structured outputs
(streamed or not; the JSON must parse), returning agent conversations (greedy: the answer must
not change, whether their KV is prefilled, cached or read from ``--prefix-cache-dir``), several
choices over a list of prompts, streams and
non-streamed requests abandoned midway (cancels), bad inputs of every kind, while an operator
thread shrinks the pool (which grows back on demand) and a scraper reads /metrics every second.

Beside them a hostile client rotates through what one client must not be able to do to the
others: a schema over the limits (400) and one slow to compile, a request of 4 prompts x n 4
generating long, a stream read at a trickle and then dropped, a long prompt to score (echo)
abandoned midway, a request sent on a half-closed socket; and a probe sends a plain 4-token
request every half second.

It fails (exit 1) on: any 5xx other than an honest 503 (capacity_reduced after a shrink,
queue_full's 429 is a 4xx), any error answered to a valid request, a bad input answered with
anything but 4xx, the engine reported dead, a block or owner left once idle, RSS growth after
warm-up over ``--rss-growth-mb``, or a probe's answer slower than ``--plain-latency-s``. Prints a
report (and ``--json``); stops the server by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtest import soak_traffic as traffic
from loadtest.probe import _idle
from loadtest.proc import free_port, proc_status_mb, server


@dataclass
class Report:
    minutes: float
    requests: Counter = field(default_factory=Counter)  # kind:status
    failures: list[str] = field(default_factory=list)
    tokens: int = 0
    shrinks: int = 0
    retired_blocks: int = 0
    scrapes: int = 0
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_max_mb: float = 0.0
    leak_free: bool = False
    plain_latency_s: list[float] = field(default_factory=list)  # the probe's, in order
    disk: dict[str, float] = field(default_factory=dict)  # the disk tier's counters, last scrape

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)


def rss_mb(pid: int) -> float:
    return proc_status_mb(pid, "VmRSS")


def client_loop(base: str, rep: Report, deadline: float, seed: int, lock: threading.Lock) -> None:
    """One client: a random mix until the deadline."""
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=60) as http:
        while time.monotonic() < deadline:
            kind = rng.choices(
                ["stream", "chat", "seeded", "structured", "choices", "cancel_stream",
                 "cancel_plain", "bad", "agent"],
                weights=[30, 12, 8, 8, 4, 9, 9, 20, 8],
            )[0]  # fmt: skip
            try:
                status, ok, tokens, note = traffic.one(http, kind, rng)
            except httpx.HTTPError as exc:
                status, ok, tokens, note = -1, kind.startswith("cancel"), 0, ""
                if not ok:
                    with lock:
                        rep.fail(f"{kind}: {type(exc).__name__}")
            with lock:
                rep.requests[f"{kind}:{status}"] += 1
                rep.tokens += tokens
                if not ok:
                    rep.fail(f"{kind}: HTTP {status} {note}".rstrip())


def hostile_loop(base: str, rep: Report, deadline: float, lock: threading.Lock) -> None:
    """One client doing, in turn, what must stay its own wait (each answer must be honest)."""
    rng = random.Random(99)
    kinds = ["huge_schema", "slow_schema", "fat_n", "slow_reader", "score_abandoned",
             "half_closed"]  # fmt: skip
    with httpx.Client(base_url=base, timeout=120) as http:
        i = 0
        while time.monotonic() < deadline:
            kind = kinds[i % len(kinds)]
            i += 1
            try:
                status, ok = traffic.hostile(http, base, kind, rng)
            except httpx.HTTPError as exc:
                status, ok = -1, kind in ("slow_reader", "score_abandoned")
                note = type(exc).__name__
            else:
                note = ""
            with lock:
                rep.requests[f"hostile_{kind}:{status}"] += 1
                if not ok:
                    rep.fail(f"hostile {kind}: HTTP {status} {note}".rstrip())


def probe_loop(base: str, rep: Report, deadline: float, lock: threading.Lock) -> None:
    """A plain 4-token request every half second: its latency is what everyone else waits."""
    body = {"model": traffic.MODEL, "prompt": "a plain request", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=base, timeout=300) as http:
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                r = http.post("/v1/completions", json=body)
                status = r.status_code
            except httpx.HTTPError:
                status = -1
            took = time.monotonic() - started
            with lock:
                rep.requests[f"probe:{status}"] += 1
                if status == 200:
                    rep.plain_latency_s.append(took)
                elif status != 503 and status != 429:
                    rep.fail(f"probe: HTTP {status}")
            time.sleep(max(0.0, 0.5 - took))


def operator_loop(base: str, key: str, rep: Report, deadline: float, lock: threading.Lock):
    """Shrinks the pool every few seconds; growth brings blocks back on demand."""
    rng = random.Random(7)
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {key}"}) as h:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(2, 6))
            r = h.post(
                "/admin/pool/shrink", json={"stream": "kv", "target_free": rng.randint(0, 400)}
            )
            with lock:
                if r.status_code != 200:
                    rep.fail(f"shrink: HTTP {r.status_code}")
                else:
                    rep.shrinks += 1
                    rep.retired_blocks += r.json()["retired"]


def scrape_loop(base: str, pid: int, rep: Report, deadline: float, lock: threading.Lock):
    started = time.monotonic()
    last_rss = 0.0
    with httpx.Client(base_url=base, timeout=10) as http:
        while time.monotonic() < deadline:
            text = http.get("/metrics").text
            alive = "veloxquant_engine_alive 1.0" in text
            now = time.monotonic()
            disk = {
                name.removeprefix("veloxquant_prefix_cache_disk_").removesuffix("_total"): value
                for name, value in _samples(text, "veloxquant_prefix_cache_disk_")
            }
            with lock:
                rep.scrapes += 1
                rep.disk = disk or rep.disk
                if not alive:
                    rep.fail("engine reported dead")
                if now - last_rss >= 5:
                    last_rss = now
                    rep.rss_mb.append((round(now - started, 1), round(rss_mb(pid), 1)))
            time.sleep(1.0)


def soak(args: argparse.Namespace) -> Report:
    rep = Report(minutes=args.minutes)
    port, key = free_port(), secrets.token_urlsafe(16)
    cmd = [
        sys.executable, "-m", "veloxquant_mlx.server", "--port", str(port), f"--admin-key={key}",
        "--n-blocks", str(args.n_blocks), "--grow-on-exhaustion",
        "--max-blocks", str(args.n_blocks), "--max-queue", "64", "--max-running", "8",
        *(["--model", args.model] if args.model else []),
        *(["--kv-formats", args.kv_formats] if args.kv_formats else []),
        *(["--prefix-cache-dir", args.prefix_cache_dir] if args.prefix_cache_dir else []),
        *(["--kv-recent-tokens", str(args.kv_recent_tokens)] if args.kv_recent_tokens else []),
    ]  # fmt: skip
    traffic.KV_FORMATS = (
        ("auto", *filter(None, args.kv_formats.split(","))) if args.kv_formats else ()
    )
    base = f"http://127.0.0.1:{port}"
    log = Path(args.log)
    with server(cmd, port, dict(os.environ), log) as proc:
        lock = threading.Lock()
        started = time.monotonic()
        deadline = started + args.minutes * 60
        threads = [
            threading.Thread(target=client_loop, args=(base, rep, deadline, i, lock))
            for i in range(args.clients)
        ]
        threads.append(
            threading.Thread(target=operator_loop, args=(base, key, rep, deadline, lock))
        )
        if args.hostile:
            threads.append(threading.Thread(target=hostile_loop, args=(base, rep, deadline, lock)))
        threads.append(threading.Thread(target=probe_loop, args=(base, rep, deadline, lock)))
        threads.append(
            threading.Thread(target=scrape_loop, args=(base, proc.pid, rep, deadline, lock))
        )
        for t in threads:
            t.daemon = True
            t.start()
        warm_at = started + min(60.0, args.minutes * 60 * 0.2)
        while time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
            if not rep.rss_warm_mb and time.monotonic() >= warm_at:
                rep.rss_warm_mb = rss_mb(proc.pid)
            done = time.monotonic() - started
            print(
                f"\rsoak {done / 60:5.1f}/{args.minutes:g} min  "
                f"requests {sum(rep.requests.values()):6d}  failures {len(rep.failures)}  "
                f"rss {rss_mb(proc.pid):6.1f} MiB",
                end="", file=sys.stderr, flush=True,
            )  # fmt: skip
        print(file=sys.stderr)
        for t in threads:
            t.join(120)
        rep.leak_free = _wait_idle(base, key)
        rep.rss_end_mb = rss_mb(proc.pid)
        rep.rss_max_mb = max((m for _, m in rep.rss_mb), default=rep.rss_end_mb)
    if not rep.leak_free:
        rep.fail("blocks, owners or requests left once idle")
    if not rep.rss_warm_mb:
        rep.rss_warm_mb = rep.rss_mb[0][1] if rep.rss_mb else rep.rss_end_mb
    slowest = max(rep.plain_latency_s, default=0.0)
    if slowest > args.plain_latency_s:
        rep.fail(f"a plain request took {slowest:.1f} s (limit {args.plain_latency_s:g})")
    growth = rep.rss_end_mb - rep.rss_warm_mb
    if growth > args.rss_growth_mb:
        rep.fail(f"RSS grew {growth:.1f} MiB after warm-up (limit {args.rss_growth_mb})")
    return rep


def _wait_idle(base: str, key: str, timeout: float = 60.0) -> bool:
    from loadtest.probe import scrape

    async def check() -> bool:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                m = await scrape(client, base)
                if m is not None and _idle(m):
                    # the cache drops what no request holds: then nothing may be left
                    r = await client.post(
                        f"{base}/admin/prefix-cache/reset",
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    view = r.json()
                    return view["stats"]["blocks_in_use"] == 0 and view["owners"] == {}
                await asyncio.sleep(0.2)
        return False

    return asyncio.run(check())


def _samples(text: str, prefix: str) -> list[tuple[str, float]]:
    """The unlabelled samples of /metrics whose names start with ``prefix``."""
    out = []
    for line in text.splitlines():
        if line.startswith(prefix) and "{" not in line:
            name, _, value = line.partition(" ")
            out.append((name, float(value)))
    return out


def render(rep: Report) -> str:
    total = sum(rep.requests.values())
    lines = [
        f"soak: {rep.minutes:g} min, {total} requests, {rep.tokens} tokens received, "
        f"{rep.shrinks} shrinks ({rep.retired_blocks} blocks retired), {rep.scrapes} scrapes",
        f"RSS: {rep.rss_warm_mb:.1f} MiB after warm-up, {rep.rss_end_mb:.1f} at the end, "
        f"{rep.rss_max_mb:.1f} max; pool all free at the end: {rep.leak_free}",
        f"plain requests: {len(rep.plain_latency_s)}, slowest "
        f"{max(rep.plain_latency_s, default=0.0):.2f} s",
        *(
            ["disk tier: " + ", ".join(f"{k} {v:g}" for k, v in sorted(rep.disk.items()))]
            if rep.disk
            else []
        ),
        "| kind:status | requests |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in sorted(rep.requests.items())),
        f"failures: {len(rep.failures)}",
        *(f"  - {f}" for f in rep.failures[:20]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--model", default=None, help="local model dir (default: the embedded one)")
    p.add_argument("--n-blocks", type=int, default=6000)
    p.add_argument("--rss-growth-mb", type=float, default=64.0)
    p.add_argument(
        "--plain-latency-s",
        type=float,
        default=30.0,
        help="the slowest a plain 4-token request may be answered while the rest runs",
    )
    p.add_argument(
        "--no-hostile", dest="hostile", action="store_false", help="leave the hostile client out"
    )
    p.add_argument(
        "--kv-formats",
        default="",
        help="serve these KV formats beside the default (--kv-formats), each request asking "
        "for one of them or the default at random",
    )
    p.add_argument(
        "--kv-recent-tokens",
        type=int,
        default=0,
        help="the server keeps each quantized row's newest N tokens in full precision "
        "(with --kv-formats int8,int4: the windows of rows of several formats)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        default=None,
        help="give the server a disk tier here: the soak's prefix-cache resets send pages to "
        "disk and the conversations that come back read them",
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--log", default="soak-server.log", help="the server's log")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60 or not 1 <= args.clients <= 64:
        p.error("--minutes must be in (0, 1440] and --clients in [1, 64]")
    rep = soak(args)
    print(render(rep))
    if args.json:
        report = {**asdict(rep), "requests": dict(rep.requests)}  # asdict mangles a Counter
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if rep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
