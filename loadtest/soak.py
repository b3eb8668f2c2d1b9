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
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtest.probe import _idle
from loadtest.proc import free_port, proc_status_mb, server

MODEL = "veloxquant-tiny-llama"
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["kind", "legs"],
}

# Bad inputs: (path, raw body) and the status a truthful server answers.
BAD_INPUTS: list[tuple[str, bytes, int]] = [
    ("/v1/completions", b'{"model": "M", "prompt": "x", "top_k": 100000}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "a\\ud800b"}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "x", "logit_bias": {"\\u00b2": 1}}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "x", "seed": 18446744073709551616}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "x", "temperature": NaN}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": [999999999]}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "x", "max_tokens": 900000}', 400),
    ("/v1/chat/completions", b'{"model": "M", "messages": []}', 400),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "x"}]}', 400),
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404),
]


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


def _prompt(rng: random.Random) -> str:
    words = ["alpha", "beta", "gamma", "delta", "pool", "block", "token", "stream", "é", "漢"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))


# What the clients' requests ask for as ``kv_format`` (``--kv-formats``; "auto" is the server's
# own), empty: nothing.
KV_FORMATS: tuple[str, ...] = ()


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
                status, ok, tokens, note = _one(http, kind, rng)
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


def _one(http: httpx.Client, kind: str, rng: random.Random) -> tuple[int, bool, int, str]:
    """(status, whether the answer was truthful for this kind, tokens received, a note)."""
    max_tokens = rng.randint(1, 120)
    kv = rng.choice(KV_FORMATS) if KV_FORMATS else None  # --kv-formats: a format per request
    if kind == "agent":
        return _agent(http, rng)
    if kind == "bad":
        path, raw, expected = rng.choice(BAD_INPUTS)
        r = http.post(
            path,
            content=raw.replace(b'"M"', f'"{MODEL}"'.encode()),
            headers={"content-type": "application/json"},
        )
        body_ok = "error" in r.json() and "Traceback" not in r.text
        return r.status_code, r.status_code == expected and body_ok, 0, raw[:80].decode()
    if kind in ("stream", "cancel_stream"):
        body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": max_tokens, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with http.stream("POST", "/v1/completions", json=_fmt(body, kv)) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, _honest(r), 0, ""
            stop_after = rng.randint(1, 5) if kind == "cancel_stream" else None
            events, done, usage = 0, False, 0
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return 200, event["error"].get("code") == "capacity_reduced", 0, ""
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                events += 1
                if stop_after is not None and events >= stop_after:
                    return 200, True, 0, ""  # leaving: the connection closes with the context
            return 200, done, usage, ""
    if kind == "cancel_plain":
        body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": 400}
        try:
            r = http.post("/v1/completions", json=_fmt(body, kv), timeout=rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            return 0, True, 0, ""
        return r.status_code, r.status_code == 200 or _honest(r), 0, ""
    if kind == "structured":  # constrained decoding, batched with the rest; must parse
        messages = [{"role": "user", "content": _prompt(rng)}]
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
        body = {"model": MODEL, "messages": messages, "max_tokens": 80, "response_format": fmt,
                "temperature": rng.uniform(0.2, 1.2), "stream": rng.random() < 0.5}  # fmt: skip
        if body["stream"]:
            with http.stream("POST", "/v1/chat/completions", json=_fmt(body, kv)) as r:
                if r.status_code != 200:
                    r.read()
                    return r.status_code, _honest(r), 0, ""
                text = ""
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return 200, event["error"].get("code") == "capacity_reduced", 0, ""
                        if event["choices"]:
                            text += event["choices"][0]["delta"].get("content") or ""
        else:
            r = http.post("/v1/chat/completions", json=_fmt(body, kv))
            if r.status_code != 200:
                return r.status_code, _honest(r), 0, ""
            text = r.json()["choices"][0]["message"]["content"]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return 200, False, 0, f"not JSON: {text[:60]}"
        return 200, set(value) == {"kind", "legs"}, 0, text[:60]
    if kind == "choices":
        body = {"model": MODEL, "prompt": [_prompt(rng), _prompt(rng)], "n": 2,
                "max_tokens": max_tokens, "temperature": 0.8}  # fmt: skip
        r = http.post("/v1/completions", json=_fmt(body, kv))
        if r.status_code == 200:
            ok = sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
            return 200, ok, r.json()["usage"]["completion_tokens"], ""
        return r.status_code, _honest(r), 0, ""
    if kind == "chat":
        messages = [{"role": "user", "content": _prompt(rng)}]
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        r = http.post("/v1/chat/completions", json=_fmt(body, kv))
    else:
        body = {
            "model": MODEL, "prompt": _prompt(rng), "max_tokens": max_tokens,
            "temperature": rng.uniform(0.1, 1.5), "top_k": rng.choice([-1, 0, 5, 50]),
            "top_p": rng.uniform(0.5, 1.0), "seed": rng.randint(-(2**63), 2**64 - 1),
        }  # fmt: skip
        r = http.post("/v1/completions", json=_fmt(body, kv))
    if r.status_code == 200:
        return 200, True, r.json()["usage"]["completion_tokens"], ""
    return r.status_code, _honest(r), 0, ""


# A returning agent conversation: one of a few long system prompts, one of a few questions,
# greedy. Its pages are cached, evicted by resets and shrinks, read back from the disk tier
# (--prefix-cache-dir): whichever way its KV comes, the answer must not change.
AGENT_SYSTEMS = [
    " ".join(random.Random(i).choice(["tool", "file", "read", "write", "grep", "edit", "line"])
             for _ in range(300))
    for i in range(3)
]  # fmt: skip
AGENT_ASKS = ["What next?", "Read the file.", "Run the tests."]
_agent_answers: dict[tuple[int, int], str] = {}
_agent_lock = threading.Lock()


def _agent(http: httpx.Client, rng: random.Random) -> tuple[int, bool, int, str]:
    key = (rng.randrange(len(AGENT_SYSTEMS)), rng.randrange(len(AGENT_ASKS)))
    messages = [{"role": "system", "content": AGENT_SYSTEMS[key[0]]},
                {"role": "user", "content": AGENT_ASKS[key[1]]}]  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return r.status_code, _honest(r), 0, ""
    answer = r.json()["choices"][0]["message"]["content"]
    with _agent_lock:
        first = _agent_answers.setdefault(key, answer)
    note = "" if answer == first else f"conversation {key}: {answer[:30]!r} != {first[:30]!r}"
    return 200, answer == first, r.json()["usage"]["completion_tokens"], note


def _fmt(body: dict, kv: str | None) -> dict:
    """``body`` asking for KV format ``kv`` (None: the server's own)."""
    return body if kv is None else {**body, "kv_format": kv}


def _wide_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


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
                status, ok = _hostile(http, base, kind, rng)
            except httpx.HTTPError as exc:
                status, ok = -1, kind in ("slow_reader", "score_abandoned")
                note = type(exc).__name__
            else:
                note = ""
            with lock:
                rep.requests[f"hostile_{kind}:{status}"] += 1
                if not ok:
                    rep.fail(f"hostile {kind}: HTTP {status} {note}".rstrip())


def _hostile(http: httpx.Client, base: str, kind: str, rng: random.Random) -> tuple[int, bool]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": _prompt(rng)}]}
    if kind in ("huge_schema", "slow_schema"):
        # 10,000 optional properties: over the limits, 400; 12 x 300 under them: compiles
        n = 10_000 if kind == "huge_schema" else 300
        schema = (
            _wide_schema(n)
            if kind == "huge_schema"
            else {"type": "object", "properties": {f"o{j}": _wide_schema(n) for j in range(12)}}
        )
        fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
        r = http.post("/v1/chat/completions", json={**chat, "max_tokens": 4,
                                                    "response_format": fmt})  # fmt: skip
        return r.status_code, r.status_code in (200, 400) and _no_leak(r)
    if kind == "fat_n":
        body = {"model": MODEL, "prompt": [_prompt(rng) for _ in range(4)], "n": 4,
                "max_tokens": 96}  # fmt: skip
        r = http.post("/v1/completions", json=body)
        return r.status_code, r.status_code == 200 or _honest(r)
    if kind == "slow_reader":  # a trickle of reads, then gone
        body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": 200, "stream": True,
                "n": 2}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_raw(64):
                time.sleep(0.2)
                if rng.random() < 0.1:
                    break
            return r.status_code, r.status_code == 200 or _honest(r)
    if kind == "score_abandoned":  # a long prompt to score, the client gone after 0.3 s
        body = {"model": MODEL, "prompt": list(range(3, 1503)), "max_tokens": 0, "echo": True,
                "logprobs": 5}  # fmt: skip
        try:
            r = http.post("/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            return 0, True
        return r.status_code, r.status_code == 200 or _honest(r)
    # half_closed: a whole request, then the sending side shut; the answer must come back
    host, port = base.removeprefix("http://").split(":")
    raw = json.dumps({"model": MODEL, "prompt": _prompt(rng), "max_tokens": 4}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(raw))  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + raw)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.1 ") else 0
    return status, status == 200


def _no_leak(r: httpx.Response) -> bool:
    return "Traceback" not in r.text and "site-packages" not in r.text


def probe_loop(base: str, rep: Report, deadline: float, lock: threading.Lock) -> None:
    """A plain 4-token request every half second: its latency is what everyone else waits."""
    body = {"model": MODEL, "prompt": "a plain request", "max_tokens": 4, "temperature": 0}
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


def _honest(r: httpx.Response) -> bool:
    """An error a valid request may truthfully get under shrinks and load."""
    if r.status_code == 429:
        return "retry-after" in r.headers
    if r.status_code == 503:
        return r.json()["error"]["code"] == "capacity_reduced" and "retry-after" in r.headers
    return False


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
    global KV_FORMATS
    KV_FORMATS = ("auto", *filter(None, args.kv_formats.split(","))) if args.kv_formats else ()
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
