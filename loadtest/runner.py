"""Closed-loop and open-loop load against one OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from loadtest.stats import Record

WORDS = (
    "the model memory block pool cache key value token request server stream batch decode "
    "prefill time hello world what who why how answer question please tell me about story "
    "write code python function number apple silicon linux fast slow large small day night"
).split()


@dataclass(frozen=True, slots=True)
class Scenario:
    """What to send: bounded by ``n_requests`` and ``duration`` (whichever comes first)."""

    base_url: str
    model: str | None = None  # None: the first of /v1/models
    api: str = "completions"  # or "chat"
    stream: bool = True
    concurrency: int = 8  # closed loop: this many requests in flight
    rate: float | None = None  # open loop: Poisson arrivals per second (concurrency ignored)
    n_requests: int = 64
    duration: float = 300.0
    prompt_words: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (32, 64)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    request_timeout: float = 300.0
    api_key: str | None = None
    shared_prefix_words: int = 0  # a system prompt of this many words, shared by every request
    turns: int = 1  # > 1: conversations of this many turns, each resending its history (chat)
    logit_bias: int = 0  # > 0: a logit_bias of this many token ids on every request
    json_schema: bool = False  # a JSON schema response_format on every request (chat)


# The schema sampled traffic with structured outputs sends: an object with a string and a list.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "steps": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["answer", "steps"],
}


def check_loopback(url: str) -> None:
    """Refuse targets off this machine (load tests stay on loopback unless told otherwise)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"loadtest: {url} is not a loopback address (use --allow-remote)")


def make_requests(sc: Scenario) -> list[tuple[str, int]]:
    rng = random.Random(sc.seed)
    out = []
    for i in range(sc.n_requests):
        n = rng.randint(*sc.prompt_words)
        words = [rng.choice(WORDS) for _ in range(n)]
        out.append((f"request {i}: " + " ".join(words), rng.randint(*sc.max_tokens)))
    return out


def system_prompt(sc: Scenario) -> str | None:
    """The shared system prompt (the same text on every run with the same seed), if any."""
    if not sc.shared_prefix_words:
        return None
    rng = random.Random(sc.seed + 7)
    return "Instructions: " + " ".join(rng.choice(WORDS) for _ in range(sc.shared_prefix_words))


def conversations(sc: Scenario) -> list[list[tuple[str, int]]]:
    """The work as conversations of ``sc.turns`` user turns (one request each, in order)."""
    work = make_requests(sc)
    k = max(1, sc.turns)
    return [work[i : i + k] for i in range(0, len(work), k)]


