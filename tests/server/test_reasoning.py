"""Reasoning apart from the answer: the splitter however the text is chunked, and the chat,
Responses and Messages paths for a model whose template opens a think block."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.server.conftest import MODEL, wait_idle
from veloxquant_mlx.server.reasoning import ReasoningSplitter

START, END = "<think>", "</think>"
# A template that writes both tags and opens the think block itself (as DeepSeek-R1's does).
THINK_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if thinking is not defined or thinking %}"
    "<think>\n{% else %}<think></think>{% endif %}{% endif %}"
)
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "why?"}], "max_tokens": 12,
       "temperature": 0}  # fmt: skip

text_without_tags = st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=30)


def run(splitter: ReasoningSplitter, text: str, cuts: list[int]) -> tuple[str, str]:
    reasoning, answer, last = [], [], 0
    for cut in [*sorted(c % (len(text) + 1) for c in cuts), len(text)]:
        r, a = splitter.feed(text[last:cut])
        reasoning.append(r)
        answer.append(a)
        last = max(last, cut)
    r, a = splitter.finish()
    return "".join(reasoning) + r, "".join(answer) + a


@given(thought=text_without_tags, answer=text_without_tags, inside=st.booleans(),
       cuts=st.lists(st.integers(0, 200), max_size=10))  # fmt: skip
def test_the_reasoning_and_the_answer_come_apart_however_the_text_is_chunked(
    thought, answer, inside, cuts
):
    text = ("" if inside else START) + thought + END + "\n" + answer
    got = run(ReasoningSplitter(START, END, inside=inside), text, cuts)
    assert got == (thought, answer.lstrip("\n"))


@given(answer=text_without_tags, cuts=st.lists(st.integers(0, 200), max_size=10))
def test_an_answer_without_a_think_block_is_all_answer(answer, cuts):
    assert run(ReasoningSplitter(START, END), answer, cuts) == ("", answer)


def test_a_cut_off_thought_stays_reasoning():
    assert run(ReasoningSplitter(START, END, inside=True), "still thinking </thi", []) == (
        "still thinking </thi",
        "",
    )


@pytest.mark.anyio
async def test_chat_responses_and_messages_return_the_reasoning_apart(client_for):
    client = await client_for(chat_template=THINK_TEMPLATE)
    r = (await client.post("/v1/chat/completions", json=ASK)).json()
    message = r["choices"][0]["message"]
    # The output starts inside the block the template opened and (random weights) never
    # closes it: all of it is reasoning.
    assert message["reasoning_content"] and message["content"] is None
    streamed = await client.post("/v1/chat/completions", json={**ASK, "stream": True})
    deltas = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    thought = "".join(d["choices"][0]["delta"].get("reasoning_content", "") for d in deltas
                      if d["choices"])  # fmt: skip
    assert thought == message["reasoning_content"]
    assert not any(d["choices"][0]["delta"].get("content") for d in deltas if d["choices"])
    # Off for one request: the template's own switch (chat_template_kwargs).
    off = await client.post("/v1/chat/completions",
                            json={**ASK, "chat_template_kwargs": {"thinking": False}})  # fmt: skip
    assert off.json()["choices"][0]["message"]["reasoning_content"] is None
    assert off.json()["choices"][0]["message"]["content"]
    # OpenAI's reasoning_effort: "none" is the template's switch off, the others leave it on;
    # the Responses API's reasoning.effort is the same; an explicit template variable wins.
    for effort, thinks in (("none", False), ("minimal", True), ("high", True)):
        got = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": effort})
        assert bool(got.json()["choices"][0]["message"]["reasoning_content"]) is thinks, effort
    kinds = (await client.post("/v1/responses", json={
        "model": MODEL, "input": "why?", "max_output_tokens": 12, "temperature": 0,
        "reasoning": {"effort": "none"}})).json()["output"]  # fmt: skip
    assert [k["type"] for k in kinds] == ["message"]
    both = {**ASK, "reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}}
    got = await client.post("/v1/chat/completions", json=both)
    assert got.json()["choices"][0]["message"]["reasoning_content"]
    bad = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "max"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    resp = await client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "why?", "max_output_tokens": 12, "temperature": 0},
    )
    kinds = [item["type"] for item in resp.json()["output"]]
    assert kinds[0] == "reasoning"
    assert resp.json()["output"][0]["content"][0]["text"] == message["reasoning_content"]
    msg = await client.post("/v1/messages", json={**ASK})
    assert msg.json()["content"][0] == {
        "type": "thinking",
        "thinking": message["reasoning_content"],
        "signature": "",
    }
    # Anthropic's thinking switch turns the template's off or on; absent, its default holds
    enabled = {"type": "enabled", "budget_tokens": ASK["max_tokens"] - 1}
    on = await client.post("/v1/messages", json={**ASK, "thinking": enabled})
    assert on.json()["content"] == msg.json()["content"]
    # a budget at or past max_tokens is refused, as Anthropic's API does
    too_big = {**enabled, "budget_tokens": ASK["max_tokens"]}
    over = await client.post("/v1/messages", json={**ASK, "thinking": too_big})
    assert over.status_code == 400 and over.json()["error"]["type"] == "invalid_request_error"
    assert over.json()["error"]["message"] == (
        "`max_tokens` must be greater than `thinking.budget_tokens`"
    )
    off = await client.post("/v1/messages", json={**ASK, "thinking": {"type": "disabled"}})
    assert [b["type"] for b in off.json()["content"]] == ["text"], off.text
    await wait_idle(client.engine)  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_reasoning_off_leaves_it_in_the_answer(client_for):
    client = await client_for(chat_template=THINK_TEMPLATE, reasoning="off")
    message = (await client.post("/v1/chat/completions", json=ASK)).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    await wait_idle(client.engine)  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_constrained_answer_is_the_content_even_when_the_template_opens_a_think_block(
    client_for,
):
    client = await client_for(chat_template=THINK_TEMPLATE)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = await client.post("/v1/chat/completions", json={**ASK, "max_tokens": 30,
                                                        "response_format": fmt})  # fmt: skip
    message = r.json()["choices"][0]["message"]
    assert set(json.loads(message["content"])) == {"a"}
    assert message.get("reasoning_content") is None
    await wait_idle(client.engine)  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_the_reasoning_comes_apart_under_strict_tools_whose_text_stays_free(client_for):
    # The template also names JSON tool calls in tags (mlx_lm then infers that format), so a
    # strict function under tool_choice auto gets the grammar that leaves the text free: its
    # think block is split from the answer as without tools.
    template = THINK_TEMPLATE + "{# <tool_call> tool_call.name #}"
    client = await client_for(chat_template=template)
    tool = {"type": "function", "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
    }}  # fmt: skip
    r = await client.post("/v1/chat/completions", json={**ASK, "tools": [tool]})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"], message
    await wait_idle(client.engine)  # type: ignore[attr-defined]
