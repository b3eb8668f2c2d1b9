"""Request bodies of the OpenAI-compatible API: strict types, explicit bounds, unknown fields
ignored (clients send parameters we do not use)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr = Field(min_length=1)
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=100_000)] | None = None  # -1: off (vLLM)
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: (
        Annotated[
            dict[StrictStr, Annotated[Finite, Field(ge=-100.0, le=100.0)]], Field(max_length=300)
        ]
        | None
    ) = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class CompletionRequest(_Sampling):
    prompt: (
        StrictStr
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)
        ]
    )
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False
    suffix: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class ShrinkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stream: Literal["k", "v", "kv"]
    target_free: Annotated[StrictInt, Field(ge=0)]
