"""Tool calling through the official SDK on a real server whose model has a tool-call chat
template (the embedded weights with a Hermes-style template: JSON in <tool_call> tags, parsed by
mlx_lm's json_tools parser). The random weights never choose a tool: "required" and a named
function must come out as valid calls every time because the grammar makes them."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, TIME, WEATHER


@pytest.fixture(scope="module")
def oai(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0)


def _ask(oai, **kw):
    return oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], **kw
    )


def test_required_tool_choice_always_calls_a_tool(oai):
    for seed in range(5):
        r = _ask(oai, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, seed=seed,
                 parallel_tool_calls=False)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["city"] in {"Paris", "Oslo", "Lima"} and args["unit"] in {"c", "f"}
        else:
            assert call.function.name == "get_time" and -12 <= args["zone"] <= 14
        assert not choice.message.content


def test_a_named_function_is_the_one_called(oai):
    r = _ask(oai, tools=[WEATHER, TIME], max_tokens=60, seed=1,
             tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]


def test_streamed_tool_calls_arrive_as_tool_call_deltas(oai):
    stream = _ask(oai, tools=[WEATHER], tool_choice="required", max_tokens=80, seed=2,
                  stream=True, parallel_tool_calls=False)  # fmt: skip
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].index == 0
    json.loads(calls[0].function.arguments)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_a_cut_tool_call(oai, stream):
    """Not template text in the content: a tool call as far as it came, finish_reason length."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _ask(oai, tools=[WEATHER, TIME], tool_choice=named, max_tokens=16, seed=3, stream=stream)
    if stream:
        chunks = list(r)
        finish = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        names = [d.function.name for d in deltas if d.function and d.function.name]
    else:
        finish = [r.choices[0].finish_reason]
        text = r.choices[0].message.content or ""
        names = [c.function.name for c in r.choices[0].message.tool_calls or []]
    assert finish == ["length"]
    assert names == ["get_weather"]
    assert "<tool_call>" not in text


def test_tools_with_a_response_format_may_call_a_tool_or_answer_in_the_schema(oai):
    """tool_choice auto (unset) with a json_schema response_format, the OpenAI Agents SDK's and
    the AI SDK's pattern: each answer is one valid tool call or the schema's JSON, and over a
    few seeds both come (the tools are not locked out by the schema)."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 12}},
        "required": ["answer"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    kinds = set()
    for seed in range(8):
        r = _ask(oai, tools=[WEATHER, TIME], response_format=fmt, max_tokens=120, seed=seed,
                 temperature=1.0)  # fmt: skip
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            call = choice.message.tool_calls[0].function
            assert call.name in ("get_weather", "get_time")
            json.loads(call.arguments)
            kinds.add("call")
        elif choice.finish_reason == "stop":
            assert set(json.loads(choice.message.content)) == {"answer"}
            kinds.add("answer")
    assert kinds == {"call", "answer"}


def test_a_tool_result_conversation_renders_and_answers(oai):
    first = _ask(oai, tools=[WEATHER], tool_choice="required", max_tokens=80, seed=4,
                 parallel_tool_calls=False)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_resent_tool_call_hits_the_cache_through_the_call(oai):
    """An agent's tool-call turn: the calls come back as calls (the template renders their JSON
    its own way), are rendered as the text the model generated, and the next prompt's cached
    pages run through them (in pages of 16)."""
    system = {"role": "system", "content": "Call the tools you are given. " * 12}
    asked = [system, {"role": "user", "content": "weather in Oslo?"}]
    first = oai.chat.completions.create(
        model=MODEL, messages=asked, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0,
    )  # fmt: skip
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    messages = [
        *asked,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temp": 3}'},
    ]
    second = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4, temperature=0
    )
    seen = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == seen // 16 * 16


def test_tool_choice_none_keeps_tools_out_of_the_prompt(oai):
    with_none = _ask(oai, tools=[WEATHER], tool_choice="none", max_tokens=2, temperature=0)
    without = _ask(oai, max_tokens=2, temperature=0)
    assert with_none.usage.prompt_tokens == without.usage.prompt_tokens
    auto = _ask(oai, tools=[WEATHER], max_tokens=2, temperature=0)
    assert auto.usage.prompt_tokens > without.usage.prompt_tokens  # rendered into the template


def test_the_embedded_model_calls_tools_and_one_without_a_tool_format_says_so(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
        tool_choice="required", max_tokens=80, temperature=0,
    )  # fmt: skip
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0"),
        ({"tools": [WEATHER], "messages": [
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{not json"}}]}]}, "JSON"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(tool_server, extra, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(f"{tool_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.text
    assert r.json()["error"]["param"], "a 400 about a field names it"
    if "tool_choice" in extra:
        assert r.json()["error"]["param"] == "tool_choice"
