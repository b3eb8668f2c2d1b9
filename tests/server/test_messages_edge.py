"""The Messages API at the edge: x-api-key as the API key, and Anthropic's error shape on its
paths (OpenAI's everywhere else)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL, wait_idle
from veloxquant_mlx.server.messages_api import OMITTED_IMAGE

pytestmark = pytest.mark.anyio

BODY = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_x_api_key_is_the_api_key_and_errors_take_anthropics_shape(client_for):
    client = await client_for(api_key="sk-messages-1")
    ok = await client.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-messages-1"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["type"] == "message" and ok.json()["usage"]["output_tokens"] > 0
    for headers in ({}, {"x-api-key": "wrong-key-1"}):
        denied = await client.post("/v1/messages", json=BODY, headers=headers)
        assert denied.status_code == 401
        assert denied.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": denied.json()["error"]["message"]},
        }
    # The same key works for the OpenAI paths; their errors keep OpenAI's shape.
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = await client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sk-messages-1"})
    assert r.status_code == 200
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    missing = await client.get("/v1/messages/nothing", headers={"x-api-key": "sk-messages-1"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    await wait_idle(client.engine)  # type: ignore[attr-defined]


async def test_text_documents_are_read_media_refused_but_a_tool_results_image_is_a_line(client_for):
    client = await client_for()
    text = "The meeting is on Tuesday."

    def body(*blocks: dict) -> dict:
        return {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": list(blocks)}]}  # fmt: skip

    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": text}}
    as_doc = await client.post("/v1/messages/count_tokens", json=body(doc))
    as_text = await client.post(
        "/v1/messages/count_tokens", json=body({"type": "text", "text": text})
    )
    assert as_doc.status_code == 200, as_doc.text
    assert as_doc.json() == as_text.json()
    ok = await client.post("/v1/messages", json=body(doc, {"type": "text", "text": "When?"}))
    assert ok.status_code == 200, ok.text
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
    }
    pdf = {"type": "document", "source": {**image["source"], "media_type": "application/pdf"}}
    call = {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [image]}
    tool_turn = [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    for payload, named in (
        (body(image), "'image' content blocks are not supported"),
        (body(pdf), "'application/pdf' is not supported"),
    ):
        r = await client.post("/v1/messages", json=payload)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert named in r.json()["error"]["message"], r.json()
    # an image a tool returned (resent every turn) is served, read as one line saying so
    served = await client.post("/v1/messages", json={**body(), "messages": tool_turn})
    assert served.status_code == 200, served.text
    as_line = [*tool_turn[:2], {"role": "user", "content": [{**result, "content": OMITTED_IMAGE}]}]
    counts = [
        (await client.post("/v1/messages/count_tokens", json={**body(), "messages": m})).json()
        for m in (tool_turn, as_line)
    ]
    assert counts[0] == counts[1], counts
    await wait_idle(client.engine)  # type: ignore[attr-defined]


async def test_a_seed_gives_the_same_tokens_as_the_chat_path_and_is_range_checked(client_for):
    """``seed`` is this server's extension of the Messages API: a seeded, sampled request
    repeats, as the same conversation on the chat path with that seed does."""
    client = await client_for()
    body = {**BODY, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    texts = []
    for _ in range(2):
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["content"][0]["text"])
    chat = {"model": MODEL, "max_tokens": 12, "temperature": 1.0, "seed": 7,
            "messages": BODY["messages"]}  # fmt: skip
    r = await client.post("/v1/chat/completions", json=chat)
    assert texts[0] == texts[1] == r.json()["choices"][0]["message"]["content"]
    other = await client.post("/v1/messages", json={**body, "seed": 8})
    assert other.json()["content"][0]["text"] != texts[0]
    bad = await client.post("/v1/messages", json={**body, "seed": 2**65})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "seed" in bad.json()["error"]["message"]
    await wait_idle(client.engine)  # type: ignore[attr-defined]


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "rome"]},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("field", ["output_config", "output_format"])
async def test_structured_output_follows_the_schema_streamed_or_not(client_for, field):
    """Anthropic's structured outputs (``output_config.format``; ``output_format`` in the
    beta): the answer's text is JSON that follows the schema, under the chat path's grammar."""
    client = await client_for()
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {**BODY, "max_tokens": 60, "temperature": 1.0,
            field: {"format": fmt} if field == "output_config" else fmt}  # fmt: skip
    texts = []
    for seed in (1, 2):
        r = await client.post("/v1/messages", json={**body, "seed": seed})
        assert r.status_code == 200, r.text
        texts.append(r.json()["content"][0]["text"])
        answer = json.loads(texts[-1])
        assert answer["city"] in ("paris", "rome") and isinstance(answer["ok"], bool)
        assert set(answer) == {"city", "ok"} and r.json()["stop_reason"] == "end_turn"
    streamed = await client.post("/v1/messages", json={**body, "seed": 1, "stream": True})
    events = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")
    ]
    text = "".join(
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )
    assert text == texts[0]
    wrong = {"format": {"type": "xml", "schema": SCHEMA}}
    bad = await client.post("/v1/messages", json={**BODY, "output_config": wrong})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    await wait_idle(client.engine)  # type: ignore[attr-defined]
