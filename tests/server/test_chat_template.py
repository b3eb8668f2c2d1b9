"""--chat-template (a file or the template's text) in place of the model's, and a request's
chat_template_kwargs."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TOOL_TEMPLATE, WEATHER
from tests.server.conftest import MODEL, wait_idle
from veloxquant_mlx.config import Settings

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
        "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
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
    bad = await client.post(
        "/v1/chat/completions", json={**ASK, "chat_template_kwargs": {"tools": []}}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    await wait_idle(client.engine)  # type: ignore[attr-defined]


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused():
    with pytest.raises(ValueError, match="chat_template"):
        Settings(chat_template="no-such-file.jinja")
