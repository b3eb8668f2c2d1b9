"""The Anthropic Messages API's request, translated to the chat path (``to_chat``), and its
response pieces and error shape.

A Messages request becomes a ``ChatCompletionRequest``: ``system`` (a string or text blocks)
the system message; text blocks the messages' text; an assistant's ``tool_use`` blocks its
``tool_calls``; a user's ``tool_result`` blocks ``tool`` messages (before the user's text, in
order); ``tools`` (``input_schema``) functions; ``tool_choice`` auto / any / tool / none the
chat's "auto" / "required" / a named function / "none". So the same template, grammars (a
forced call for ``any`` and ``tool``), batching and prefix cache serve it. ``thinking`` of
type ``enabled`` or ``disabled`` turns the chat template's reasoning switch on or off (the
variables ``enable_thinking``, Qwen3's and GLM's, and ``thinking``, DeepSeek's); absent, the
template's default holds. ``cache_control`` and ``metadata`` are accepted and have no effect
(the prefix cache is automatic).
A plain-text ``document`` block is its text; images, PDFs and other media are refused with a
400 that names the block (the models served here read text), except an image inside a
``tool_result``: a tool (Claude Code's file reader, a screenshot) made it, the client resends it
every turn, so a 400 would end the conversation; it is read as the line ``OMITTED_IMAGE``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from veloxquant_mlx.server.schemas import ChatCompletionRequest, KVFormat

# Anthropic's error types by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def context_message(n_prompt: int, max_tokens: int, window: int) -> str:
    """A request over the context window in Anthropic's words, which clients parse (Claude
    Code compacts the conversation on "prompt is too long", and lowers ``max_tokens`` from the
    numbers of the other)."""
    if n_prompt >= window:
        return f"prompt is too long: {n_prompt} tokens > {window} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {n_prompt} + {max_tokens} > "
        f"{window}, decrease input length or `max_tokens` and try again"
    )


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: no effect here


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class DocumentBlock(_Block):
    """A document given as plain text (``source.type`` "text"): read as its text."""

    type: Literal["document"]
    source: dict[str, Any]

    @model_validator(mode="after")
    def _plain_text(self) -> DocumentBlock:
        if self.source.get("type") != "text" or not isinstance(self.source.get("data"), str):
            kind = self.source.get("media_type") or self.source.get("type")
            raise ValueError(
                f"a document of source {kind!r} is not supported: this server reads text "
                "(send the document as a text block, or a document with source type 'text')"
            )
        return self

    @property
    def text(self) -> str:
        return str(self.source["data"])


class MediaBlock(_Block):
    """An image (or another medium) the models served here cannot read: refused by name."""

    type: Literal["image", "search_result", "container_upload"]

    @model_validator(mode="after")
    def _refused(self) -> MediaBlock:
        raise ValueError(
            f"'{self.type}' content blocks are not supported: this server serves text-only "
            "models (send text blocks)"
        )


# What the model reads for an image a tool returned.
OMITTED_IMAGE = "[an image was returned here; this model reads text only and cannot see it]"


class ToolImageBlock(_Block):
    """An image in a tool's result: read as ``OMITTED_IMAGE``."""

    type: Literal["image"]

    @property
    def text(self) -> str:
        return OMITTED_IMAGE


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: (
        StrictStr
        | list[Annotated[TextBlock | DocumentBlock | ToolImageBlock, Field(discriminator="type")]]
    ) = ""
    is_error: StrictBool | None = None


class ThinkingBlock(_Block):
    """An earlier turn's reasoning, sent back as Claude Code does: not part of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | DocumentBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # "system": an instruction at its place in the conversation (Claude Code sends one after
    # the first user message)
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[Block]


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, type "custom"
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_.-]{1,128}$")]
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: StrictBool | None = None  # the input follows input_schema (chat's strict)


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")  # disable_parallel_tool_use: one call a turn
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None


class JSONOutputFormat(BaseModel):
    """Anthropic's structured outputs: the answer's text is JSON that follows ``schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: JSONOutputFormat | None = None
    # low, medium, high: the template's (OpenAI's reasoning_effort); another (max, a newer
    # level) leaves the template's default
    effort: StrictStr | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr  # "enabled", "disabled"; another (a newer mode) leaves the template's default
    # checked as Anthropic's API does (below max_tokens); the template has no such knob, so the
    # thinking is bounded by max_tokens alone
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # metadata, service_tier, container, ...
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_sequences: Annotated[list[StrictStr], Field(max_length=16)] | None = None
    stream: StrictBool = False
    kv_format: KVFormat | None = None  # this server's extension (--kv-formats)
    seed: StrictInt | None = None  # this server's extension, as chat's (checked there)
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the structured-outputs beta's name for it
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        t = self.thinking
        budget = t.budget_tokens if t is not None and t.type == "enabled" else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError("`max_tokens` must be greater than `thinking.budget_tokens`")
        return self


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    readable = (TextBlock, DocumentBlock, ToolImageBlock)
    return "".join(b.text for b in content if isinstance(b, readable))


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (OpenAI's shape)."""
    out: list[dict[str, Any]] = []
    system = _text(req.system) if req.system is not None else ""
    if system:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        blocks: list[Any] = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        if m.role == "system":
            out.append({"role": "system", "content": _text(blocks)})
            continue
        if m.role == "assistant":
            calls = [
                {"id": b.id, "type": "function",
                 "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in blocks if isinstance(b, ToolUseBlock)
            ]  # fmt: skip
            message: dict[str, Any] = {"role": "assistant", "content": _text(blocks) or None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            continue
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})  # fmt: skip
        text = _text(blocks)
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def to_chat(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves ``req`` (ValidationError as the chat path's)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema, "strict": t.strict}}
            for t in req.tools
        ]  # fmt: skip
    choice = req.tool_choice
    if choice is not None and (req.tools or choice.type == "none"):
        if choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name or ""}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body["temperature"] = 1.0 if req.temperature is None else req.temperature
        for name in ("top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        for name in ("kv_format", "seed"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
            on = req.thinking.type == "enabled"  # the template's switch, by its common names
            body["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
        effort = req.output_config.effort if req.output_config is not None else None
        if effort in ("low", "medium", "high"):
            body["reasoning_effort"] = effort
        fmt = (req.output_config and req.output_config.format) or req.output_format
        if fmt is not None:  # enforced by the chat path's grammar, beside any tools
            schema = {"name": "output", "schema": fmt.schema_, "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        body["stream"] = req.stream
    return ChatCompletionRequest.model_validate(body)


def stop_reason(finish_reason: str, stop_string: str | None, n_calls: int) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if n_calls:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def content_blocks(text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's content: its text (if any), then a ``tool_use`` block per call."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    blocks += [tool_use(c) for c in calls]
    return blocks


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block (arguments that are not a JSON object, a call
    cut by max_tokens, come back under ``input`` as ``{}``)."""
    try:
        value = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        value = {}
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": value if isinstance(value, dict) else {},
    }
