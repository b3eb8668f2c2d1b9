"""The OpenAI Agents SDK's default pattern, function tools together with a structured
``output_type`` over chat completions, against the embedded model (its own template takes
tools): the run ends with a parsed output, and tool calls in between run the tool."""

from __future__ import annotations

from typing import Literal

from tests.compat.test_clients import Pet
from tests.e2e.conftest import MODEL


def test_agents_sdk_with_tools_and_an_output_type(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: Literal["Paris", "Oslo"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    agent = Agent(
        name="pets",
        instructions="Answer with a pet.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        tools=[weather],
        output_type=Pet,
        model_settings=ModelSettings(max_tokens=120, temperature=1.0, extra_body={"seed": 2}),
    )
    result = Runner.run_sync(agent, "which pet suits Paris weather?", max_turns=8)
    assert isinstance(result.final_output, Pet)
    assert all(c in ("Paris", "Oslo") for c in calls)
