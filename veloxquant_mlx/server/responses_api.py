"""The Responses API request, and its translation to a chat request (one path to the engine).

``previous_response_id`` continues a stored response's conversation (``response_store``): the
route passes its messages before the request's own. Text input only. ``reasoning`` items a
client resends (Codex does, every turn) are read and left out of the prompt, as chat
templates leave earlier turns' reasoning out. Tools: ``responses_tools``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from veloxquant_mlx.server.responses_tools import ToolSet, bad_input
from veloxquant_mlx.server.schemas import ChatCompletionRequest, Finite, KVFormat, Text

_TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: what is read; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    input: Text | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: Text | None = None
    reasoning: dict[str, Any] | None = None  # its effort: the template's (effort_variables)
    metadata: dict[str, Any] | None = None
    kv_format: KVFormat | None = None  # this server's extension (--kv-formats)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_input(f"{where}.content must be text or a list of text parts", f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_input(
                f"only text input is supported (got a '{kind}' part)", f"{where}.content"
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(req: ResponsesRequest, tools: ToolSet) -> list[dict[str, Any]]:
    """The request's input items as chat messages (its ``instructions`` not among them);
    ``tools``: the request's (``ToolSet.of(req.tools)``), which name the calls.

    Raises:
        APIError: 400 for an item this server does not read.
    """
    messages: list[dict[str, Any]] = []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_input(f"{where}.role must be user, assistant, system or developer", where)
            messages.append({"role": role, "content": _content_text(item.get("content"), where)})
        elif kind in ("function_call", "custom_tool_call"):
            call = tools.chat_call(item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _content_text(output, where),
                }
            )
        elif kind != "reasoning":
            raise bad_input(f"input items of type '{kind}' are not supported", where)
    return messages


def _tool_choice(req: ResponsesRequest, tools: ToolSet) -> Any:
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") not in ("function", "custom") or not isinstance(
            choice.get("name"), str
        ):
            raise bad_input("tool_choice must name a tool: {type: function, name}", "tool_choice")
        name = tools.model_name(choice["name"], choice.get("namespace"))
        return {"type": "function", "function": {"name": name}}
    return choice


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_input("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def output_messages(output: list[dict[str, Any]], tools: ToolSet) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next turn resends: its text and tool
    calls as one assistant message (reasoning is not resent, as chat templates drop it)."""
    text = "".join(
        part.get("text", "")
        for item in output
        if item.get("type") == "message"
        for part in item.get("content") or ()
    )
    calls = [tools.chat_call(item) for item in output
             if item.get("type") in ("function_call", "custom_tool_call")]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def to_chat(
    req: ResponsesRequest, tools: ToolSet, conversation: list[dict[str, Any]] | None = None
) -> ChatCompletionRequest:
    """The chat request that does what ``req`` asks; ``tools``: its tools
    (``ToolSet.of(req.tools)``); ``conversation``: its messages after its instructions
    (default: its input's, ``input_messages``; a continued conversation's come first).

    Raises:
        APIError: 400 for what the Responses API allows and this server does not do.
    """
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [
            *system,
            *(input_messages(req, tools) if conversation is None else conversation),
        ],
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools.functions,
        "tool_choice": _tool_choice(req, tools),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        "stream": req.stream,
        "kv_format": req.kv_format,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        from veloxquant_mlx.server.errors import describe_validation

        message, param = describe_validation(list(exc.errors()))
        message = message.replace("reasoning_effort", "reasoning.effort")
        param = "reasoning.effort" if param == "reasoning_effort" else param
        raise bad_input(message, param or "input") from None
