"""Structured outputs through the official SDK: the random-weight model cannot write JSON by
itself, so every valid answer here is the grammar's doing."""

from __future__ import annotations

import json
import threading
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.usefixtures("pool_free_after")


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: Literal[0, 2, 4]
    good: bool


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "tags", "score"],
    "additionalProperties": False,
}


IF_NO = 'Unimplemented keys: ["if"]'
BAD_TYPE = "Invalid type: no"


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _chat(oai, **kw):
    return oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "answer in JSON"}], **kw
    )


def test_parse_with_a_pydantic_model_is_valid_every_time(oai):
    for seed in range(8):
        r = oai.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "a pet"}], response_format=Pet,
            max_tokens=60, temperature=1.0, seed=seed,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Pet)
        assert " " not in r.choices[0].message.content  # compact: no free whitespace


def test_a_schema_with_strings_arrays_and_bounds(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        r = _chat(oai, response_format=fmt, max_tokens=80, temperature=0.8, seed=seed)
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"name", "tags", "score"} and 0 <= value["score"] <= 9
        assert len(value["name"]) <= 12 and set(value["tags"]) <= {"a", "b", "c"}


def test_json_object_mode_gives_an_object(oai):
    """Any object is allowed, so a random model may still be inside a string at max_tokens;
    what it wrote is an object's beginning, and a finished answer parses."""
    for seed in range(4):
        r = _chat(oai, response_format={"type": "json_object"}, max_tokens=40, seed=seed)
        content = r.choices[0].message.content
        assert content.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)


def test_streamed_structured_output_assembles_to_valid_json(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}
    stream = _chat(oai, response_format=fmt, max_tokens=60, temperature=0.7, seed=3, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Pet.model_validate_json(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_constrained_and_plain_requests_run_batched_together(oai):
    results: dict[int, object] = {}

    def run(i: int) -> None:
        if i % 2:
            results[i] = oai.chat.completions.parse(
                model=MODEL, messages=[{"role": "user", "content": f"pet {i}"}],
                response_format=Pet, max_tokens=60, temperature=1.0, seed=i,
            ).choices[0].message.parsed  # fmt: skip
        else:
            results[i] = _chat(oai, max_tokens=30, temperature=0).choices[0].finish_reason

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(results[i], Pet) for i in range(1, 8, 2))
    assert all(results[i] == "length" for i in range(0, 8, 2))


def test_the_same_seed_gives_the_same_structured_answer(oai):
    kw = {"response_format": Pet, "max_tokens": 60, "temperature": 1.0, "seed": 11}
    a = oai.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "p"}], **kw)
    b = oai.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "p"}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize(
    ("fmt", "words"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}, IF_NO),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}, BAD_TYPE),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "xml"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ],
)  # fmt: skip
def test_unsupported_or_invalid_formats_are_400_naming_the_problem(oai, fmt, words):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, response_format=fmt, max_tokens=5)
    body = info.value.body
    assert words in body["message"] or words == body["param"], body
