"""A stream whose first token is slow to come (a long prefill, a queue) starts anyway after
``--stream-keepalive`` seconds and keeps its client's idle timer reset until the token comes;
an error after that start is an error event in the stream; a stream's client that leaves
cancels its request, on every API. Real server processes, real SDKs."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator

import anthropic
import httpx
import openai
import pytest

from tests.reliability.conftest import MODEL, Server, start_server, stop_server
from tests.reliability.test_lifecycle import (
    gauges,
    idle,
    one_slot_server,
    open_request,
    wait_for,
)

KEEPALIVE_S = 0.2
# EOS (id 2) banned: the blocker decodes its whole max_tokens, tens of seconds here
BLOCKER = {"model": MODEL, "prompt": "blocker", "max_tokens": 8000, "stream": True,
           "logit_bias": {"2": -100}}  # fmt: skip


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    """A second request waits in the queue for its first token."""
    yield from one_slot_server(
        tmp_path_factory, default_model_dir, "--stream-keepalive", str(KEEPALIVE_S)
    )


def behind_a_blocker(server: Server, victim: Callable[[], None], started: Callable[[], bool]):
    """Run ``victim`` (in a thread) queued behind a running blocker until ``started()``, then
    let the blocker go; returns once the victim has finished."""
    blocker = open_request(server, BLOCKER)
    try:
        wait_for(lambda: gauges(server)["veloxquant_requests_running"] == 1, what="running")
        errors: list[BaseException] = []

        def run() -> None:
            try:
                victim()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: started() or bool(errors), timeout=60, what="the victim's keep-alives")
        assert gauges(server)["veloxquant_requests_running"] == 1, "the blocker ended early"
    finally:
        blocker.close()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    wait_for(lambda: idle(server), what="idle")
    server.wait_pool_free()


STREAMS = {  # path, body, the keep-alive line, what ends a complete stream
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}]},
             ": keep-alive", "data: [DONE]"),
    "messages": ("/v1/messages",
                 {"messages": [{"role": "user", "content": "hi"}]},
                 "event: ping", "event: message_stop"),
    "responses": ("/v1/responses", {"input": "hi"}, "event: response.in_progress",
                  "event: response.incomplete"),
}  # fmt: skip


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_queued_stream_starts_with_keepalives_then_streams_its_answer(one_slot, api):
    path, body, keepalive, end = STREAMS[api]
    limit = "max_output_tokens" if api == "responses" else "max_tokens"
    payload = {"model": MODEL, "stream": True, limit: 16, **body}
    lines: list[str] = []

    def victim() -> None:
        with httpx.stream("POST", one_slot.base_url + path, json=payload, timeout=60) as r:
            assert r.status_code == 200
            lines.extend(r.iter_lines())

    # two keep-alives (the API's opening events, a ping or in_progress among them, come first)
    opening = 0 if api == "chat" else 1
    behind_a_blocker(one_slot, victim, lambda: lines.count(keepalive) >= 2 + opening)
    assert end in lines[-4:], lines[-6:]
    first_content = next(
        i for i, ln in enumerate(lines)
        if ln.startswith("data: ") and any(k in ln for k in ('"delta"', "_delta", '"choices"'))
    )  # fmt: skip
    waited = [ln for ln in lines[:first_content] if ln == keepalive]
    assert len(waited) >= 2 + opening, lines[:first_content]
    assert keepalive not in lines[first_content:] or api == "messages", "keep-alives after it"


def test_the_sdks_read_through_the_keepalives(one_slot):
    """The openai and anthropic SDKs take the keep-alives (an SSE comment, Anthropic's
    ``ping``) as nothing and get the answer."""
    seen: dict[str, object] = {}

    def with_openai() -> None:
        client = openai.OpenAI(base_url=f"{one_slot.base_url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen["openai"] = (chunks[-1].choices[0].finish_reason, text)

    def with_anthropic() -> None:
        client = anthropic.Anthropic(base_url=one_slot.base_url, api_key="x", max_retries=0)
        with client.messages.stream(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            final = stream.get_final_message()
        seen["anthropic"] = (final.stop_reason, final.usage.output_tokens)

    def queued_a_while() -> bool:  # its stream begun, keep-alives sent
        if gauges(one_slot)["veloxquant_requests_waiting"] != 1:
            return False
        threading.Event().wait(3 * KEEPALIVE_S)
        return True

    for victim in (with_openai, with_anthropic):
        behind_a_blocker(one_slot, victim, queued_a_while)
    assert seen["openai"][0] == "length" and seen["openai"][1], seen  # type: ignore[index]
    assert seen["anthropic"] == ("max_tokens", 8), seen


def test_a_client_that_leaves_a_started_stream_cancels_its_request(one_slot):
    """Queued (its stream begun with keep-alives), or decoding, on the Messages API (whose
    stream once kept decoding to max_tokens with nobody reading)."""
    body = {"model": MODEL, "max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    for stage in ("queued", "decoding"):
        blocker = open_request(one_slot, BLOCKER) if stage == "queued" else None
        if blocker is not None:
            wait_for(lambda: gauges(one_slot)["veloxquant_requests_running"] == 1, what="running")
        cancelled = one_slot.log().count("finish=cancelled")
        with httpx.stream(
            "POST", f"{one_slot.base_url}/v1/messages", json=body, timeout=60
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            if stage == "queued":  # message_start, ping, then the keep-alive pings
                pings = 0
                while pings < 3:
                    line = next(lines)
                    pings += line == "event: ping"
                    assert "content_block" not in line
            else:
                while "content_block_delta" not in next(lines):
                    pass
        if blocker is not None:
            blocker.close()
        wait_for(lambda: idle(one_slot), what="idle")
        logged = cancelled + 1
        wait_for(lambda: one_slot.log().count("finish=cancelled") >= logged,  # noqa: B023
                 what="the cancelled line")  # fmt: skip
        line = [ln for ln in one_slot.log().splitlines() if "POST /v1/messages" in ln][-1]
        assert "finish=cancelled" in line and " 200 " in line, line
        completion = int(line.split(" completion=")[1].split()[0])
        assert completion < 4000, line
    one_slot.wait_pool_free()


def test_an_error_after_the_stream_started_is_an_error_event(tmp_path, default_model_dir):
    """A queued stream that started with keep-alives, then refused (the server drains): the
    refusal is the API's error event, not a cut connection."""
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path, "--max-running", "1", "--stream-keepalive", str(KEEPALIVE_S),
        "--drain-timeout", "30", "--stream-interval-ms", "0",
    )  # fmt: skip
    try:
        blocker = open_request(srv, {**BLOCKER, "max_tokens": 1500, "stream": False})
        wait_for(lambda: gauges(srv)["veloxquant_requests_running"] == 1, what="running")
        got: dict[str, list[str]] = {"chat": [], "messages": []}
        opened = {name: threading.Event() for name in got}

        def victim(name: str) -> None:
            path, body, keepalive, _ = STREAMS[name]
            payload = {"model": MODEL, "stream": True, "max_tokens": 4, **body}
            with httpx.stream("POST", srv.base_url + path, json=payload, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    got[name].append(line)
                    if got[name].count(keepalive) >= 2:
                        opened[name].set()

        threads = [threading.Thread(target=victim, args=(n,)) for n in got]
        for t in threads:
            t.start()
        for event in opened.values():
            assert event.wait(60), got
        srv.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        chat = [json.loads(ln[6:]) for ln in got["chat"] if ln.startswith("data: {")]
        assert chat[-1]["error"]["code"] == "draining", got["chat"][-4:]
        assert got["chat"][-2:] in (["data: [DONE]", ""], ["data: [DONE]"])
        anthropic_error = got["messages"][got["messages"].index("event: error") + 1]
        assert json.loads(anthropic_error[6:])["error"]["type"] == "overloaded_error"
        blocker.settimeout(60)
        answer = b""
        while chunk := blocker.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]  # the running one finished
        blocker.close()
        assert srv.process.wait(60) == 0, srv.log()
    finally:
        stop_server(srv)


