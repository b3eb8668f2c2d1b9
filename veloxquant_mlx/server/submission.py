"""What the OpenAI routes share: model checks, sampling values, submitting to the engine, the
SSE response, fingerprints."""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from veloxquant_mlx import __version__
from veloxquant_mlx.engine.request.grammar import Grammar
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import (
    EngineError,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from veloxquant_mlx.server.access_log import note_handles
from veloxquant_mlx.server.deps import AppState
from veloxquant_mlx.server.errors import APIError, from_engine
from veloxquant_mlx.server.generation import (
    first_batch,
    stream_choices,
    usage_json_many,
)
from veloxquant_mlx.server.schemas import ChatCompletionRequest, CompletionRequest
from veloxquant_mlx.server.streaming import DeadlineStreamingResponse

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# max_tokens for a request that omits it, when the model states no context length.
NO_WINDOW_MAX_TOKENS = 4096


# Prompts longer than this (characters) are templated and tokenized on a worker thread: a
# 30,000-token conversation takes ~130 ms, which on the event loop every stream would wait.
OFF_LOOP_CHARS = 8_000


def model_cards(st: AppState) -> list[dict[str, Any]]:
    """The served model's card, then one per alias that is an id, not a pattern."""
    ids = [a for a in st.settings.model_alias_list() if not any(c in a for c in "*?[")]
    return [model_card(st, name) for name in dict.fromkeys([st.model_name, *ids])]


def model_card(st: AppState, name: str | None = None) -> dict[str, Any]:
    """One model in OpenAI's shape and Anthropic's (``type``, ``display_name``, ``created_at``):
    each SDK reads its own fields and ignores the others'."""
    model_id = name or st.model_name
    return {
        "id": model_id,
        "object": "model",
        "created": st.started,
        "owned_by": "veloxquant",
        "max_model_len": st.engine.context_window,
        "type": "model",
        "display_name": model_id,
        "created_at": datetime.fromtimestamp(st.started, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def fingerprint(st: AppState) -> str:
    """Changes when the weights or the code that runs them change (OpenAI's meaning)."""
    return f"fp_vq{__version__.replace('.', '')}_{st.model_name[:24]}"


def check_model(st: AppState, model: str | None) -> None:
    """A request may omit ``model`` (the served one is meant), as vLLM and llama.cpp allow;
    else it names the served model or one of ``--model-aliases`` (shell-style patterns)."""
    if model is None or model == st.model_name:
        return
    if any(fnmatch.fnmatchcase(model, alias) for alias in st.settings.model_alias_list()):
        return
    raise APIError(
        404,
        f"the model '{model}' does not exist; this server serves '{st.model_name}'",
        code="model_not_found",
        param="model",
    )


def sampling(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The engine's sampling values (what the vocabulary bounds, the engine checks at submit:
    ``request.checks``)."""
    bias = [(int(key), value) for key, value in (body.logit_bias or {}).items()]
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


def submit(
    st: AppState,
    prompt: list[int],
    max_tokens: int | None,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    logprobs: bool,
    top_logprobs: int,
    grammar: Grammar | None = None,
    seed_offset: int = 0,
    group: int = 0,
) -> RequestHandle:
    """Validate what needs the tokenizer and engine, then submit: nothing is sent before this."""
    if st.draining:
        raise APIError(
            503, "the server is shutting down", code="draining", headers={"Retry-After": "1"}
        )
    if not prompt:
        raise APIError(400, "the prompt must not be empty", code="invalid_value", param="prompt")
    window = st.engine.context_window
    if max_tokens is None:  # to EOS or the context end, as OpenAI clients expect
        max_tokens = st.settings.default_max_tokens or NO_WINDOW_MAX_TOKENS
        if window is not None:
            limit = window - len(prompt)
            max_tokens = limit if st.settings.default_max_tokens is None else min(max_tokens, limit)
        if max_tokens < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens. However, your "
                f"prompt is {len(prompt)} tokens, which leaves no room for the completion. "
                "Please reduce the length of the prompt or messages.",
                code="context_length_exceeded",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
    params = sampling(body)
    if seed_offset and params.seed is not None:  # choice k of n: its own stream of draws
        params = dataclasses.replace(params, seed=(params.seed + seed_offset) % 2**64)
    request = GenerationRequest(
        tuple(prompt),
        max_tokens,
        params,
        stop=tuple(body.stop or ()),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        grammar=grammar,
        group=group,
        kv_format=body.kv_format or "",
    )
    try:
        return st.engine.submit(request)
    except EngineError as exc:
        raise from_engine(exc) from None


_GROUPS = itertools.count(1)


def submit_all(
    st: AppState,
    prompts: list[list[int]],
    n: int,
    max_tokens: int | None,
    body: CompletionRequest | ChatCompletionRequest,
    **kw: Any,
) -> list[RequestHandle]:
    """``n`` choices for each prompt (choice ``p * n + k``), each its own engine request; a
    refusal of any cancels those already queued. ``n`` is at most ``--max-n``."""
    if n > st.settings.max_n:
        raise APIError(
            400,
            f"n must be at most {st.settings.max_n} on this server (--max-n)",
            code="invalid_value",
            param="n",
        )
    handles: list[RequestHandle] = []
    group = next(_GROUPS) if len(prompts) * n > 1 else 0  # fair shares between client requests
    try:
        for prompt in prompts:
            for k in range(n):
                handles.append(
                    submit(st, prompt, max_tokens, body, seed_offset=k, group=group, **kw)
                )
    except BaseException:
        for handle in handles:
            st.engine.cancel(handle)
        raise
    note_handles(handles)
    return handles


async def sse_response(
    request: Request,
    st: AppState,
    body: CompletionRequest | ChatCompletionRequest,
    handles: list[RequestHandle],
    arrived: float,
    base: dict[str, Any],
    chunk: Callable[[int, TokenEvent | FinishEvent], dict[str, Any] | None],
    n: int = 1,
) -> StreamingResponse:
    """The SSE response: ``chunk(choice index, event)`` per event, a usage chunk if asked,
    ``[DONE]``. Nothing is sent before every choice's first event, so an error before it gets
    its HTTP status, unless that takes longer than ``--stream-keepalive``: then the stream
    starts with keep-alives (and such an error is an error event)."""
    include = bool(body.stream_options and body.stream_options.include_usage)
    keepalive = st.settings.stream_keepalive
    deadline = time.monotonic() + keepalive
    try:
        firsts = [
            await first_batch(
                request, st.engine, h, max(0.0, deadline - time.monotonic()) if keepalive else None
            )
            for h in handles
        ]
    except BaseException:
        for handle in handles:
            st.engine.cancel(handle)
        raise

    def usage(finishes: list[FinishEvent]) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage_json_many(finishes, n)}

    body_iter = stream_choices(
        st.engine, handles, st.metrics, arrived, chunk, include, usage, firsts, keepalive
    )
    return DeadlineStreamingResponse(
        body_iter,
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
        write_timeout=st.settings.stream_write_timeout,
    )


def token_text(st: AppState, token: int) -> str:
    return st.engine.tokenizer.decode([token])
