"""Every endpoint and every error status, in process over httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ADMIN, MODEL, wait_idle

pytestmark = pytest.mark.anyio

COMPLETION = {"model": MODEL, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def assert_openai_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


async def test_models_lists_the_served_model(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


async def test_completion_returns_text_and_usage_with_kv(client):
    r = await client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert usage["peak_kv_blocks"] > 0 and usage["peak_kv_bytes"] > 0


async def test_token_id_prompts_and_batch_of_one_work(client):
    r1 = await client.post("/v1/completions", json={**COMPLETION, "prompt": [5, 6, 7]})
    r2 = await client.post("/v1/completions", json={**COMPLETION, "prompt": [[5, 6, 7]]})
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["choices"][0]["text"] == r2.json()["choices"][0]["text"]


async def test_completion_logprobs(client):
    r = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "max_tokens": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(
        len(t) <= 2 for t in lp["top_logprobs"]
    )


async def test_logit_bias_steers_and_penalties_are_accepted(client):
    forced = await client.post(
        "/v1/completions",
        json={**COMPLETION, "max_tokens": 5, "logit_bias": {"42": 100.0}, "logprobs": 0},
    )
    assert forced.status_code == 200, forced.text
    tokens = forced.json()["choices"][0]["logprobs"]["tokens"]
    assert len(set(tokens)) == 1  # +100 on one id makes greedy pick it every time
    body = {**COMPLETION, "presence_penalty": 0.5, "frequency_penalty": 0.3, "top_k": -1}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    for bad in (
        {"logit_bias": {"x": 1.0}},
        {"logit_bias": {"999999": 1.0}},
        {"presence_penalty": 3.0},
        {"top_k": -2},
    ):
        assert_openai_error(await client.post("/v1/completions", json={**COMPLETION, **bad}), 400)


async def test_chat_completion_and_its_logprobs(client):
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 for c in content)


async def test_an_eos_finish_has_one_logprobs_entry_per_counted_token(client):
    eos = client.engine.tokenizer.eos_token_id
    forced = {**CHAT, "logit_bias": {str(eos): 100.0}, "logprobs": True, "top_logprobs": 1}
    body = (await client.post("/v1/chat/completions", json=forced)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert body["usage"]["completion_tokens"] == 1
    (entry,) = choice["logprobs"]["content"]
    assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
    streamed = await client.post("/v1/chat/completions", json={**forced, "stream": True})
    chunks = parse_sse(streamed.text)
    entries = [e for c in chunks if c["choices"] and (lp := c["choices"][0]["logprobs"])
               for e in lp["content"]]  # fmt: skip
    assert [e["logprob"] for e in entries] == [entry["logprob"]]
    plain = {**forced, "logprobs": False, "top_logprobs": None, "stream": True}
    chunks = parse_sse((await client.post("/v1/chat/completions", json=plain)).text)
    assert all(c["choices"][0]["delta"].get("content", "") == "" for c in chunks)


def parse_sse(text: str) -> list:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_streaming_completion_with_usage(client):
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(r.text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    plain = (await client.post("/v1/completions", json=COMPLETION)).json()["choices"][0]["text"]
    assert text == plain


async def test_streaming_chat_starts_with_the_role(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "temperature": 0})
    chunks = parse_sse(r.text)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**COMPLETION, "max_tokens": "5"}, "max_tokens"),
        ({**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ({**COMPLETION, "max_tokens": 2.5}, "max_tokens"),
        ({**COMPLETION, "temperature": 3}, "temperature"),
        ({**COMPLETION, "temperature": "hot"}, "temperature"),
        ({**COMPLETION, "top_p": 0}, "top_p"),
        ({**COMPLETION, "n": 9}, "n"),  # over --max-n (8)
        ({**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**COMPLETION, "stop": [""]}, "stop"),
        ({**COMPLETION, "stream": "yes"}, "stream"),
        ({**COMPLETION, "prompt": 5}, "prompt"),
        ({**COMPLETION, "prompt": []}, "prompt"),
        ({**COMPLETION, "prompt": [-1]}, "prompt"),
        ({"prompt": "hi", "model": ""}, "model"),
    ],
)
async def test_bad_values_are_400_never_422(client, body, param):
    r = await client.post("/v1/completions", json=body)
    err = assert_openai_error(r, 400)
    assert err["param"] is None or err["param"].split(".")[0] == param


@pytest.mark.parametrize("raw", ['{"model": "x", "temperature": NaN}', '{"temperature": Infinity}'])
async def test_nan_and_infinity_are_400(client, raw):
    r = await client.post(
        "/v1/completions",
        content=raw.replace('"x"', f'"{MODEL}"'),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 400)


async def test_malformed_json_and_wrong_shape_are_400(client):
    r = await client.post(
        "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert "JSON" in assert_openai_error(r, 400)["message"]
    r = await client.post("/v1/chat/completions", json=[1, 2])
    assert_openai_error(r, 400)
    r = await client.post("/v1/chat/completions", json={**CHAT, "messages": []})
    assert_openai_error(r, 400)
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "messages": [{"role": "robot", "content": "x"}]}
    )
    assert_openai_error(r, 400)


async def test_empty_prompt_and_over_context_are_400(client):
    assert_openai_error(
        await client.post("/v1/completions", json={**COMPLETION, "prompt": ""}), 400
    )
    r = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 9000})
    assert_openai_error(r, 400, "context_length_exceeded")
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt": [99999]})
    assert_openai_error(r, 400)


async def test_a_prompt_over_the_context_is_refused_without_a_misleading_warning(client, caplog):
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt": "hello " * 9000})
    error = assert_openai_error(r, 400, "context_length_exceeded")
    assert "maximum context length is 8192 tokens" in error["message"]
    assert "indexing errors" not in caplog.text  # transformers' own length warning


async def test_unknown_model_is_404_and_nothing_is_loaded(client):
    r = await client.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"})
    assert_openai_error(r, 404, "model_not_found")
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "/etc/passwd"})
    assert_openai_error(r, 404, "model_not_found")


async def test_model_aliases_serve_other_names_and_patterns(client_for):
    client = await client_for(model_aliases="gpt-4o, claude-*")
    ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert ids == [MODEL, "gpt-4o"]  # a pattern is not listed
    for name in ("gpt-4o", "claude-haiku-4-5-20251001"):
        assert (await client.get(f"/v1/models/{name}")).json()["id"] == name
        r = await client.post("/v1/chat/completions", json={**CHAT, "model": name})
        assert r.status_code == 200 and r.json()["model"] == MODEL
    r = await client.post(
        "/v1/messages",
        json={"model": "claude-sonnet-4-5", "max_tokens": 4,
              "messages": [{"role": "user", "content": "hi"}]},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = await client.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"})
    assert_openai_error(r, 404, "model_not_found")
    r = await client.post("/v1/completions", json={**COMPLETION, "model": "xclaude-1"})
    assert_openai_error(r, 404, "model_not_found")


async def test_unknown_path_404_and_wrong_method_405(client):
    assert_openai_error(await client.get("/v2/whatever"), 404)
    assert_openai_error(await client.get("/v1/completions"), 405)
    assert_openai_error(await client.delete("/v1/models"), 405)


async def test_body_over_one_mib_is_413(client):
    big = {**COMPLETION, "prompt": "x" * (1 << 20)}
    assert_openai_error(await client.post("/v1/completions", json=big), 413)


async def test_full_queue_is_429_with_retry_after(client_for):
    client = await client_for(max_queue=1, max_running=1)
    long = {**COMPLETION, "max_tokens": 400}

    async def until(gauge: str) -> None:  # (fixed sleeps: the first answer ended too soon once)
        for _ in range(1000):
            text = (await client.get("/metrics")).text
            values = {s.name: s.value for f in text_string_to_metric_families(text)
                      for s in f.samples if not s.labels}  # fmt: skip
            if values.get(gauge) == 1:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{gauge} never 1")

    first = asyncio.create_task(client.post("/v1/completions", json={**long, "max_tokens": 1500}))
    await until("veloxquant_requests_running")
    second = asyncio.create_task(client.post("/v1/completions", json=long))
    await until("veloxquant_requests_waiting")
    r = await client.post("/v1/completions", json=long)
    if r.status_code != 429:  # say what the two before it did
        done = [await first, await second]
        raise AssertionError([(x.status_code, x.text[-300:]) for x in (r, *done)])
    err = assert_openai_error(r, 429, "queue_full")
    assert r.headers["retry-after"] and err["type"] == "rate_limit_error"
    assert (await first).status_code == 200 and (await second).status_code == 200


async def test_health_ready_and_503_while_draining(client):
    assert (await client.get("/health")).json() == {"status": "ok"}
    assert (await client.get("/ready")).status_code == 200
    client._transport.app.state.vq.draining = True  # what SIGTERM sets
    assert_openai_error(await client.get("/ready"), 503)
    assert_openai_error(await client.post("/v1/completions", json=COMPLETION), 503)
    client._transport.app.state.vq.draining = False


async def test_metrics_parse_and_return_to_zero_when_idle(client):
    await client.post("/v1/completions", json=COMPLETION)
    await wait_idle(client.engine)
    text = (await client.get("/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name, **labels: next(  # noqa: E731
        s.value for s in fams[name].samples if s.labels == labels or not labels
    )
    assert value("veloxquant_requests_running") == 0
    assert value("veloxquant_requests_waiting") == 0
    assert value("veloxquant_kv_cache_used_bytes") == 0
    assert value("veloxquant_kv_cache_capacity_bytes") > 0
    assert value("veloxquant_block_pool_blocks_in_use") == 0
    assert value("veloxquant_prefill_budget_tokens") == 64  # this CPU: fixed at 64
    memory = {s.labels["kind"]: s.value for s in fams["veloxquant_mlx_memory_bytes"].samples}
    assert set(memory) == {"active", "cache", "peak"}  # the model's weights at least are alive
    assert 0 < memory["active"] <= memory["peak"] and memory["cache"] >= 0
    assert fams["veloxquant_generation_tokens"].samples[0].value >= 8
    assert fams["veloxquant_time_to_first_token_seconds"].type == "histogram"
    build = fams["veloxquant_build_info"].samples[0].labels
    assert build["blas"]
    # the engine's defaults on a CPU: the dense working set, MLX's own masked attention
    assert (build["kv_layout"], build["ragged_attention"]) == ("dense", "sdpa")
    for name in fams:
        assert ":" not in name and name.startswith("veloxquant_")


async def test_metrics_pass_promtool(client):
    import shutil
    import subprocess

    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (make installs Debian's prometheus package as root)")
    await client.post("/v1/completions", json=COMPLETION)
    text = (await client.get("/metrics")).text
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


async def test_admin_needs_the_key(client):
    assert_openai_error(await client.get("/admin/pool"), 401)
    bad = {"Authorization": "Bearer wrong-key-here"}
    assert_openai_error(await client.get("/admin/pool", headers=bad), 401)
    r = await client.post("/admin/pool/shrink", json={"stream": "k", "target_free": 0}, headers=bad)
    assert_openai_error(r, 401)


async def test_admin_pool_view_and_shrink(client):
    auth = {"Authorization": f"Bearer {ADMIN}"}
    view = (await client.get("/admin/pool", headers=auth)).json()
    assert view["stats"]["n_blocks"] == 4000 and view["owners"] == {}
    r = await client.post(
        "/admin/pool/shrink", json={"stream": "kv", "target_free": 1500}, headers=auth
    )
    assert r.status_code == 200
    assert r.json()["retired"] == 1000 and r.json()["stats"]["n_blocks"] == 3000
    for bad in (
        {"stream": "x", "target_free": 1},
        {"stream": "k", "target_free": -1},
        {"stream": "k"},
    ):
        assert_openai_error(await client.post("/admin/pool/shrink", json=bad, headers=auth), 400)


async def test_admin_has_no_cors_but_v1_does(client_for):
    client = await client_for(cors_origins=["http://example.test"])
    origin = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST"}
    r = await client.options("/v1/completions", headers=origin)
    assert r.headers.get("access-control-allow-origin") == "http://example.test"
    r = await client.options("/admin/pool", headers=origin)
    assert "access-control-allow-origin" not in r.headers


async def test_api_key_guards_v1_when_set(client_for):
    client = await client_for(api_key="secret-api-key")
    assert_openai_error(await client.post("/v1/completions", json=COMPLETION), 401)
    r = await client.post(
        "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer secret-api-key"}
    )
    assert r.status_code == 200
    assert (await client.get("/health")).status_code == 200


def test_an_unhandled_error_is_a_500_that_closes_its_connection():
    """A bug answers OpenAI's shape with no detail, and ``connection: close``: the state of a
    connection a bug went through is unknown, so the client reconnects."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from veloxquant_mlx.server import errors

    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a secret detail of the server")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "internal_error" and "secret" not in r.text
