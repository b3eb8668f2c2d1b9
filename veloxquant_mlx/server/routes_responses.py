"""POST /v1/responses: the Responses API over the chat path (text in, text or tool calls out),
streamed with the documented event sequence."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import FinishEvent, TokenEvent
from veloxquant_mlx.server.deps import AppState, state
from veloxquant_mlx.server.errors import APIError, from_finish
from veloxquant_mlx.server.generation import (
    RESULTS,
    Opening,
    chain,
    collect,
    ended_with,
    first_batch,
)
from veloxquant_mlx.server.reasoning import ReasoningSplitter, think_then_split
from veloxquant_mlx.server.responses_api import (
    ResponsesRequest,
    input_messages,
    output_messages,
    to_chat,
)
from veloxquant_mlx.server.responses_tools import ToolSet
from veloxquant_mlx.server.routes_chat import prepare_chat
from veloxquant_mlx.server.streaming import DeadlineStreamingResponse
from veloxquant_mlx.server.tool_calls import ToolCallSplitter

log = logging.getLogger("veloxquant.server")
router = APIRouter(prefix="/v1")  # the API key is checked before the body (middleware)

# The chat fields a Responses request's are translated to, named back as the client wrote them.
_RESPONSES_PARAM = {
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class Built:
    """The response object as it grows: its output items in order."""

    req: ResponsesRequest
    model: str
    stored: bool = False  # kept for previous_response_id (``store`` and --responses-store)
    inputs: list[dict[str, Any]] = field(default_factory=list)  # its input as chat messages
    tools: ToolSet = field(default_factory=ToolSet)  # its tools, which name the calls
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": _id("msg"),
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": _id("rs"),
            "status": status,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def call_item(self, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        return self.tools.item(call, status)

    def json(self, status: str, finish: FinishEvent | None) -> dict[str, Any]:
        req = self.req
        usage = None
        if finish is not None:
            u = finish.usage
            usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            }
        incomplete = finish is not None and finish.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": self.stored,
            "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
        }


def _earlier(st: AppState, req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The conversation ``previous_response_id`` continues, as chat messages."""
    if req.previous_response_id is None:
        return None
    if not st.responses.capacity:
        message = "responses are not stored here (--responses-store 0); send the conversation"
        raise APIError(400, message, code="previous_response_not_found",
                       param="previous_response_id")  # fmt: skip
    try:
        return st.responses.conversation(req.previous_response_id)
    except KeyError as exc:
        raise APIError(400, str(exc.args[0]), code="previous_response_not_found",
                       param="previous_response_id") from None  # fmt: skip


def _store(st: AppState, built: Built, result: dict[str, Any]) -> None:
    """Keep a finished response for ``previous_response_id``, if it is to be stored."""
    if built.stored:
        turn = [*built.inputs, *output_messages(built.output, built.tools)]
        st.responses.put(result, turn, built.req.previous_response_id)


