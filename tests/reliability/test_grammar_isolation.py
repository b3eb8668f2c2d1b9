"""A structured-output request's grammar is built off the engine thread and the event loop: a
schema that takes seconds to compile is that request's wait alone, every schema problem is a 400
naming the field before the engine sees it, and the same schema compiles once."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.reliability.conftest import MODEL, assert_error
from veloxquant_mlx.engine.request.grammar import GrammarBusyError, GrammarCompiler, GrammarError
from veloxquant_mlx.server.structured import schema_grammar

pytestmark = pytest.mark.anyio

PLAIN = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def wide_schema(n: int, prefix: str = "p") -> dict:
    """``n`` optional string properties."""
    props = {f"{prefix}{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props}


# Twelve objects of 400 optional properties, one after the other: under every limit, and about
# half a second to compile and warm on two cores (a plain request takes a few tens of ms).
SLOW = {
    "type": "object",
    "properties": {f"o{j}": wide_schema(400, f"a{j}_") for j in range(12)},
    "required": [f"o{j}" for j in range(12)],
}


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def structured(schema: dict, **extra) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return {**PLAIN, "max_tokens": 1, "response_format": fmt, **extra}


async def test_a_slow_compile_is_its_own_wait(client_for, monkeypatch):
    """While a schema compiles (held back here until the plain request is answered, so the
    order does not depend on the machine's speed), a plain request sent after it is answered
    first (before, the compile ran on the engine thread and every request waited behind it)."""
    started, release = threading.Event(), threading.Event()
    compile_ = GrammarCompiler._compile

    def held(self, *args):
        started.set()
        assert release.wait(60)
        return compile_(self, *args)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)
    client: httpx.AsyncClient = await client_for(grammar_timeout=120.0)
    order: list[str] = []

    async def send(name: str, body: dict) -> httpx.Response:
        r = await client.post("/v1/chat/completions", json=body, timeout=180)
        order.append(name)
        return r

    slow = asyncio.create_task(send("structured", structured(SLOW)))
    try:
        assert await asyncio.to_thread(started.wait, 30)  # compiling on a grammar worker
        plain = await asyncio.wait_for(send("plain", PLAIN), 60)
        assert plain.status_code == 200, plain.text
        assert order == ["plain"], "the plain request waited behind the grammar compile"
    finally:
        release.set()
    r = await slow
    assert r.status_code == 200, r.text


async def test_a_compile_over_the_budget_is_a_400_naming_the_field(client_for):
    client: httpx.AsyncClient = await client_for(grammar_timeout=0.01)
    r = await client.post("/v1/chat/completions", json=structured(SLOW))
    err = assert_error(r, 400, "invalid_value", "response_format.json_schema.schema")
    assert "did not compile" in err["message"]
    r = await client.post(
        "/v1/responses",
        json={
            "model": MODEL,
            "input": "hi",
            "max_output_tokens": 1,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": deep_schema(100)}},
        },
    )
    assert_error(r, 400, "invalid_value", "text.format.schema")
    r = await client.post("/v1/chat/completions", json=PLAIN)  # the engine serves on
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("schema", "what"),
    [
        (wide_schema(10_000), "optional properties"),  # a 289 KB schema
        ({"anyOf": [wide_schema(400, f"a{j}_") for j in range(12)]}, "optional properties"),
        (
            {
                "type": "object",
                "properties": {f"o{j}": wide_schema(300, f"o{j}_") for j in range(17)},
            },
            "5000 properties",
        ),
        (deep_schema(250), "nested"),
        ({"type": "string", "enum": [f"v{i}" for i in range(1_001)]}, "enum"),
        ({"type": "string", "enum": ["x" * 50_000, "y" * 50_000, "z" * 50_000]}, "characters"),
    ],
    ids=["wide", "wide-anyof", "many", "deep", "long-enum", "huge-enum-strings"],
)
async def test_schemas_over_the_limits_are_400s(client_for, schema, what):
    client: httpx.AsyncClient = await client_for(max_body_bytes=4 << 20)
    r = await client.post("/v1/chat/completions", json=structured(schema))
    err = assert_error(r, 400, "invalid_value", "response_format.json_schema.schema")
    assert what in err["message"], err
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    forced = {"type": "function", "function": {"name": "f"}}
    body = {**PLAIN, "tools": [tool], "tool_choice": forced}
    r = await client.post("/v1/chat/completions", json=body)
    # The embedded model has no tool-call format: that 400 may come first; never a 500.
    assert r.status_code == 400, r.text


def test_tool_parameters_are_checked_like_response_formats():
    from veloxquant_mlx.server.errors import APIError
    from veloxquant_mlx.server.schemas import ChatCompletionRequest
    from veloxquant_mlx.server.tools import tool_grammar

    class Tokenizer:  # a JSON-in-tags tool format, as mlx_lm's json_tools parser gives
        tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"

    import mlx_lm.tool_parsers.json_tools as json_tools

    Tokenizer.tool_parser = staticmethod(json_tools.parse_tool_call)  # type: ignore[attr-defined]
    body = ChatCompletionRequest.model_validate(
        {
            **PLAIN,
            "tools": [
                {"type": "function", "function": {"name": "ok", "parameters": {}}},
                {"type": "function", "function": {"name": "f", "parameters": deep_schema(250)}},
            ],
            "tool_choice": "required",
        }
    )
    with pytest.raises(APIError) as caught:
        tool_grammar(body, Tokenizer())
    assert caught.value.status == 400
    assert caught.value.param == "tools.1.function.parameters"


def test_the_compiler_caches_shares_and_bounds(default_model_dir):
    from veloxquant_mlx.engine.model.tokenizer import load_tokenizer
    from veloxquant_mlx.engine.request.grammar import grammar_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    ll = grammar_tokenizer(tokenizer, 2048)
    compiler = GrammarCompiler(ll, workers=1, max_pending=1, cache_size=2)
    try:
        text = schema_grammar(wide_schema(3), "s")
        first, again = compiler.compile(text), compiler.compile(text)
        assert first.compiled is again.compiled  # one compile, one cached matcher
        assert first.matcher() is not first.compiled  # each request decodes its own copy
        slow = compiler.submit(schema_grammar(SLOW, "s"))
        assert compiler.submit(schema_grammar(SLOW, "s")) is slow  # shared
        with pytest.raises(GrammarBusyError):
            compiler.submit(schema_grammar(wide_schema(4), "s"))
        slow.result()
        bad = schema_grammar({"type": "string", "pattern": "(((("}, "s")
        with pytest.raises(GrammarError):
            compiler.compile(bad)
        with pytest.raises(GrammarError):  # refusals are cached too
            compiler.submit(bad).result(timeout=0)
    finally:
        compiler.shutdown()


async def test_a_schema_with_no_value_is_a_400_not_an_empty_answer(client_for):
    """``{"$ref": "#"}`` refers only to itself: no JSON value matches it. It used to answer 200
    with empty content; the compile sees that only end-of-sequence could come first."""
    client: httpx.AsyncClient = await client_for()
    r = await client.post("/v1/chat/completions", json=structured({"$ref": "#"}, max_tokens=8))
    err = assert_error(r, 400, "invalid_value", "response_format.json_schema.schema")
    assert "no value" in err["message"]


async def test_unsatisfiable_and_odd_schemas_are_400s_in_plain_words(client_for):
    """Bounds that contradict each other, an unknown format, a pattern of a million
    repetitions: each a clear answer (400 naming the field, or a constrained 200), never a
    500 or a library's internals (``min=Some(...)``) in the message."""
    client: httpx.AsyncClient = await client_for()
    subs = [
        {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2},
        {"type": "number", "minimum": 1.5, "maximum": 1.2},
        {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
        {"type": "integer", "multipleOf": 0},
        {"type": "string", "format": "nonsense"},
        {"type": "string", "minLength": 5, "maxLength": 2},
    ]
    for sub in subs:
        schema = {"type": "object", "properties": {"a": sub}, "required": ["a"]}
        r = await client.post("/v1/chat/completions", json=structured(schema))
        err = assert_error(r, 400, "invalid_value", "response_format.json_schema.schema")
        assert "Some(" not in err["message"] and "None" not in err["message"], err
    pattern = {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{1000000}"}},
               "required": ["a"]}  # fmt: skip
    r = await client.post(
        "/v1/chat/completions", json=structured(pattern, max_tokens=6, temperature=0)
    )
    assert r.status_code == 200, r.text  # built lazily: it constrains, it does not fail
    assert r.json()["choices"][0]["message"]["content"].startswith('{"a":"')
