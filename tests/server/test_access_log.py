"""The access log: one line per request, with its status, id, timing and tokens."""

from __future__ import annotations

import json
import logging

import pytest

from tests.server.conftest import ADMIN, MODEL, wait_idle
from veloxquant_mlx.logs import _JSONFormatter

pytestmark = pytest.mark.anyio


def access_lines(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "veloxquant.access"]


async def test_every_request_gets_one_line_with_status_id_and_tokens(client_for, caplog):
    caplog.set_level(logging.INFO, logger="veloxquant.access")
    client = await client_for(api_key="sk-test-key-123")
    auth = {"Authorization": "Bearer sk-test-key-123", "x-request-id": "client-7"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    ok = await client.post("/v1/chat/completions", json=body, headers=auth)
    streamed = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x y", "max_tokens": 4, "stream": True, "n": 2},
        headers={"Authorization": "Bearer sk-test-key-123"},
    )
    denied = await client.post("/v1/chat/completions", json=body)
    missing = await client.get("/v1/nothing-here", headers=auth)
    bad = await client.post("/v1/chat/completions", json={**body, "top_p": 7}, headers=auth)
    assert [r.status_code for r in (ok, streamed, denied, missing, bad)] == [
        200,
        200,
        401,
        404,
        400,
    ]
    lines = access_lines(caplog)
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/completions", 200),
        ("POST", "/v1/chat/completions", 401),
        ("GET", "/v1/nothing-here", 404),
        ("POST", "/v1/chat/completions", 400),
    ]
    usage = ok.json()["usage"]
    assert lines[0]["request_id"] == "client-7" == ok.headers["x-request-id"]
    assert (lines[0]["prompt_tokens"], lines[0]["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert lines[1]["request_id"] == streamed.headers["x-request-id"]
    assert lines[1]["completion_tokens"] == 8  # both choices of the stream, counted at its end
    assert all(x["ms"] >= 0 for x in lines)
    assert lines[3]["prompt_tokens"] == lines[3]["completion_tokens"] == 0
    # the first token's time from arrival, within the request's; none where nothing was made
    assert 0 < lines[0]["ttft_ms"] <= lines[0]["ms"] and 0 < lines[1]["ttft_ms"] <= lines[1]["ms"]
    assert [x["ttft_ms"] for x in lines[2:]] == [None, None, None]
    details = usage.get("prompt_tokens_details") or {}
    assert lines[0]["cached_tokens"] == details.get("cached_tokens", 0)
    assert [x["finish"] for x in lines] == [ok.json()["choices"][0]["finish_reason"], "length",
                                            None, None, None]  # fmt: skip
    text = [r.getMessage() for r in caplog.records if r.name == "veloxquant.access"]
    assert text[0].endswith(
        f"cached={lines[0]['cached_tokens']} ttft={lines[0]['ttft_ms']:.1f} ms "
        f"finish={lines[0]['finish']}"
    )
    assert text[3].endswith(
        "prompt=0 completion=0 cached=0 ttft=- finish=- error='not_found: no such endpoint'"
    )
    # why a request failed, as its client was told; none where it did not
    assert [x["error"] for x in lines] == [
        None, None, lines[2]["error"], "not_found: no such endpoint",
        "invalid_value: top_p: Input should be less than or equal to 1",
    ]  # fmt: skip
    assert lines[2]["error"].startswith(("invalid_api_key: ", "401: "))
    await wait_idle(client.engine)  # type: ignore[attr-defined]


async def test_no_access_log_logs_no_line(client_for, caplog):
    caplog.set_level(logging.INFO, logger="veloxquant.access")
    client = await client_for(access_log=False)
    await client.get("/v1/models")
    await client.get("/admin/pool", headers={"Authorization": f"Bearer {ADMIN}"})
    assert access_lines(caplog) == []


def test_a_json_line_carries_the_fields_as_its_own_keys():
    record = logging.LogRecord("veloxquant.access", logging.INFO, "", 0, "GET / 200", (), None)
    record.fields = {"method": "GET", "status": 200, "request_id": "r1"}
    line = json.loads(_JSONFormatter().format(record))
    assert line["method"] == "GET" and line["status"] == 200 and line["request_id"] == "r1"
    assert line["message"] == "GET / 200"


async def test_a_cached_turn_logs_its_cached_tokens(client_for, caplog):
    caplog.set_level(logging.INFO, logger="veloxquant.access")
    client = await client_for()
    prompt = " ".join(f"word{i}" for i in range(60))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    first = await client.post("/v1/completions", json=body)
    again = await client.post("/v1/completions", json=body)
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first.status_code == again.status_code == 200 and cached > 0
    lines = access_lines(caplog)
    assert [x["cached_tokens"] for x in lines] == [0, cached]
    assert all(0 < x["ttft_ms"] <= x["ms"] for x in lines)
    await wait_idle(client.engine)  # type: ignore[attr-defined]
