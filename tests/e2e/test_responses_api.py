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
    stream = client.responses.create(
        model=MODEL, input="weather?", tools=[fn], tool_choice="required",
        max_output_tokens=80, parallel_tool_calls=False, stream=True,
    )  # fmt: skip
    kinds = [e.type for e in stream]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_is_not_supported_is_400(oai, extra, param):
    body = {"model": MODEL, "input": "x", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(**body)
    assert info.value.body["param"] == param, info.value.body
