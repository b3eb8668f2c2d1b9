"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from veloxquant_mlx import __version__
from veloxquant_mlx.engine.handle import RequestHandle
from veloxquant_mlx.engine.types import (
    EngineError,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from veloxquant_mlx.server.deps import AppState, state
from veloxquant_mlx.server.errors import APIError, from_engine
from veloxquant_mlx.server.generation import (
    collect,
    first_batch,
    new_id,
    stream_events,
    usage_json,
)
from veloxquant_mlx.server.schemas import ChatCompletionRequest, CompletionRequest
from veloxquant_mlx.server.structured import grammar_for

router = APIRouter(prefix="/v1")  # the API key is checked before the body (middleware)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _model_card(st: AppState) -> dict[str, Any]:
    return {
        "id": st.model_name,
        "object": "model",
        "created": st.started,
        "owned_by": "veloxquant",
        "max_model_len": st.engine.context_window,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state(request))]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    _check_model(st, model_id)
    return _model_card(st)


def fingerprint(st: AppState) -> str:
    """Changes when the weights or the code that runs them change (OpenAI's meaning)."""
    return f"fp_vq{__version__.replace('.', '')}_{st.model_name[:24]}"


def _check_model(st: AppState, model: str | None) -> None:
    """A request may omit ``model`` (the served one is meant), as vLLM and llama.cpp allow."""
    if model is not None and model != st.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{st.model_name}'",
            code="model_not_found",
            param="model",
        )


def _sampling(body: CompletionRequest | ChatCompletionRequest, vocab: int) -> SamplingParams:
    """The engine's sampling values; what the model's vocabulary bounds is checked here."""
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():  # keys: decimal ASCII (schemas)
        if int(key) >= vocab:
            raise APIError(
                400,
                f"logit_bias keys must be token ids below {vocab}",
                code="invalid_value",
                param="logit_bias",
            )
        bias.append((int(key), value))
    if body.top_k is not None and body.top_k >= vocab:
        raise APIError(
            400,
            f"top_k must be below the vocabulary size {vocab} (0 or -1: off)",
            code="invalid_value",
            param="top_k",
        )
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=tuple(bias),
        seed=body.seed,
    )


def _submit(
    st: AppState,
    prompt: list[int],
    max_tokens: int | None,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    logprobs: bool,
    top_logprobs: int,
    grammar: str | None = None,
) -> RequestHandle:
    """Validate what needs the tokenizer and engine, then submit: nothing is sent before this."""
    if st.draining:
        raise APIError(
            503, "the server is shutting down", code="draining", headers={"Retry-After": "1"}
        )
    if not prompt:
        raise APIError(400, "the prompt must not be empty", code="invalid_value", param="prompt")
    vocab = st.engine.vocab_size
    if any(t >= vocab for t in prompt):
        raise APIError(
            400, f"token ids must be below {vocab}", code="invalid_value", param="prompt"
        )
    window = st.engine.context_window
    if max_tokens is None:
        max_tokens = st.settings.default_max_tokens
        if window is not None:
            max_tokens = min(max_tokens, window - len(prompt))
        if max_tokens < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens. However, your "
                f"prompt is {len(prompt)} tokens, which leaves no room for the completion. "
                "Please reduce the length of the prompt or messages.",
                code="context_length_exceeded",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
    request = GenerationRequest(
        tuple(prompt),
        max_tokens,
        _sampling(body, vocab),
        stop=tuple(body.stop or ()),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        grammar=grammar,
    )
    try:
        return st.engine.submit(request)
    except EngineError as exc:
        raise from_engine(exc) from None


async def _sse_response(
    request: Request,
    st: AppState,
    body: CompletionRequest | ChatCompletionRequest,
    handle: RequestHandle,
    arrived: float,
    base: dict[str, Any],
    chunk: Callable[[TokenEvent | FinishEvent], dict[str, Any]],
) -> StreamingResponse:
    """The SSE response: ``chunk`` per event, a usage chunk if asked, ``[DONE]``. Nothing is
    sent before the first event, so an error before it gets its HTTP status."""

    def usage_chunk(finish: FinishEvent) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage_json(finish)}

    include = bool(body.stream_options and body.stream_options.include_usage)
    first = await first_batch(request, st.engine, handle)
    return StreamingResponse(
        stream_events(st.engine, handle, st.metrics, arrived, chunk, include, usage_chunk, first),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )


