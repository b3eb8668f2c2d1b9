"""The prefix cache over the API: ``cached_tokens`` in every usage shape (streaming included),
its metrics in Prometheus text, ``/admin/pool``'s breakdown, the reset endpoint and its key,
and ``--no-prefix-caching``."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ADMIN, MODEL, wait_idle

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant. " * 12  # well over a few 16-token blocks
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def chat(question: str, **kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        **kw,
    }


def metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_chat_reports_cached_tokens_on_a_shared_system_prompt(client):
    first = (await client.post("/v1/chat/completions", json=chat("What is 2+2?"))).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = (await client.post("/v1/chat/completions", json=chat("Name a color."))).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]

    # streaming: the usage chunk carries it too
    r = await client.post(
        "/v1/chat/completions",
        json=chat("Name a fruit.", stream=True, stream_options={"include_usage": True}),
    )
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached

    # the Responses API names it input_tokens_details
    r = await client.post(
        "/v1/responses",
        json={"model": MODEL, "instructions": SYSTEM, "input": "Hello", "max_output_tokens": 4},
    )
    assert r.status_code == 200, r.text
    assert "cached_tokens" in r.json()["usage"]["input_tokens_details"]

    m = metrics((await client.get("/metrics")).text)
    assert m["veloxquant_prefix_cache_hits_total"] >= 2 * cached
    assert m["veloxquant_prefix_cache_queries_total"] > m["veloxquant_prefix_cache_hits_total"]
    assert m["veloxquant_prefix_cache_blocks"] > 0
    await wait_idle(client.engine)
    m = metrics((await client.get("/metrics")).text)
    assert m["veloxquant_prefix_cache_evictable_blocks"] == m["veloxquant_prefix_cache_blocks"]
    # the pool's own in-use count includes the cached blocks nobody holds
    assert m["veloxquant_block_pool_blocks_in_use"] == m["veloxquant_prefix_cache_blocks"]


async def test_admin_pool_tells_blocks_apart_and_reset_frees_the_unused(client):
    await client.post("/v1/chat/completions", json=chat("Hi"))
    await wait_idle(client.engine)
    view = (await client.get("/admin/pool", headers=AUTH)).json()
    cache = view["prefix_cache"]
    assert cache["enabled"] and cache["cached_blocks"] > 0
    assert cache["evictable_blocks"] == cache["cached_blocks"]
    assert view["blocks_in_use_by_running"] == 0
    assert view["stats"]["blocks_in_use"] == cache["cached_blocks"]

    r = await client.post("/admin/prefix-cache/reset")  # no key
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await client.post("/admin/prefix-cache/reset", headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["freed_blocks"] == cache["cached_blocks"]
    assert body["stats"]["blocks_in_use"] == 0 and body["owners"] == {}

    again = (await client.post("/v1/chat/completions", json=chat("Hi"))).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # it was dropped


async def test_no_prefix_caching_reports_zero_and_keeps_nothing(client_for):
    client = await client_for(prefix_caching=False)
    for q in ("A?", "B?"):
        body = (await client.post("/v1/chat/completions", json=chat(q))).json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await wait_idle(client.engine)
    view = (await client.get("/admin/pool", headers=AUTH)).json()
    assert view["prefix_cache"]["enabled"] is False and view["stats"]["blocks_in_use"] == 0


async def test_the_disk_tier_shows_in_prometheus(client_for, tmp_path):
    client = await client_for(prefix_cache_dir=str(tmp_path))
    assert (await client.post("/v1/chat/completions", json=chat("What is 2+2?"))).status_code == 200
    await wait_idle(client.engine)  # type: ignore[attr-defined]
    r = await client.post("/admin/prefix-cache/reset", headers=AUTH)  # evicted: written
    assert r.status_code == 200
    for _ in range(100):  # the writer thread's files land (bounded: 10 s)
        if list(tmp_path.rglob("*.safetensors")):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.2)  # the rest of the queue
    # the engine publishes its counters after a turn that changed something: one more request
    assert (await client.post("/v1/chat/completions", json=chat("2+3?"))).status_code == 200
    await wait_idle(client.engine)  # type: ignore[attr-defined]
    m = metrics((await client.get("/metrics")).text)
    assert m["veloxquant_prefix_cache_disk_pages"] > 0
    assert m["veloxquant_prefix_cache_disk_writes_total"] == m["veloxquant_prefix_cache_disk_pages"]
    assert m["veloxquant_prefix_cache_disk_bytes"] > 0
    assert m["veloxquant_prefix_cache_disk_skipped_total"] == 0


async def test_no_disk_metrics_without_the_disk_tier(client):
    m = metrics((await client.get("/metrics")).text)
    assert not any(name.startswith("veloxquant_prefix_cache_disk") for name in m)
