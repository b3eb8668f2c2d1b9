"""The Anthropic Messages API through the official `anthropic` SDK on a real server (the
embedded weights with a Hermes-style tool template): create, stream, tools with a tool_result
turn, count_tokens, stop sequences, errors in Anthropic's shape, and a request shaped like
Claude Code's."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.e2e.conftest import MODEL, TIME, WEATHER

TOOLS = [
    {"name": t["function"]["name"], "description": t["function"].get("description", ""),
     "input_schema": t["function"]["parameters"]}
    for t in (WEATHER, TIME)
]  # fmt: skip
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "claude_code_request.json"


@pytest.fixture(scope="module")
def claude(tool_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tool_server.base_url, api_key="x", max_retries=0)


def ask(claude, **kw):
    """``temperature`` goes in the body: the SDK no longer takes it (Anthropic's newer models
    ignore it), while older SDKs and other clients send it, and this server honours it."""
    kw.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    if "temperature" in kw:
        kw["extra_body"] = {"temperature": kw.pop("temperature")}
    return claude.messages.create(model=MODEL, max_tokens=kw.pop("max_tokens", 16), **kw)


def test_create_answers_in_text_with_usage_from_the_prefix_cache(claude):
    system = [{"type": "text", "text": "Be brief. " * 20, "cache_control": {"type": "ephemeral"}}]
    first = ask(claude, system=system, temperature=0)
    again = ask(claude, system=system, temperature=0)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in first.content] == ["text"]
    assert first.content[0].text == again.content[0].text  # greedy
    counted = claude.messages.count_tokens(
        model=MODEL, system=system, messages=[{"role": "user", "content": "weather in Paris?"}]
    )
    u = again.usage
    assert u.input_tokens + u.cache_read_input_tokens == counted.input_tokens
    assert u.cache_read_input_tokens > 0  # the second turn found the first's prompt
    assert 0 < u.output_tokens <= 16


def test_the_next_turn_hits_the_cache_through_the_resent_answer(claude):
    """A Claude-Code-style loop resends the answer as a text block: the server encodes it with
    the tokens it generated, so the cache reads through it (in pages of 16)."""
    system = "Answer in full. " * 20
    messages = [{"role": "user", "content": "Tell me about the resent answers."}]
    first = ask(claude, system=system, messages=messages, max_tokens=40, temperature=0)
    text = "".join(b.text for b in first.content if b.type == "text")
    assert first.usage.output_tokens == 40 and text
    messages += [
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": "Go on."},
    ]
    second = ask(claude, system=system, messages=messages, max_tokens=4, temperature=0)
    prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    seen = prompt + first.usage.output_tokens - 1  # the answer's last token is never fed
    assert second.usage.cache_read_input_tokens == seen // 16 * 16


def test_a_stream_is_the_same_message_as_its_events(claude):
    with claude.messages.stream(
        model=MODEL, max_tokens=12, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "weather in Paris?"}],
    ) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0
    plain = ask(claude, max_tokens=12, temperature=0)
    assert plain.content[0].text == text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_calls_a_tool_and_a_tool_result_turn_answers(claude, stream):
    kw = {"tools": TOOLS, "tool_choice": {"type": "any"}, "max_tokens": 120, "temperature": 0}
    if stream:
        kw["extra_body"] = {"temperature": kw.pop("temperature")}
        with claude.messages.stream(model=MODEL, messages=[
            {"role": "user", "content": "weather in Paris?"}], **kw) as s:  # fmt: skip
            message = s.get_final_message()
    else:
        message = ask(claude, **kw)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in ("get_weather", "get_time")
    assert isinstance(uses[0].input, dict) and uses[0].id.startswith("toolu_")
    turn = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}]},
    ]  # fmt: skip
    after = ask(claude, messages=turn, tools=TOOLS, max_tokens=8, temperature=0)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    named = ask(claude, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"},
                max_tokens=80, temperature=0)  # fmt: skip
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]


def test_a_stop_sequence_is_reported_with_its_text(claude):
    full = ask(claude, max_tokens=30, temperature=0).content[0].text
    assert len(full) > 8
    stop = full[4:7]
    cut = ask(claude, max_tokens=30, temperature=0, stop_sequences=["\x00never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[: full.index(stop)]


def test_the_sdk_lists_and_retrieves_the_model_in_anthropics_shape(claude):
    listed = claude.models.list()
    model = listed.data[0]
    assert model.id == MODEL
    assert model.type == "model" and model.display_name == MODEL
    assert model.created_at.tzinfo is not None and model.created_at.year >= 2025
    assert listed.has_more is False and listed.first_id == MODEL
    assert claude.models.retrieve(MODEL).created_at == model.created_at


def test_errors_have_anthropics_shape(claude, tool_server):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="gpt-nope", max_tokens=4,
                               messages=[{"role": "user", "content": "x"}])  # fmt: skip
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"
    url = f"{tool_server.base_url}/v1/messages"
    for body in (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
        {"model": MODEL, "max_tokens": 4, "messages": []},
        {"model": MODEL, "max_tokens": 4, "temperature": 3,
         "messages": [{"role": "user", "content": "x"}]},
        {"model": MODEL, "max_tokens": 4, "tool_choice": {"type": "tool", "name": "nope"},
         "tools": TOOLS, "messages": [{"role": "user", "content": "x"}]},
    ):  # fmt: skip
        r = httpx.post(url, json=body, headers={"anthropic-version": "2023-06-01"}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert set(r.json()["error"]) == {"type", "message"}


def test_over_the_context_window_is_worded_as_anthropic_words_it(claude):
    """Claude Code compacts a conversation on "prompt is too long" and lowers max_tokens from
    the numbers of "input length and `max_tokens` exceed context limit": the same wording,
    streamed or not."""
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(claude, messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=10)
    message = info.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" > 8192 maximum")
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as info:
            ask(claude, max_tokens=9000, stream=stream)
        message = info.value.body["error"]["message"]
        assert message.startswith("input length and `max_tokens` exceed context limit: ")
        assert " + 9000 > 8192, decrease input length or `max_tokens`" in message


def test_a_request_shaped_like_claude_codes_streams(tool_server):
    body = json.loads(FIXTURE.read_text())
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking",
               "x-api-key": "x"}  # fmt: skip
    url = f"{tool_server.base_url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        kinds = [
            line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")
        ]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    counted = httpx.post(f"{url}/count_tokens", json={k: body[k] for k in (
        "model", "system", "tools", "messages")}, headers=headers, timeout=30)  # fmt: skip
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 500