def _token_text(st: AppState, token: int) -> str:
    return st.engine.tokenizer.decode([token])


# ---------------------------------------------------------------------- completions


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    _check_model(st, body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    tokens: list[int] = (
        (st.engine.tokenizer.encode(prompt) if prompt else [])
        if isinstance(prompt, str)
        else [int(t) for t in prompt]  # type: ignore[arg-type]
    )
    k = body.logprobs
    handle = _submit(st, tokens, body.max_tokens, body, logprobs=k is not None, top_logprobs=k or 0)
    rid, created = new_id("cmpl"), int(time.time())
    base = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": st.model_name,
        "system_fingerprint": fingerprint(st),
    }

    def logprobs_json(events: list[TokenEvent]) -> dict[str, Any] | None:
        if k is None:
            return None
        offsets, pos, texts = [], 0, []
        for e in events:
            offsets.append(pos)
            pos += len(e.text)
            texts.append(_token_text(st, e.token_id))
        return {
            "tokens": texts,
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [
                {_token_text(st, t): lp for t, lp in e.top_logprobs} if k else None for e in events
            ],
            "text_offset": offsets,
        }

    if body.stream:

        def chunk(event: TokenEvent | FinishEvent) -> dict[str, Any]:
            if isinstance(event, TokenEvent):
                choice = {
                    "index": 0,
                    "text": event.text,
                    "logprobs": logprobs_json([event]),
                    "finish_reason": None,
                }
            else:
                choice = {
                    "index": 0,
                    "text": event.text,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            return {**base, "choices": [choice]}

        return await _sse_response(request, st, body, handle, arrived, base, chunk)
    outcome = await collect(request, st.engine, handle, st.metrics, arrived)
    assert outcome.finish is not None
    choice = {
        "index": 0,
        "text": outcome.text,
        "logprobs": logprobs_json(outcome.tokens),
        "finish_reason": outcome.finish.finish_reason,
    }
    return {**base, "choices": [choice], "usage": usage_json(outcome.finish)}


# ---------------------------------------------------------------------- chat


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    _check_model(st, body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        tokens = list(st.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except Exception as exc:  # a template that rejects the conversation (roles, order)
        raise APIError(400, f"cannot format these messages: {exc}", param="messages") from None
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    grammar = await grammar_for(body.response_format, st.engine)
    handle = _submit(
        st,
        tokens,
        max_tokens,
        body,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        grammar=grammar,
    )
    rid, created = new_id("chatcmpl"), int(time.time())

    def entry(token: int, lp: float | None) -> dict[str, Any]:
        text = _token_text(st, token)
        table = st.engine.token_bytes  # a token's own bytes, also for part of a character
        raw = table[token] if table is not None and token < len(table) else text.encode()
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    def logprobs_json(events: list[TokenEvent]) -> dict[str, Any] | None:
        if not body.logprobs:
            return None
        return {
            "content": [
                {
                    **entry(e.token_id, e.logprob),
                    "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs],
                }
                for e in events
            ]
        }

    if body.stream:
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": st.model_name,
            "system_fingerprint": fingerprint(st),
        }
        first = {"sent": False}

        def chunk(event: TokenEvent | FinishEvent) -> dict[str, Any]:
            delta: dict[str, Any] = {}
            if not first["sent"]:
                delta["role"] = "assistant"
                first["sent"] = True
            if isinstance(event, TokenEvent):
                delta["content"] = event.text
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": logprobs_json([event]),
                    "finish_reason": None,
                }
            else:
                if event.text:
                    delta["content"] = event.text
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            return {**base, "choices": [choice]}

        return await _sse_response(request, st, body, handle, arrived, base, chunk)
    outcome = await collect(request, st.engine, handle, st.metrics, arrived)
    assert outcome.finish is not None
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": st.model_name,
        "system_fingerprint": fingerprint(st),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": outcome.text},
                "logprobs": logprobs_json(outcome.tokens),
                "finish_reason": outcome.finish.finish_reason,
            }
        ],
        "usage": usage_json(outcome.finish),
    }
