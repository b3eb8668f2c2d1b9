"""Tool calling: tools into the chat template, and grammars (llguidance) for ``tool_choice``
"required" or a named function, for a call or the response format's JSON, and for ``strict``
functions' arguments under "auto". Tool calls out of the text: ``tool_calls``."""

from __future__ import annotations

import json
from typing import Any

from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.reasoning import effort_variables
from veloxquant_mlx.server.schemas import ChatCompletionRequest, NamedToolChoice, Tool
from veloxquant_mlx.server.structured import COMPACT, check_schema, closed


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it: text content, an assistant's tool calls
    with their arguments as objects (templates render them with ``tojson``), tool results with
    the id of the call they answer."""
    out: list[dict[str, Any]] = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    raise APIError(
                        400,
                        "tool call arguments must be a JSON text",
                        code="invalid_value",
                        param="messages",
                    ) from None
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            message["tool_calls"] = calls
        out.append(message)
    return out


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with each system (or developer) message after the first message
    folded into a user message, for templates that allow a system message only first (Gemma's,
    Mistral's): appended to the user message right before it, else put before the one right
    after it, else a user message of its own. None when there is none to fold."""
    late = {i for i, m in enumerate(messages) if i and m["role"] in ("system", "developer")}
    if not late:
        return None
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # folded text waiting for the next user message
    for i, m in enumerate(messages):
        text = m.get("content") or ""
        if i in late:
            if out and out[-1]["role"] == "user" and not pending:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
            else:
                pending.append(text)
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": "\n\n".join([*pending, m.get("content") or ""])}
            pending = []
        elif pending:
            out.append({"role": "user", "content": "\n\n".join(pending)})
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def template_variables(body: ChatCompletionRequest) -> dict[str, Any]:
    """The variables the chat template gets besides the conversation and tools: the reasoning
    effort's (``effort_variables``), then the request's ``chat_template_kwargs``, which win."""
    return {**effort_variables(body.reasoning_effort), **(body.chat_template_kwargs or {})}


def render_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
    tokenize: bool = False,
) -> Any:
    """The model's chat template over ``conversation`` with the generation prompt: its text
    (or tokens); late system messages folded (``fold_late_system``) for a template that
    rejects them. Raises what the template raises."""
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=True, tokenize=tokenize,
            **variables,
        )  # fmt: skip
    except Exception:
        folded = fold_late_system(conversation)
        if folded is None:
            raise
        return tokenizer.apply_chat_template(
            folded, tools=tools, add_generation_prompt=True, tokenize=tokenize, **variables
        )


