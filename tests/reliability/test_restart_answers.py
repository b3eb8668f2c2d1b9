"""A conversation's next turn after a restart hits through the answer the server gave before
it: with ``--prefix-cache-dir`` the remembered answers (``server.answers``) are written at a
clean stop beside the pages and read at start, so the resent answer is encoded with the tokens
the model generated, whose pages the disk tier holds."""

from __future__ import annotations

import os

import httpx

from tests.reliability.conftest import start_server, stop_server

BLOCK = 16  # the server's default block size: only full pages are cached


def chat(server, messages: list[dict]) -> dict:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 40, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_the_turn_after_a_restart_hits_through_the_previous_answer(tmp_path, default_model_dir):
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    pages = tmp_path / "pages"
    first = [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": "List the files."},
    ]
    srv = start_server(tmp_path, "--prefix-cache-dir", str(pages))
    try:
        out = chat(srv, first)
        srv.wait_pool_free()
    finally:
        assert stop_server(srv) == 0, srv.log()
    assert "remembered answers: 1 written" in srv.log()
    said, usage = out["choices"][0]["message"]["content"], out["usage"]
    seen = usage["prompt_tokens"] + usage["completion_tokens"]

    second = [*first, {"role": "assistant", "content": said}, {"role": "user", "content": "Go."}]
    srv = start_server(tmp_path, "--prefix-cache-dir", str(pages))
    try:
        usage = chat(srv, second)["usage"]
        srv.wait_pool_free()
    finally:
        assert stop_server(srv) == 0, srv.log()
    assert "remembered answers: 1 read" in srv.log()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # every full page of the first turn, its answer's too (the last generated token's KV is
    # made by the next forward, so the answer's last token may start the new part)
    assert cached >= (seen - 1) // BLOCK * BLOCK, (cached, seen)
    assert cached > usage["prompt_tokens"] - 40  # not the first prompt's pages alone
