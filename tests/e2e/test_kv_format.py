"""Servers with quantized KV blocks over real HTTP: a residual window (``--kv-format int8
--kv-recent-tokens 16``) through the openai SDK's chat and streams, and a format per request
(``--kv-formats``) through the openai and anthropic SDKs; the formats in /metrics, the pool
free after, and a refused combination."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, Server, free_port, start_server, stop_server


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path_factory.mktemp("kv-int8"),
        "--kv-format", "int8", "--kv-recent-tokens", "16", "--kv-cache-mb", "4",
        "--engine-process",
    )  # fmt: skip
    yield srv
    srv.wait_pool_free()
    assert stop_server(srv) == 0, srv.log()


def test_int8_blocks_serve_chat_and_streams_and_show_in_metrics(int8_server):
    client = openai.AsyncOpenAI(base_url=f"{int8_server.base_url}/v1", api_key="x")

    async def one(i: int) -> str:
        if i % 2:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Tell story {i} about a boat"}],
                max_tokens=24,
                stream=True,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        r = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Question {i}: why is the sky blue?"}],
            max_tokens=24,
        )
        assert r.usage is not None  # sampled: the model's end of text may come first
        assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content or ""

    async def run() -> list[str]:
        try:
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await client.close()

    texts = asyncio.run(run())
    assert len(texts) == 6 and all(isinstance(text, str) for text in texts)
    metrics = httpx.get(f"{int8_server.base_url}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert fams["veloxquant_build_info"].samples[0].labels["kv_format"] == "int8"
    for family in ("veloxquant_kv_format_blocks", "veloxquant_kv_format_bytes"):
        # the int8 blocks, and the residual windows' blocks in the model's type
        assert {s.labels["format"] for s in fams[family].samples} == {"int8", "float32"}
    per_block = fams["veloxquant_kv_bytes_per_block"].samples[0].value
    # the embedded model: 16 tokens x 4 KV heads x (32 one-byte codes + 2 float32 per group)
    assert per_block == 16 * 4 * (32 + 8)


def test_a_format_the_layout_cannot_hold_is_refused_at_start_in_one_line(
    tmp_path, default_model_dir
):
    cmd = [
        sys.executable, "-m", "veloxquant_mlx.server", "--port", str(free_port()),
        "--model-cache-dir", str(default_model_dir.parent),
        "--kv-format", "int4", "--kv-layout", "paged", "--no-engine-process",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "--kv-format int4 needs --kv-layout dense" in out
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def mixed_server(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path_factory.mktemp("kv-mixed"),
        "--kv-format", "int8", "--kv-formats", "int4,auto", "--kv-cache-mb", "4",
    )  # fmt: skip
    yield srv
    srv.wait_pool_free()
    assert stop_server(srv) == 0, srv.log()


def test_requests_choose_their_kv_format_through_both_sdks(mixed_server):
    """Chat streams and completions at once in int8 (the server's own), int4 and float32
    (``kv_format`` in the body: the SDKs' extra_body), an Anthropic Messages call with its
    own; each format's blocks in /metrics; a format not served is a 400 in each API's shape,
    naming the parameter."""
    base = mixed_server.base_url
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    asks = ["int4", "fp32", None, "auto", "int4", "fp32"]

    async def one(i: int, fmt: str | None) -> str:
        extra = {} if fmt is None else {"kv_format": fmt}
        prompt = f"Conversation {i}: tell me about ships and harbours at length. " * 4
        if i % 2:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=20,
                stream=True,
                extra_body=extra,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        r = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, extra_body=extra
        )
        # sampled (temperature 1, the API's default): the model's end of text may come first
        assert r.usage is not None
        assert r.usage.completion_tokens == 20 or r.choices[0].finish_reason == "stop"
        return r.choices[0].text

    async def run() -> list[str]:
        try:
            return await asyncio.gather(*(one(i, f) for i, f in enumerate(asks)))
        finally:
            await client.close()

    assert all(isinstance(text, str) for text in asyncio.run(run()))
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=[{"role": "user", "content": "Say something about rivers."}],
        extra_body={"kv_format": "int4"},
    )
    assert msg.usage.output_tokens == 12 or msg.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"kv_format": "int2"},
        )
    assert "this server allows: auto, int8, int4, fp32" in str(refused.value)
    sync = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        sync.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"kv_format": "bf16"},
        )
    assert bad.value.status_code == 400 and bad.value.body["param"] == "kv_format"
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    held = {s.labels["format"]: s.value for s in fams["veloxquant_kv_format_blocks"].samples}
    assert set(held) == {"int8", "int4", "float32"}  # the cached pages of each
    assert all(v > 0 for v in held.values())
    assert sum(held.values()) == fams["veloxquant_prefix_cache_blocks"].samples[0].value