def test_no_keepalive_means_nothing_before_the_first_token(tmp_path, default_model_dir):
    """``--stream-keepalive 0``: a stream refused while queued gets its HTTP status."""
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(tmp_path, "--max-running", "1", "--stream-keepalive", "0",
                       "--drain-timeout", "30")  # fmt: skip
    try:
        blocker = open_request(srv, {**BLOCKER, "max_tokens": 1500, "stream": False})
        wait_for(lambda: gauges(srv)["veloxquant_requests_running"] == 1, what="running")
        statuses: list[int] = []

        def victim() -> None:
            payload = {"model": MODEL, "stream": True, "max_tokens": 4, **STREAMS["messages"][1]}
            with httpx.stream("POST", f"{srv.base_url}/v1/messages", json=payload, timeout=60) as r:
                statuses.append(r.status_code)
                r.read()

        thread = threading.Thread(target=victim)
        thread.start()
        wait_for(lambda: gauges(srv)["veloxquant_requests_waiting"] == 1, what="queued")
        threading.Event().wait(3 * KEEPALIVE_S)  # past where a keep-alive would have begun
        srv.process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert statuses == [503], statuses
        blocker.settimeout(60)
        while blocker.recv(65536):
            pass
        blocker.close()
        assert srv.process.wait(60) == 0, srv.log()
    finally:
        stop_server(srv)
