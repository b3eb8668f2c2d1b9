"""A Responses request's tools as the chat path's functions, and the model's calls back as
Responses items (``ToolSet``).

- A ``function`` tool is a function.
- A ``custom`` tool (free-text input, such as Codex's ``apply_patch``) is a function of one
  string, ``input``, with the tool's grammar (``format``) in its description: shown to the
  model, not enforced. Its calls are ``custom_tool_call`` items holding that text.
- A ``namespace`` tool's functions and custom tools (Codex's ``multi_agent_v1``) are functions
  under their own names (``namespace__name`` where a name is taken twice); their calls are
  items naming the namespace.
- Tools that run on the provider's side (``web_search``, ``file_search``, ``code_interpreter``,
  ``local_shell``, ...) have nothing here to run them: they are left out, and the route logs
  their types. Codex sends ``web_search`` with every request.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from veloxquant_mlx.server.errors import APIError

# A custom tool's one parameter, as the model sees it
CUSTOM_INPUT = "input"


def bad_input(message: str, param: str) -> APIError:
    """A 400 ``invalid_value`` naming the Responses request's ``param``."""
    return APIError(400, message, code="invalid_value", param=param)


@dataclass(frozen=True, slots=True)
class ApiTool:
    """What a model-visible function is in the request: its name there, its namespace, and
    whether it is a custom tool."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass(slots=True)
class ToolSet:
    """A request's tools: the chat functions the model is shown, each function's tool in the
    request by the name the model calls it, and the types of the tools left out."""

    functions: list[dict[str, Any]] | None = None
    by_model: dict[str, ApiTool] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None) -> ToolSet:
        """The ``tools`` of a Responses request.

        Raises:
            APIError: 400 for a tool without a name, or a namespace without tools.
        """
        if tools is None:
            return cls()
        entries: list[tuple[ApiTool, dict[str, Any]]] = []  # (tool, its function), in order
        left_out = []
        for i, tool in enumerate(tools):
            kind, where = tool.get("type"), f"tools.{i}"
            if kind in ("function", "custom"):
                entries.append(_entry(tool, None, where))
            elif kind == "namespace":
                space = _name(tool, where)
                inner = tool.get("tools")
                if not isinstance(inner, list) or not inner:
                    raise bad_input("a namespace tool needs a list of tools", f"{where}.tools")
                for j, sub in enumerate(inner):
                    if sub.get("type") not in ("function", "custom"):
                        raise bad_input("a namespace holds function and custom tools",
                                   f"{where}.tools.{j}")  # fmt: skip
                    entries.append(_entry(sub, space, f"{where}.tools.{j}"))
            else:
                left_out.append(str(kind))
        counts = Counter(api.name for api, _ in entries)
        functions, by_model = [], {}
        for api, fn in entries:
            name = api.name
            if api.namespace is not None and counts[name] > 1:
                name = f"{api.namespace}__{name}"
            by_model[name] = api
            functions.append({"type": "function", "function": {**fn, "name": name}})
        return cls(functions, by_model, left_out)

    def model_name(self, name: Any, namespace: Any = None) -> Any:
        """The name the model knows the tool ``name`` (in ``namespace``) by; ``name`` itself
        for one not in the request (a call the template shows as written)."""
        for model, api in self.by_model.items():
            if api.name == name and api.namespace == namespace:
                return model
        return name

    def chat_call(self, item: dict[str, Any]) -> dict[str, Any]:
        """A ``function_call`` or ``custom_tool_call`` item (resent, or of a stored response)
        as the chat tool call the model made."""
        if item.get("type") == "custom_tool_call":
            arguments = json.dumps({CUSTOM_INPUT: item.get("input", "")})
        else:
            arguments = item.get("arguments", "{}")
        name = self.model_name(item.get("name"), item.get("namespace"))
        return {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def item(self, call: dict[str, Any], status: str) -> dict[str, Any]:
        """The model's chat tool call as the Responses output item for its tool."""
        name = call["function"]["name"]
        api = self.by_model.get(name, ApiTool(name))
        item: dict[str, Any] = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                                "call_id": call["id"], "name": api.name}  # fmt: skip
        if api.custom:
            item.update(type="custom_tool_call", id=f"ctc_{uuid.uuid4().hex[:24]}",
                        input=_custom_input(call))  # fmt: skip
        else:
            item["arguments"] = call["function"]["arguments"]
        if api.namespace is not None:
            item["namespace"] = api.namespace
        item["status"] = status
        return item


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_input(f"a {tool.get('type')} tool needs a name", where)
    return name


def _entry(
    tool: dict[str, Any], namespace: str | None, where: str
) -> tuple[ApiTool, dict[str, Any]]:
    name = _name(tool, where)
    if tool.get("type") == "function":
        fn: dict[str, Any] = {k: tool[k] for k in ("description", "parameters", "strict")
                              if k in tool}  # fmt: skip
        return ApiTool(name, namespace), fn
    description = tool.get("description") or ""
    fmt = tool.get("format") or {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax", "lark")
        description += f"\n\nThe input follows this {syntax} grammar:\n{fmt['definition']}"
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    custom: dict[str, Any] = {"description": description.strip(), "parameters": parameters}
    return ApiTool(name, namespace, custom=True), custom


def _custom_input(call: dict[str, Any]) -> str:
    """A custom tool call's text: its ``input`` argument (the arguments as written, when the
    model wrote something else)."""
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return str(arguments)
    if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str):
        return str(parsed[CUSTOM_INPUT])
    return str(arguments)
