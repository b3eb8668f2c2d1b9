"""POST /v1/responses through the official SDK: text, message lists, instructions, streaming
with the documented events, structured output, tools (on the tool-template model), errors."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import MODEL, WEATHER

pytestmark = pytest.mark.usefixtures("pool_free_after")


class Answer(BaseModel):
    verdict: Literal["yes", "no"]
    confidence: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def test_text_input(oai):
    r = oai.responses.create(model=MODEL, input="Say hi", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert isinstance(r.output_text, str) and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens == 0


def test_instructions_and_message_lists(oai):
    plain = oai.responses.create(model=MODEL, input="x", max_output_tokens=2, temperature=0)
    r = oai.responses.create(
        model=MODEL, instructions="Be brief.", max_output_tokens=2, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
    )  # fmt: skip
    assert r.usage.input_tokens > plain.usage.input_tokens  # the instructions are in the prompt


def test_streaming_follows_the_documented_event_sequence(oai):
    events = list(
        oai.responses.create(
            model=MODEL, input="stream please", max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text and deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == done.text and final.usage.output_tokens == 12


def test_structured_output_with_parse(oai):
    for seed in range(3):
        r = oai.responses.parse(
            model=MODEL, input="yes or no?", text_format=Answer, max_output_tokens=40,
            temperature=1.0,
        )  # fmt: skip
        assert isinstance(r.output_parsed, Answer), (seed, r.output_text)


def test_tools_required_gives_function_call_items(tool_server):
    client = openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0)
    fn = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(
        model=MODEL, input="weather?", tools=[fn], tool_choice="required", max_output_tokens=80,
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    follow = client.responses.create(
        model=MODEL, tools=[fn], max_output_tokens=4, temperature=0,
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"},
        ],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete")
    # The same turn by previous_response_id: the stored call continues with its output.
    chained = client.responses.create(
        model=MODEL, tools=[fn], max_output_tokens=4, temperature=0, previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"}],
    )  # fmt: skip
    assert chained.previous_response_id == r.id
    assert chained.usage.input_tokens == follow.usage.input_tokens
    assert chained.output_text == follow.output_text
    stream = client.responses.create(
        model=MODEL, input="weather?", tools=[fn], tool_choice="required",
        max_output_tokens=80, parallel_tool_calls=False, stream=True,
    )  # fmt: skip
    kinds = [e.type for e in stream]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),  # never stored
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"tools": [{"type": "namespace", "name": "a", "tools": []}]}, "tools.0.tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_is_not_supported_is_400(oai, extra, param):
    body = {"model": MODEL, "input": "x", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(**body)
    assert info.value.body["param"] == param, info.value.body


def test_previous_response_id_continues_a_stored_conversation(oai):
    first = oai.responses.create(
        model=MODEL, instructions="Be brief.", input="My name is Ada.", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert first.store is True and first.previous_response_id is None
    second = oai.responses.create(
        model=MODEL, previous_response_id=first.id, input="What is my name?",
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    # The same as sending the conversation whole; the first turn's instructions are not
    # carried over (the API's rule).
    whole = oai.responses.create(
        model=MODEL, store=False, max_output_tokens=6, temperature=0,
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    # A third turn walks the chain of two.
    third = oai.responses.create(
        model=MODEL, previous_response_id=second.id, input="Thanks.", max_output_tokens=2,
        temperature=0,
    )  # fmt: skip
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= 32  # second's prompt, cached
    # Stored responses are returned and can be deleted; a deleted or unstored one cannot be
    # continued.
    got = oai.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    for gone in (first.id, whole.id):
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model=MODEL, previous_response_id=gone, input="x")
        assert info.value.body["code"] == "previous_response_not_found"
        assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:  # second continued the deleted first
        oai.responses.create(model=MODEL, previous_response_id=second.id, input="x")
    assert "no longer stored" in info.value.body["message"]


def test_a_streamed_response_is_stored_when_it_completes(oai):
    events = list(
        oai.responses.create(
            model=MODEL, input="stream please", max_output_tokens=5, temperature=0, stream=True
        )
    )
    final = events[-1].response
    assert events[0].response.store is True and final.store is True
    assert oai.responses.retrieve(final.id).output_text == final.output_text
    after = oai.responses.create(
        model=MODEL, previous_response_id=final.id, input="more", max_output_tokens=2
    )
    assert after.usage.input_tokens > final.usage.input_tokens


PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}


def test_codex_turns_custom_tools_and_resent_reasoning(tool_server):
    """What Codex sends every turn: its custom tool, its earlier reasoning items (store off,
    so resent whole), custom tool calls and their outputs, and a reasoning effort."""
    client = openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0)
    fn = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(
        model=MODEL, input="patch it", tools=[fn, PATCH], max_output_tokens=60, store=False,
        tool_choice={"type": "custom", "name": "apply_patch"}, reasoning={"effort": "low"},
        temperature=0,
    )  # fmt: skip
    calls = [o for o in r.output if o.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "apply_patch", r.output
    assert isinstance(calls[0].input, str) and calls[0].call_id
    streamed = list(
        client.responses.create(
            model=MODEL, input="patch it", tools=[fn, PATCH], max_output_tokens=60, store=False,
            tool_choice={"type": "custom", "name": "apply_patch"}, reasoning={"effort": "low"},
            temperature=0, stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in streamed]
    assert "response.custom_tool_call_input.done" in kinds, kinds
    done = next(e for e in streamed if e.type == "response.custom_tool_call_input.done")
    assert done.input == calls[0].input  # greedy, the same prompt
    # The next turn resends the reasoning, the call and its output; the reasoning is read and
    # left out of the prompt, the custom call is the function call the model made.
    history = [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "patch it"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}],
         "encrypted_content": "opaque"},
        {"type": "custom_tool_call", "call_id": calls[0].call_id, "name": "apply_patch",
         "input": calls[0].input},
        {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done!"},
    ]  # fmt: skip
    follow = client.responses.create(
        model=MODEL, input=history, tools=[fn, PATCH], max_output_tokens=4, temperature=0,
        store=False,
    )  # fmt: skip
    without_reasoning = client.responses.create(
        model=MODEL, input=[history[0], *history[2:]], tools=[fn, PATCH], max_output_tokens=4,
        temperature=0, store=False,
    )  # fmt: skip
    assert follow.usage.input_tokens == without_reasoning.usage.input_tokens
    assert follow.output_text == without_reasoning.output_text
    as_function = client.responses.create(
        model=MODEL, tools=[fn, PATCH], max_output_tokens=4, temperature=0, store=False,
        input=[
            history[0],
            {"type": "function_call", "call_id": calls[0].call_id, "name": "apply_patch",
             "arguments": json.dumps({"input": calls[0].input})},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Done!"},
        ],
    )  # fmt: skip
    assert as_function.usage.input_tokens == follow.usage.input_tokens
    # Codex's other tools: a namespace of functions and web_search, which nothing here runs
    # (left out: the prompt is the one without it)
    space = {
        "type": "namespace",
        "name": "agents",
        "description": "Sub-agents",
        "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
    }
    plain = client.responses.create(model=MODEL, input="hi", tools=[fn, space],
                                    max_output_tokens=2, temperature=0)  # fmt: skip
    searching = client.responses.create(
        model=MODEL, input="hi", tools=[fn, space, {"type": "web_search"}], max_output_tokens=2,
        temperature=0,
    )  # fmt: skip
    assert searching.usage.input_tokens == plain.usage.input_tokens
    assert searching.output_text == plain.output_text
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "extreme"})
    assert info.value.body["param"] == "reasoning.effort", info.value.body
