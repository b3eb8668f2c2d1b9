"""A Responses request's tools as chat functions and the model's calls back as items
(``responses_tools.ToolSet``): function, custom and namespace tools, names taken twice, tools
left out, resent calls."""

from __future__ import annotations

import json

import pytest

from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.responses_tools import ToolSet

OBJ = {"type": "object", "properties": {"x": {"type": "string"}}}
TOOLS = [
    {"type": "function", "name": "close_agent", "parameters": OBJ, "strict": False},
    {"type": "custom", "name": "apply_patch", "description": "Edit files",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "x"'}},
    {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [
        {"type": "function", "name": "close_agent", "parameters": OBJ},
        {"type": "function", "name": "spawn", "parameters": OBJ},
        {"type": "custom", "name": "note"},
    ]},
    {"type": "web_search", "external_web_access": False},
    {"type": "local_shell"},
]  # fmt: skip


def call(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_model_sees_functions_and_each_call_comes_back_as_its_tools_item():
    tools = ToolSet.of(TOOLS)
    names = [f["function"]["name"] for f in tools.functions or ()]
    # a name taken twice keeps its top-level owner's and qualifies the namespaced one
    assert names == ["close_agent", "apply_patch", "agents__close_agent", "spawn", "note"]
    assert tools.left_out == ["web_search", "local_shell"]
    patch = tools.functions[1]["function"]  # type: ignore[index]
    assert patch["parameters"]["required"] == ["input"]
    assert 'start: "x"' in patch["description"] and patch["description"].startswith("Edit")
    item = tools.item(call("apply_patch", json.dumps({"input": "*** Begin"})), "completed")
    assert item["type"] == "custom_tool_call" and item["input"] == "*** Begin"
    assert item["id"].startswith("ctc_") and "namespace" not in item
    item = tools.item(call("agents__close_agent", "{}"), "completed")
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "close_agent",
                                                                "agents")  # fmt: skip
    item = tools.item(call("spawn", '{"x": "a"}'), "in_progress")
    assert item["namespace"] == "agents" and item["arguments"] == '{"x": "a"}'
    # a custom call whose arguments are not {"input": text} keeps what the model wrote
    assert tools.item(call("note", "free text"), "completed")["input"] == "free text"
    assert tools.item(call("close_agent", "{}"), "completed").get("namespace") is None


def test_resent_calls_name_the_function_the_model_called():
    tools = ToolSet.of(TOOLS)
    resent = {"type": "function_call", "call_id": "c", "name": "close_agent",
              "namespace": "agents", "arguments": "{}"}  # fmt: skip
    assert tools.chat_call(resent)["function"]["name"] == "agents__close_agent"
    custom = {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "p"}
    fn = tools.chat_call(custom)["function"]
    assert fn["name"] == "apply_patch" and json.loads(fn["arguments"]) == {"input": "p"}
    # a call to a tool the request no longer has is shown as written
    gone = {"type": "function_call", "call_id": "c", "name": "old", "arguments": "{}"}
    assert tools.chat_call(gone)["function"]["name"] == "old"
    assert tools.model_name("spawn", "agents") == "spawn"


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "function"}], "tools.0"),
        ([{"type": "custom", "name": ""}], "tools.0"),
        ([{"type": "namespace", "name": "a", "tools": []}], "tools.0.tools"),
        ([{"type": "namespace", "name": "a", "tools": [{"type": "web_search"}]}],
         "tools.0.tools.0"),
    ],
)  # fmt: skip
def test_a_tool_the_model_cannot_be_shown_is_a_400_naming_it(tools, param):
    with pytest.raises(APIError) as info:
        ToolSet.of(tools)
    assert info.value.status == 400 and info.value.param == param
