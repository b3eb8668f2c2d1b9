"""Request bodies of the OpenAI-compatible API: strict types, explicit bounds, unknown fields
ignored (clients send parameters we do not use)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from veloxquant_mlx.engine.types import SamplingParams


def _encodable(value: str) -> str:
    # JSON can carry a lone UTF-16 surrogate ("\ud800"); no tokenizer can encode it.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    return value


Finite = Annotated[float, Field(allow_inf_nan=False, strict=True)]
Text = Annotated[StrictStr, AfterValidator(_encodable)]
TokenId = Annotated[StrictInt, Field(ge=0)]
# logit_bias keys are token ids written in decimal ASCII ("²".isdigit() is True; int() refuses).
TokenIdKey = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,10}$")]
KVFormat = Annotated[StrictStr, Field(min_length=1, max_length=16)]  # the engine checks the name


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[Text, Field(min_length=1, max_length=256)] | None = None  # None: served one
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[Finite, Field(ge=0.0, le=SamplingParams.TEMPERATURE_MAX)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=100_000)] | None = None  # -1: off (vLLM)
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: (
        Annotated[Finite, Field(gt=0.0, le=SamplingParams.REPETITION_PENALTY_MAX)] | None
    ) = None
    presence_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: (
        Annotated[
            dict[TokenIdKey, Annotated[Finite, Field(ge=-100.0, le=100.0)]], Field(max_length=300)
        ]
        | None
    ) = None
    seed: (
        Annotated[StrictInt, Field(ge=SamplingParams.SEED_MIN, le=SamplingParams.SEED_MAX)] | None
    ) = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1  # at most --max-n (checked per server)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    # How this request's KV is stored (--kv-formats): auto, int8, int4, the model's float type.
    kv_format: KVFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v


class CompletionRequest(_Sampling):
    prompt: (
        Text
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1, max_length=128)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=128)
        ]
    )
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False  # the prompt comes back first (with its logprobs if asked)
    suffix: None = None
    # 0 only with echo: score the prompt, generate nothing (lm-eval-harness's loglikelihood)
    max_tokens: Annotated[StrictInt, Field(ge=0, le=1_000_000)] | None = None


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got type '{self.type}'")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text
    arguments: Text = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message's answer to one

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that follows a
    schema (always enforced, ``strict`` or not)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_.-]{1,128}$")]
    description: Text | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    class Name(BaseModel):
        name: StrictStr

    type: Literal["function"]
    function: Name


# What the server passes to the chat template itself: not a client's to override.
TEMPLATE_RESERVED = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
     "return_dict", "chat_template", "continue_final_message"}
)  # fmt: skip


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # Extra variables for the chat template (vLLM's and SGLang's name), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning switch, given to the template by the names models read
    # (``effort_variables``); chat_template_kwargs, where it sets the same names, wins.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # OpenAI's deprecated function calling: refused (a client relying on it would otherwise get
    # text where it expects a call), not ignored; "none" / empty asks for nothing and passes.
    functions: list[Any] | None = None
    function_call: Any = None
    # Output modalities: text is what this server makes. Audio output is refused, not answered
    # with text a client would take for a transcript.
    modalities: list[StrictStr] | None = None
    audio: Any = None

    @field_validator("modalities")
    @classmethod
    def _text_output_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError("only text output is supported: modalities may hold only 'text'")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio_output(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("audio output is not supported (the server outputs text only)")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none"):
            raise ValueError(
                f"{info.field_name} (OpenAI's deprecated function calling) is not supported: "
                "send tools and tool_choice"
            )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & TEMPLATE_RESERVED)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here (the server sets it)")
        return kwargs

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        # A field's validator (after ``tools``, declared before it): the 400 names the field.
        tools = info.data.get("tools") or []
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in tools}:
                raise ValueError(f"tool_choice names '{choice.function.name}', not in tools")
        elif choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return choice


class ShrinkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stream: Literal["k", "v", "kv"]
    target_free: Annotated[StrictInt, Field(ge=0)]
