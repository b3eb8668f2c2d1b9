"""The soak's requests (``loadtest.soak``): what each kind of client sends and whether the
answer was truthful for it. One request per call; the loops, the server and the report are
``loadtest.soak``'s."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import httpx

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


def _prompt(rng: random.Random) -> str:
    words = ["alpha", "beta", "gamma", "delta", "pool", "block", "token", "stream", "é", "漢"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))


# What the clients' requests ask for as ``kv_format`` (``--kv-formats``; "auto" is the server's
# own), empty: nothing.
KV_FORMATS: tuple[str, ...] = ()


def one(http: httpx.Client, kind: str, rng: random.Random) -> tuple[int, bool, int, str]:
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


def hostile(http: httpx.Client, base: str, kind: str, rng: random.Random) -> tuple[int, bool]:
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
    final = out[out.rfind(b"HTTP/1.1 ") :]  # past interim 1xx responses (probes), if any
    status = int(final.split(b" ", 2)[1]) if final.startswith(b"HTTP/1.1 ") else 0
    return status, status == 200


def _no_leak(r: httpx.Response) -> bool:
    return "Traceback" not in r.text and "site-packages" not in r.text


def _honest(r: httpx.Response) -> bool:
    """An error a valid request may truthfully get under shrinks and load."""
    if r.status_code == 429:
        return "retry-after" in r.headers
    if r.status_code == 503:
        return r.json()["error"]["code"] == "capacity_reduced" and "retry-after" in r.headers
    return False