async def resolve_model(client: httpx.AsyncClient, sc: Scenario) -> str:
    if sc.model:
        return sc.model
    r = await client.get(f"{sc.base_url}/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def one(
    client: httpx.AsyncClient,
    sc: Scenario,
    model: str,
    prompt: str,
    max_tokens: int,
    history: list[dict] | None = None,
) -> Record:
    """One request; ``history``: the conversation's earlier messages (chat)."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": sc.temperature}
    if sc.top_p < 1.0:
        body["top_p"] = sc.top_p
    if sc.logit_bias:  # small biases on ids every vocabulary has (the first 256 are bytes)
        body["logit_bias"] = {str(300 + 7 * i): (-1.0) ** i * 0.5 for i in range(sc.logit_bias)}
    system = system_prompt(sc)
    if sc.json_schema:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        }
    if sc.api == "chat" or history or sc.json_schema:
        url = f"{sc.base_url}/v1/chat/completions"
        head = [{"role": "system", "content": system}] if system else []
        body["messages"] = [*head, *(history or []), {"role": "user", "content": prompt}]
    else:
        url = f"{sc.base_url}/v1/completions"
        body["prompt"] = f"{system}\n\n{prompt}" if system else prompt
    if sc.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {sc.api_key}"} if sc.api_key else {}
    rec = Record(start=time.monotonic())
    try:
        if sc.stream:
            await _streamed(client, url, body, headers, sc.request_timeout, rec)
        else:
            r = await client.post(url, json=body, headers=headers, timeout=sc.request_timeout)
            rec.status = r.status_code
            if r.status_code == 200:
                obj = r.json()
                usage = obj.get("usage") or {}
                rec.output_tokens = usage.get("completion_tokens", 0)
                rec.prompt_tokens = usage.get("prompt_tokens", 0)
                rec.cached_tokens = _cached(usage)
                choice = (obj.get("choices") or [{}])[0]
                rec.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
                rec.first_token = time.monotonic()  # non-streaming: TTFT is the whole request
            else:
                rec.error = r.text[:200]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.end = time.monotonic()
    return rec


async def _streamed(client, url, body, headers, timeout, rec: Record) -> None:
    async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
        rec.status = r.status_code
        if r.status_code != 200:
            rec.error = (await r.aread()).decode(errors="replace")[:200]
            return
        chunks = 0
        usage = None
        parts: list[str] = []
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                rec.error = str(obj["error"])[:200]
                return
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or ():
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    now = time.monotonic()
                    if rec.first_token is None:
                        rec.first_token = now
                    rec.token_times.append(now)
                    chunks += 1
        rec.output_tokens = (usage or {}).get("completion_tokens", chunks)
        rec.prompt_tokens = (usage or {}).get("prompt_tokens", 0)
        rec.cached_tokens = _cached(usage or {})
        rec.text = "".join(parts)


def _cached(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class Progress:
    """A one-line live progress bar on stderr (only when it is a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.done = self.ok = self.tokens = 0
        self.t0 = time.monotonic()
        self.live = sys.stderr.isatty()

    def update(self, rec: Record) -> None:
        self.done += 1
        self.ok += rec.ok
        self.tokens += rec.output_tokens if rec.ok else 0
        if self.live:
            width = 30
            filled = int(width * self.done / max(1, self.total))
            rate = self.tokens / max(1e-9, time.monotonic() - self.t0)
            print(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                f" ok {self.ok} err {self.done - self.ok} {rate:.1f} tok/s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.live:
            print(file=sys.stderr)


async def run(client: httpx.AsyncClient, sc: Scenario, label: str) -> tuple[list[Record], float]:
    """All of the scenario's requests; returns the records and the wall time."""
    model = await resolve_model(client, sc)
    work = make_requests(sc)
    records: list[Record] = []
    progress = Progress(len(work), label)
    t0 = time.monotonic()
    deadline = t0 + sc.duration

    async def do(prompt: str, max_tokens: int) -> None:
        rec = await one(client, sc, model, prompt, max_tokens)
        records.append(rec)
        progress.update(rec)

    if sc.rate is None and sc.turns > 1:
        convs = list(reversed(conversations(sc)))

        async def talker() -> None:
            """One conversation at a time: every turn resends the history so far."""
            while convs and time.monotonic() < deadline:
                history: list[dict] = []
                for prompt, max_tokens in convs.pop():
                    rec = await one(client, sc, model, prompt, max_tokens, history or None)
                    records.append(rec)
                    progress.update(rec)
                    if not rec.ok or time.monotonic() >= deadline:
                        break
                    history += [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": rec.text},
                    ]

        await asyncio.gather(*(talker() for _ in range(sc.concurrency)))
    elif sc.rate is None:
        queue = list(reversed(work))

        async def worker() -> None:
            while queue and time.monotonic() < deadline:
                await do(*queue.pop())

        await asyncio.gather(*(worker() for _ in range(sc.concurrency)))
    else:
        rng = random.Random(sc.seed + 1)
        tasks = []
        for prompt, max_tokens in work:
            if time.monotonic() >= deadline:
                break
            tasks.append(asyncio.create_task(do(prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(sc.rate))
        await asyncio.gather(*tasks)
    progress.close()
    return records, time.monotonic() - t0
