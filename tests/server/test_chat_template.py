"""--chat-template (a file or the template's text) in place of the model's, and a request's
chat_template_kwargs."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TOOL_TEMPLATE, WEATHER
from tests.server.conftest import MODEL, wait_idle
from veloxquant_mlx.config import Settings
from veloxquant_mlx.server.tools import fold_late_system

pytestmark = pytest.mark.anyio

# A template without a tool-call format (the embedded model's own has one).
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 60}
FORCED = {**ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0}


async def test_a_template_with_a_tool_format_gives_the_model_tools(client_for, tmp_path):
    plain = await client_for(chat_template=PLAIN_TEMPLATE)
    r = await plain.post("/v1/chat/completions", json=FORCED)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "tool calling" in r.json()["error"]["message"]
    path = tmp_path / "hermes.jinja"
    path.write_text(TOOL_TEMPLATE)
    for value in (str(path), TOOL_TEMPLATE):
        client = await client_for(chat_template=value)
        r = await client.post("/v1/chat/completions", json=FORCED)
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        await wait_idle(client.engine)  # type: ignore[attr-defined]


async def test_chat_template_kwargs_reach_the_template(client_for):
    template = (
        "{% if shout %}LOUD {% endif %}{{ reasoning_effort | default('') }}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    client = await client_for(chat_template=template)
    quiet = await client.post("/v1/chat/completions", json={**ASK, "max_tokens": 1})
    loud = await client.post(
        "/v1/chat/completions",
        json={**ASK, "max_tokens": 1, "chat_template_kwargs": {"shout": True}},
    )
    assert quiet.status_code == loud.status_code == 200
    assert loud.json()["usage"]["prompt_tokens"] > quiet.json()["usage"]["prompt_tokens"]
    # the effort by its OpenAI and Anthropic names, as gpt-oss's template reads it
    effort = await client.post(
        "/v1/chat/completions", json={**ASK, "max_tokens": 1, "reasoning_effort": "high"}
    )
    quiet_tokens = quiet.json()["usage"]["prompt_tokens"]
    assert effort.json()["usage"]["prompt_tokens"] > quiet_tokens
    msg = {"model": MODEL, "max_tokens": 1, "messages": ASK["messages"]}
    plain = await client.post("/v1/messages", json=msg)
    high = await client.post("/v1/messages", json={**msg, "output_config": {"effort": "high"}})
    top = await client.post("/v1/messages", json={**msg, "output_config": {"effort": "max"}})
    tokens = [sum(r.json()["usage"][k] for k in ("input_tokens", "cache_read_input_tokens"))
              for r in (plain, high, top)]  # fmt: skip
    assert tokens == [quiet_tokens, effort.json()["usage"]["prompt_tokens"], quiet_tokens]
    bad = await client.post(
        "/v1/chat/completions", json={**ASK, "chat_template_kwargs": {"tools": []}}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    await wait_idle(client.engine)  # type: ignore[attr-defined]


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused():
    with pytest.raises(ValueError, match="chat_template"):
        Settings(chat_template="no-such-file.jinja")


# Gemma's rule: a system message only first; the roles after it alternate user / assistant.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LATE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "say hi"},
    {"role": "system", "content": "Agent types: Explore, Plan."},
]


def test_late_system_messages_fold_into_the_user_turn_beside_them():
    assert fold_late_system(LATE[:2]) is None
    assert fold_late_system(LATE) == [
        LATE[0],
        {"role": "user", "content": "say hi\n\nAgent types: Explore, Plan."},
    ]
    turns = [LATE[0], {"role": "assistant", "content": "a"}, {"role": "developer", "content": "d"},
             {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "b"}, {"role": "system", "content": "t"}]  # fmt: skip
    assert fold_late_system(turns) == [
        LATE[0], {"role": "assistant", "content": "a"}, {"role": "user", "content": "d\n\ns\n\nu"},
        {"role": "assistant", "content": "b"}, {"role": "user", "content": "t"},
    ]  # fmt: skip


async def test_a_system_message_in_the_conversation_is_served_by_any_template(client_for):
    """Claude Code sends a system message after the first user message (Messages API), and
    chat clients send them anywhere: kept in place where the template takes them, folded into
    the user turn beside them where it does not (Gemma's, Mistral's templates)."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    anthropic = {**body, "system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "say hi"}]},
        {"role": "system", "content": "Agent types: Explore, Plan."},
    ]}  # fmt: skip
    prompts = []
    for template in (None, STRICT_TEMPLATE):
        client = await client_for(chat_template=template)
        chat = await client.post("/v1/chat/completions", json={**body, "messages": LATE})
        assert chat.status_code == 200, chat.text
        msg = await client.post("/v1/messages", json=anthropic)
        assert msg.status_code == 200, msg.text
        counted = await client.post("/v1/messages/count_tokens", json={
            k: anthropic[k] for k in ("model", "system", "messages")})  # fmt: skip
        # the same prompt by both APIs, and counted as served
        usage = msg.json()["usage"]  # Anthropic's: input_tokens are those not read from cache
        served = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert served == chat.json()["usage"]["prompt_tokens"]
        assert counted.json()["input_tokens"] == served
        prompts.append(chat.json()["usage"]["prompt_tokens"])
        await wait_idle(client.engine)  # type: ignore[attr-defined]
    # folded, the late system message has no role markers of its own: a shorter prompt
    assert prompts[1] < prompts[0]
