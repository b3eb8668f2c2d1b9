"""POST /v1/chat/completions: messages through the chat template, tools, structured outputs."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from veloxquant_mlx.engine.request.grammar import Grammar
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import FinishEvent, TokenEvent
from veloxquant_mlx.server.deps import AppState, state
from veloxquant_mlx.server.errors import APIError
from veloxquant_mlx.server.generation import collect_all, new_id, usage_json_many
from veloxquant_mlx.server.reasoning import (
    ReasoningSplitter,
    think_tags,
    think_then_split,
)
from veloxquant_mlx.server.reasoning import splitter_for as reasoning_splitter
from veloxquant_mlx.server.schemas import ChatCompletionRequest
from veloxquant_mlx.server.structured import compile_grammar, grammar_for
from veloxquant_mlx.server.submission import (
    OFF_LOOP_CHARS,
    check_model,
    fingerprint,
    sse_response,
    submit_all,
    token_text,
)
from veloxquant_mlx.server.tool_calls import ToolCallSplitter, splitter_for
from veloxquant_mlx.server.tools import (
    render_template,
    strict_calls_grammar,
    template_messages,
    template_tools,
    template_variables,
    tool_grammar,
    tool_or_answer_grammar,
)

router = APIRouter(prefix="/v1")  # the API key is checked before the body (middleware)


# ---------------------------------------------------------------------- chat


@dataclass(slots=True)
class PreparedChat:
    """A submitted chat request: a handle per choice and, when tools are on, a tool-call
    splitter per choice (each owns its own held-back text)."""

    handles: list[RequestHandle]
    splitters: list[ToolCallSplitter | None]
    reasoners: list[ReasoningSplitter | None]  # the reasoning apart, for a model that thinks


async def prepare_chat(st: AppState, body: ChatCompletionRequest) -> PreparedChat:
    """Template, constraints, validation, submission: everything before the first event.
    Shared with the Responses API."""
    check_model(st, body.model)
    tokenizer = st.engine.tokenizer
    tools = template_tools(body, tokenizer)
    messages = template_messages(body)
    variables = template_variables(body)

    def template(conversation: list[dict[str, Any]]) -> str:
        return str(render_template(tokenizer, conversation, tools, variables))

    def render() -> tuple[str, list[int], str | None]:
        # The answers this conversation resends, as the model generated them (server.answers):
        # tool calls as their text, then the text's tokens
        generated = st.answers.as_generated(messages)
        try:
            text = template(generated if generated is not None else messages)
        except Exception:  # a template that wants the calls as calls: as sent
            if generated is None:
                raise
            text = template(messages)
        tokens, continues = st.answers.encode(tokenizer, text)
        return text, tokens, continues

    try:
        # A long conversation (an agent's, resent every turn) takes ~130 ms to render and
        # tokenize at 30k tokens: off the event loop, where every stream would wait for it.
        long = sum(len(str(m.get("content") or "")) for m in messages) > OFF_LOOP_CHARS
        text, tokens, continues = await asyncio.to_thread(render) if long or tools else render()
    except APIError:
        raise
    except Exception as exc:  # a template that rejects the conversation (roles, order)
        raise APIError(400, f"cannot format these messages: {exc}", param="messages") from None
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    timeout = st.settings.grammar_timeout
    # Walking the tools' schemas is plain CPU: off the event loop, when there are any.
    tool_text, free_text = None, False
    if body.tools:  # one call forced, a call or the format's JSON, or strict calls' arguments
        for make in (tool_grammar, tool_or_answer_grammar, strict_calls_grammar):
            tool_text = await asyncio.to_thread(make, body, tokenizer)
            if tool_text is not None:
                free_text = make is strict_calls_grammar  # the answer's text left free
                break
    grammar: Grammar | None
    if tool_text is not None:
        grammar = await compile_grammar(st.engine, tool_text, "tools", timeout)
    else:
        grammar = await grammar_for(body.response_format, st.engine, timeout)
    handles = submit_all(
        st, [tokens], body.n, max_tokens, body,
        logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0, grammar=grammar,
    )  # fmt: skip
    splitters = [splitter_for(body, tokenizer) for _ in handles]
    if len(handles) == 1:  # one answer to remember if it finishes whole; of n, none
        eos = getattr(tokenizer, "eos_token_ids", None) or ()
        prompt = handles[0].request.prompt_tokens
        base = splitters[0].call_base if splitters[0] is not None else None
        handles[0].tap = st.answers.tap(text, prompt, continues, eos, base)
    # A grammar holds from the first token: a constrained answer has no think block to split
    # (but an answer left free up to its strict tool calls may have one).
    free = grammar is None or free_text
    enabled = st.settings.reasoning != "off" and free
    tail = tokenizer.decode(tokens[-16:]) if enabled and think_tags(tokenizer) else ""
    return PreparedChat(
        handles,
        splitters,
        [reasoning_splitter(tokenizer, tail, enabled) for _ in handles],
    )


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    prepared = await prepare_chat(st, body)
    handles, splitters, reasoners = prepared.handles, prepared.splitters, prepared.reasoners
    rid, created = new_id("chatcmpl"), int(time.time())

    def entry(token: int, lp: float | None) -> dict[str, Any]:
        text = token_text(st, token)
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

    def finish_reason(reason: str, n_calls: int) -> str:
        return "tool_calls" if n_calls and reason == "stop" else reason

    if body.stream:
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": st.model_name,
            "system_fingerprint": fingerprint(st),
        }
        started = [False] * len(handles)

        def chunk(index: int, event: TokenEvent | FinishEvent) -> dict[str, Any] | None:
            splitter = splitters[index]
            delta: dict[str, Any] = {}
            if not started[index]:
                delta["role"] = "assistant"
            final = isinstance(event, FinishEvent)
            cut = final and event.finish_reason == "length"  # type: ignore[union-attr]
            reasoner = reasoners[index]
            thought, text, calls = think_then_split(reasoner, splitter, event.text, final, cut)
            if thought:
                delta["reasoning_content"] = thought
            plain = splitter is None and reasoner is None
            if text or (isinstance(event, TokenEvent) and plain):
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            if isinstance(event, TokenEvent):
                if not delta and event.logprob is None:
                    return None  # held back: part of a tool call or a tag
                started[index] = True
                return {**base, "choices": [
                    {"index": index, "delta": delta, "logprobs": logprobs_json([event]),
                     "finish_reason": None}
                ]}  # fmt: skip
            started[index] = True
            n_calls = splitter.n_calls if splitter is not None else 0
            return {**base, "choices": [
                {"index": index, "delta": delta, "logprobs": None,
                 "finish_reason": finish_reason(event.finish_reason, n_calls)}
            ]}  # fmt: skip

        return await sse_response(request, st, body, handles, arrived, base, chunk, body.n)
    outcomes = await collect_all(request, st.engine, handles, st.metrics, arrived)
    choices = []
    for index, (outcome, splitter) in enumerate(zip(outcomes, splitters, strict=True)):
        assert outcome.finish is not None
        message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
        cut = outcome.finish.finish_reason == "length"
        reasoner = reasoners[index]
        thought, content, calls = think_then_split(reasoner, splitter, outcome.text, True, cut)
        if splitter is not None or reasoner is not None:
            message["content"] = content or None
        if reasoner is not None:
            message["reasoning_content"] = thought or None
        if calls:
            message["tool_calls"] = [
                {key: v for key, v in c.items() if key != "index"} for c in calls
            ]
        n_calls = len(calls)
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs_json(outcome.tokens),
                "finish_reason": finish_reason(outcome.finish.finish_reason, n_calls),
            }
        )
    finishes = [o.finish for o in outcomes if o.finish is not None]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": st.model_name,
        "system_fingerprint": fingerprint(st),
        "choices": choices,
        "usage": usage_json_many(finishes, body.n),
    }
