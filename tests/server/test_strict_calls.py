"""``strict`` functions under ``tool_choice`` "auto" (``tools.strict_calls_grammar``): the answer
stays free, and a call the model starts follows a known tool's name and, where the function is
strict, its ``parameters``. Checked against llguidance itself, with the embedded model's
tokenizer (its template writes JSON calls in <tool_call> tags), and through the server."""

from __future__ import annotations

import json

import llguidance
import pytest

from tests.e2e.conftest import TIME, WEATHER
from tests.server.conftest import MODEL, wait_idle
from veloxquant_mlx.engine.model.tokenizer import load_tokenizer
from veloxquant_mlx.engine.request.grammar import grammar_tokenizer
from veloxquant_mlx.server.schemas import ChatCompletionRequest
from veloxquant_mlx.server.tools import strict_calls_grammar

STRICT_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**ASK, "tools": [STRICT_WEATHER, TIME], **kw})


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether llguidance lets the model write ``text`` and then stop."""
    ll = grammar_tokenizer(tokenizer, len(tokenizer.vocab))
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_strict_functions_call_follows_its_schema_and_the_text_stays_free(tokenizer):
    grammar = strict_calls_grammar(body(), tokenizer)
    assert grammar is not None
    paris = call("get_weather", {"city": "Paris", "unit": "c"}).replace(" ", "")
    assert accepts(tokenizer, grammar, "Any text at all, {json} and <tags>, spread\nover lines.")
    assert accepts(tokenizer, grammar, "I'll look that up. " + paris)
    assert accepts(tokenizer, grammar, paris)  # a call with no text before it
    # the strict function's schema: an unknown city, a missing unit, an extra key
    for args in ({"city": "Rome", "unit": "c"}, {"city": "Paris"},
                 {"city": "Paris", "unit": "c", "day": 1}):  # fmt: skip
        assert not accepts(tokenizer, grammar, call("get_weather", args).replace(" ", ""))
    # a function that is not strict takes any object; a name no tool has is refused
    assert accepts(tokenizer, grammar, call("get_time", {"anything": [1]}).replace(" ", ""))
    assert not accepts(tokenizer, grammar, call("get_news", {}).replace(" ", ""))
    # calls end the answer: more calls when parallel calls are allowed, never text after them
    assert accepts(tokenizer, grammar, paris + "\n" + paris)
    assert not accepts(tokenizer, grammar, paris + " done")
    one = strict_calls_grammar(body(parallel_tool_calls=False), tokenizer)
    assert one is not None and accepts(tokenizer, one, paris)
    assert not accepts(tokenizer, one, paris + "\n" + paris)


def test_only_auto_with_a_strict_function_and_no_json_format_takes_it(tokenizer):
    assert strict_calls_grammar(body(tools=[WEATHER, TIME]), tokenizer) is None  # none strict
    assert strict_calls_grammar(body(tool_choice="required"), tokenizer) is None
    assert strict_calls_grammar(body(tool_choice="none"), tokenizer) is None
    assert strict_calls_grammar(body(response_format={"type": "json_object"}), tokenizer) is None
    assert strict_calls_grammar(body(response_format={"type": "text"}), tokenizer) is not None
    assert strict_calls_grammar(body(tool_choice="auto"), tokenizer) is not None


@pytest.mark.anyio
async def test_a_strict_tool_under_auto_answers_through_the_server(client_for):
    """The answer comes back as ever (random weights write text); a strict function's schema
    goes through the grammar compiler (one it cannot hold is a 400 naming the tool), where the
    same function not strict is not compiled at all."""
    client = await client_for()
    odd = {"type": "object", "if": {"required": ["city"]}, "then": {"required": ["unit"]}}
    for strict, status in ((True, 400), (False, 200)):
        tool = {"type": "function",
                "function": {"name": "f", "parameters": odd, "strict": strict}}  # fmt: skip
        r = await client.post("/v1/chat/completions",
                              json={**ASK, "tools": [tool], "max_tokens": 4})  # fmt: skip
        assert r.status_code == status, r.text
        if status == 400:
            error = r.json()["error"]
            assert error["param"] == "tools" and '"if"' in error["message"], error
        # Responses: a function tool's strict, the same
        tool = {"type": "function", "name": "f", "parameters": odd, "strict": strict}
        ask = {"model": MODEL, "input": "weather?", "tools": [tool], "max_output_tokens": 4}
        r = await client.post("/v1/responses", json=ask)
        assert r.status_code == status, r.text
        # Messages: a tool's strict holds its input_schema the same way
        tool = {"name": "f", "input_schema": odd, "strict": strict}
        r = await client.post("/v1/messages", json={**ASK, "tools": [tool], "max_tokens": 4})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["type"] == "error" and '"if"' in r.json()["error"]["message"]
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={
            **ASK, "tools": [STRICT_WEATHER], "max_tokens": 12, "seed": 3, "stream": stream,
        })  # fmt: skip
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length", "tool_calls")
            assert choice["message"]["content"] or choice["message"]["tool_calls"]
    await wait_idle(client.engine)  # type: ignore[attr-defined]
