"""LangChain, LiteLLM, instructor and pydantic-ai, unchanged, against our server: plain chat,
streaming, tools, structured output, errors. The random-weight model cannot choose a tool or
write JSON by itself: constrained decoding makes the forced paths valid every time."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL


class Pet(BaseModel):
    """A pet."""

    kind: Literal["cat", "dog", "fish"]
    legs: Literal[0, 2, 4] = Field(description="number of legs")


def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


# ---------------------------------------------------------------------- LangChain


def _chat(srv, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, **kw)


def test_langchain_invoke_and_stream(server):
    llm = _chat(server, max_tokens=8, temperature=0)
    msg = llm.invoke("hello")
    assert isinstance(msg.content, str) and msg.content
    assert msg.usage_metadata["output_tokens"] == 8
    pieces = [c.content for c in llm.stream("hello")]
    assert "".join(pieces) == msg.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, tool_server, method):
    srv = tool_server if method == "function_calling" else server
    llm = _chat(srv, max_tokens=80, temperature=1.0)
    structured = llm.with_structured_output(Pet, method=method)
    for _ in range(3):
        assert isinstance(structured.invoke("a pet please"), Pet)


def test_langchain_bind_tools_forced(tool_server):
    llm = _chat(tool_server, max_tokens=80, temperature=1.0)
    msg = llm.bind_tools([get_weather], tool_choice="any").invoke("weather?")
    assert [c["name"] for c in msg.tool_calls][:1] == ["get_weather"]
    assert msg.tool_calls[0]["args"]["city"] in {"Paris", "Oslo"}


# ---------------------------------------------------------------------- LiteLLM


def test_litellm_completion_stream_and_context_errors(server):
    import litellm

    kw = {"model": f"openai/{MODEL}", "api_base": f"{server.base_url}/v1", "api_key": "x"}
    r = litellm.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=5, **kw)
    assert r.choices[0].message.content and r.usage.completion_tokens == 5
    chunks = litellm.completion(
        messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True, **kw
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            messages=[{"role": "user", "content": "hi"}], max_tokens=100_000, num_retries=0, **kw
        )


# ---------------------------------------------------------------------- instructor


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])  # JSON: any object (not bounded)
def test_instructor_modes(server, tool_server, mode):
    import instructor

    srv = tool_server if mode == "TOOLS" else server
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0),
        mode=getattr(instructor.Mode, mode),
    )
    pet = client.chat.completions.create(
        model=MODEL, response_model=Pet, max_retries=0, max_tokens=80, temperature=1.0,
        messages=[{"role": "user", "content": "a pet"}],
    )  # fmt: skip
    assert isinstance(pet, Pet)


# ---------------------------------------------------------------------- pydantic-ai


def _agent(srv, output_type):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        MODEL, provider=OpenAIProvider(base_url=f"{srv.base_url}/v1", api_key="x")
    )
    return Agent(model, output_type=output_type, model_settings={"max_tokens": 80})


def test_pydantic_ai_text(server):
    result = _agent(server, str).run_sync("hello")
    assert isinstance(result.output, str)


def test_pydantic_ai_native_and_tool_output(server, tool_server):
    from pydantic_ai import NativeOutput

    native = _agent(server, NativeOutput(Pet)).run_sync("a pet")
    assert isinstance(native.output, Pet)
    tool = _agent(tool_server, Pet).run_sync("a pet")  # a forced output tool call
    assert isinstance(tool.output, Pet)