@router.get("/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request) -> Any:
    found = state(request).responses.get(response_id)
    if found is None:
        raise APIError(404, f"no stored response '{response_id}'", code="not_found")
    return found


@router.delete("/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Any:
    if not state(request).responses.delete(response_id):
        raise APIError(404, f"no stored response '{response_id}'", code="not_found")
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/responses", response_model=None)
async def responses(req: ResponsesRequest, request: Request) -> Any:
    st = state(request)
    arrived = time.monotonic()
    tools = ToolSet.of(req.tools)
    if tools.left_out:
        log.info("responses: tools of types %s left out (nothing here runs them)",
                 ", ".join(sorted(set(tools.left_out))))  # fmt: skip
    inputs = input_messages(req, tools)
    body = to_chat(req, tools, [*(_earlier(st, req) or ()), *inputs])
    try:
        prepared = await prepare_chat(st, body)
    except APIError as exc:
        exc.param = _RESPONSES_PARAM.get(exc.param or "", exc.param)
        raise
    stored = req.store is not False and st.responses.capacity > 0
    built = Built(req, st.model_name, stored, inputs, tools)
    handle, splitter = prepared.handles[0], prepared.splitters[0]  # n is 1 here
    reasoner = prepared.reasoners[0]
    if req.stream:
        keepalive = st.settings.stream_keepalive
        first = await first_batch(request, st.engine, handle, keepalive or None)
        times: list[float] = []
        events = _events(st, built, handle, splitter, reasoner, first, times)
        return DeadlineStreamingResponse(
            ended_with(events, st.engine, handle, st.metrics, arrived, times),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            write_timeout=st.settings.stream_write_timeout,
        )
    outcome = await collect(request, st.engine, handle, st.metrics, arrived)
    assert outcome.finish is not None
    cut = outcome.finish.finish_reason == "length"
    thought, text, calls = think_then_split(reasoner, splitter, outcome.text, True, cut)
    if thought:
        built.output.append(built.reasoning_item(thought))
    if text or not calls:
        built.output.append(built.message_item(text, "completed"))
    built.output += [built.call_item(c) for c in calls]
    result = built.json("completed", outcome.finish)
    _store(st, built, result)
    return result


async def _events(
    st: AppState,
    built: Built,
    handle: RequestHandle,
    splitter: ToolCallSplitter | None,
    reasoner: ReasoningSplitter | None,
    first: Opening,
    times: list[float],
) -> AsyncGenerator[bytes, None]:
    """response.created ... output_text.delta ... response.completed, as OpenAI sends them
    (``response.in_progress`` again every ``--stream-keepalive`` seconds while the first token
    is awaited). Its tokens' times go to ``times``."""
    seq = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        payload = {"type": kind, "sequence_number": seq - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    finish: FinishEvent | None = None
    message: dict[str, Any] | None = None
    text_so_far: list[str] = []
    yield event("response.created", response=built.json("in_progress", None))
    yield event("response.in_progress", response=built.json("in_progress", None))

    def open_message() -> list[bytes]:
        nonlocal message
        message = built.message_item("", "in_progress")
        message["content"] = []
        built.output.append(message)
        index = len(built.output) - 1
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            event("response.output_item.added", output_index=index, item=message),
            event("response.content_part.added", item_id=message["id"],
                  output_index=index, content_index=0, part=part),
        ]  # fmt: skip

    def text_delta(text: str) -> list[bytes]:
        out = open_message() if message is None else []
        assert message is not None
        text_so_far.append(text)
        out.append(event("response.output_text.delta", item_id=message["id"],
                         output_index=built.output.index(message), content_index=0,
                         delta=text, logprobs=[]))  # fmt: skip
        return out

    thinking: dict[str, Any] | None = None  # the reasoning item while it is open
    thoughts: list[str] = []

    def reasoning_delta(text: str) -> list[bytes]:
        nonlocal thinking
        out = []
        if thinking is None:
            thinking = built.reasoning_item("", "in_progress")
            built.output.append(thinking)
            out.append(event("response.output_item.added",
                             output_index=len(built.output) - 1, item=thinking))  # fmt: skip
        thoughts.append(text)
        out.append(event("response.reasoning_text.delta", item_id=thinking["id"],
                         output_index=built.output.index(thinking), content_index=0,
                         delta=text))  # fmt: skip
        return out

    def close_reasoning() -> list[bytes]:
        nonlocal thinking
        assert thinking is not None
        full, index = "".join(thoughts), built.output.index(thinking)
        thinking.update(status="completed", content=[{"type": "reasoning_text", "text": full}])
        done = [
            event("response.reasoning_text.done", item_id=thinking["id"], output_index=index,
                  content_index=0, text=full),
            event("response.output_item.done", output_index=index, item=thinking),
        ]  # fmt: skip
        thinking = None
        return done

    def call_events(calls: list[dict[str, Any]]) -> list[bytes]:
        out = []
        for call in calls:
            item = built.call_item(call, "in_progress")
            built.output.append(item)
            index = len(built.output) - 1
            done = {**item, "status": "completed"}
            built.output[index] = done
            if item["type"] == "custom_tool_call":
                body = [
                    event("response.custom_tool_call_input.delta", item_id=item["id"],
                          output_index=index, delta=item["input"]),
                    event("response.custom_tool_call_input.done", item_id=item["id"],
                          output_index=index, input=item["input"]),
                ]  # fmt: skip
            else:
                body = [
                    event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=index, delta=item["arguments"]),
                    event("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, name=item["name"], arguments=item["arguments"]),
                ]  # fmt: skip
            out += [
                event("response.output_item.added", output_index=index, item=item),
                *body,
                event("response.output_item.done", output_index=index, item=done),
            ]
        return out

    async for batch in chain(*first, st.settings.stream_keepalive):
        if not batch:  # an event, not a comment: Codex's idle timer counts events
            yield event("response.in_progress", response=built.json("in_progress", None))
            continue
        out: list[bytes] = []
        for ev in batch:
            if isinstance(ev, TokenEvent):
                times.append(ev.time)
            else:
                finish = ev
            final = isinstance(ev, FinishEvent)
            cut = final and ev.finish_reason == "length"  # type: ignore[union-attr]
            thought, text, calls = think_then_split(reasoner, splitter, ev.text, final, cut)
            if thought:
                out += reasoning_delta(thought)
            if thinking is not None and (text or calls or final):
                out += close_reasoning()
            if text:
                out += text_delta(text)
            out += call_events(calls)
        if out:
            yield b"".join(out)
    assert finish is not None
    if finish.finish_reason not in RESULTS:
        err = from_finish(finish)
        yield event("error", code=err.code, message=err.message, param=None)
        yield event("response.failed", response={
            **built.json("failed", finish),
            "error": {"code": err.code, "message": err.message},
        })  # fmt: skip
        return
    call_kinds = ("function_call", "custom_tool_call")
    if message is None and not any(i["type"] in call_kinds for i in built.output):
        for chunk in open_message():
            yield chunk
    if message is not None:
        full = "".join(text_so_far)
        index = built.output.index(message)
        part = {"type": "output_text", "text": full, "annotations": []}
        message.update(status="completed", content=[part])
        yield event("response.output_text.done", item_id=message["id"], output_index=index,
                    content_index=0, text=full, logprobs=[])  # fmt: skip
        yield event("response.content_part.done", item_id=message["id"], output_index=index,
                    content_index=0, part=part)  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=message)
    status = "completed"
    result = built.json(status, finish)
    _store(st, built, result)
    yield event(f"response.{'incomplete' if finish.finish_reason == 'length' else status}",
                response=result)  # fmt: skip