def template_tools(body: ChatCompletionRequest, tokenizer: Any) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt (None: no tools, or ``tool_choice`` "none").

    Raises:
        APIError: 400 when tools are asked for and the model's template has no tool calling.
    """
    if not body.tools or body.tool_choice == "none":
        return None
    if not getattr(tokenizer, "has_tool_calling", False):
        raise APIError(
            400,
            "this model does not support tool calling (its chat template has no tool-call "
            "format that mlx_lm can parse); send the request without tools",
            code="unsupported_value",
            param="tools",
        )
    return [t.model_dump(exclude_none=True) for t in body.tools]


def tool_grammar(body: ChatCompletionRequest, tokenizer: Any) -> str | None:
    """A grammar that makes the model call one tool, for ``tool_choice`` "required" or a named
    function; None otherwise (parallel calls come only from "auto"). Supported for the
    JSON-in-tags format (Hermes, Qwen 2.5/3 and most others that mlx_lm parses with
    ``json_tools``): ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>``, the arguments following the function's ``parameters`` schema.

    Plain CPU over the tools' schemas: call it off the event loop.

    Raises:
        APIError: 400 for a tool-call format this cannot constrain, or a schema over the
            limits (``structured.check_schema``).
    """
    choice = body.tool_choice
    if not body.tools or not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    if not _json_calls(tokenizer):
        raise APIError(
            400,
            "tool_choice 'required' or a named function is supported for models whose tool "
            "calls are JSON in <tool_call> tags; use tool_choice 'auto' with this model",
            code="unsupported_value",
            param="tool_choice",
        )
    tools: list[Tool] = body.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    # Exactly one call, then end of sequence: a grammar that allowed more would leave the
    # choice to stop to the model, and a weak one runs on into a cut-off second call.
    return f"start: call\n{_call_rule(body, tools, tokenizer)}"


def tool_or_answer_grammar(body: ChatCompletionRequest, tokenizer: Any) -> str | None:
    """With tools under ``tool_choice`` "auto" (or unset) and a JSON ``response_format``: a
    grammar that allows one tool call or an answer in the response's JSON (OpenAI's choice for
    the model: call a tool, or answer in the schema). None when that does not apply, or for a
    tool-call format other than JSON in tags (then the response format alone holds).

    Plain CPU over the schemas: call it off the event loop.
    """
    fmt = body.response_format
    if not body.tools or body.tool_choice not in (None, "auto") or fmt is None:
        return None
    if fmt.type == "text" or not _json_calls(tokenizer):
        return None
    if fmt.type == "json_object":
        schema: Any = {"type": "object"}
    else:
        assert fmt.json_schema is not None
        schema = fmt.json_schema.schema_
        check_schema(schema, "response_format.json_schema.schema")
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "a JSON schema must be an object",
                code="invalid_value",
                param="response_format.json_schema.schema",
            )
    answer = {**closed(schema), "x-guidance": COMPACT}
    return (
        f"start: call | answer\n{_call_rule(body, body.tools, tokenizer)}"
        f"answer: %json {json.dumps(answer)}\n"
    )


def strict_calls_grammar(body: ChatCompletionRequest, tokenizer: Any) -> str | None:
    """Under ``tool_choice`` "auto" (or unset), with no JSON ``response_format``, where some
    function is ``strict``: a grammar that leaves the answer free (any text without the
    tool-call tag) and holds every call the model starts to a tool's name and, for a
    ``strict`` function, to its ``parameters`` (OpenAI's strict function calling: the
    arguments follow the schema); a call is the answer's end, one or (``parallel_tool_calls``)
    several. None otherwise, and for tool-call formats other than JSON in tags (calls then
    come as written). The free text keeps any think block (the route splits the reasoning
    from it as from an unconstrained answer).

    Plain CPU over the tools' schemas: call it off the event loop.

    Raises:
        APIError: 400 for a schema over the limits (``structured.check_schema``).
    """
    fmt = body.response_format
    if not body.tools or body.tool_choice not in (None, "auto"):
        return None
    if (fmt is not None and fmt.type != "text") or not _json_calls(tokenizer):
        return None
    if not any(t.function.strict for t in body.tools):
        return None
    tag = _regex_literal(tokenizer.tool_call_start)
    calls = "(WS? START WS? args WS? END)*" if body.parallel_tool_calls is not False else ""
    return (
        f"start: TEXT | CALLED WS? args WS? END {calls}\n"
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/\n"  # any text without the tag
        f"CALLED: /(.|\\n)*{tag}/ & ~/(.|\\n)*{tag}(.|\\n)+/\n"  # text up to its first tag
        f"START: {json.dumps(tokenizer.tool_call_start)}\n"
        f"END: {json.dumps(tokenizer.tool_call_end)}\n"
        "WS: /[ \\t\\r\\n]+/\n" + _args_rule(body, body.tools, strict_only=True)
    )


def _regex_literal(text: str) -> str:
    """``text`` as a literal inside a lark ``/.../`` regex."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def _json_calls(tokenizer: Any) -> bool:
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "") == "mlx_lm.tool_parsers.json_tools"


def _call_rule(body: ChatCompletionRequest, tools: list[Tool], tokenizer: Any) -> str:
    """The grammar rules ``call`` (one call of one of ``tools``, in its tags) and ``args``."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    return f"call: {json.dumps(start)} args {json.dumps(end)}\n" + _args_rule(body, tools)


def _args_rule(body: ChatCompletionRequest, tools: list[Tool], strict_only: bool = False) -> str:
    """The grammar rule ``args``: the JSON of one call of one of ``tools`` (its name and its
    function's ``parameters``; with ``strict_only``, any object for a function not ``strict``)."""
    chosen = {id(t) for t in tools if t.function.strict or not strict_only}
    for i, t in enumerate(body.tools or []):
        if id(t) in chosen and t.function.parameters is not None:
            check_schema(t.function.parameters, f"tools.{i}.function.parameters")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": closed(t.function.parameters or {"type": "object"})
                if id(t) in chosen
                else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": COMPACT}
    return f"args: %json {json.dumps(schema)}\n"
