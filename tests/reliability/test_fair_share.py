"""One client request cannot take the scheduler: while others wait, a request of many
sequences (prompts x n) holds at most a fair share of the running slots (its newest are
preempted and recomputed later) and of each step's prefill budget, so a plain request sent
after it starts and finishes while it still runs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.conftest import MODEL

pytestmark = pytest.mark.anyio


async def test_a_plain_request_is_served_beside_a_fat_one(client_for):
    client: httpx.AsyncClient = await client_for(max_running=8, max_queue=64, kv_cache_mb=64)
    engine = client.engine  # type: ignore[attr-defined]
    no_eos = {str(t): -100 for t in engine.tokenizer.eos_token_ids}
    fat = {
        "model": MODEL,
        "prompt": [f"fat prompt {i} " * 20 for i in range(4)],
        "n": 4,  # 16 sequences of one request, twice the running slots
        "max_tokens": 400,
        "temperature": 0.0,
        "logit_bias": no_eos,  # every sequence runs to max_tokens
    }
    plain = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0.0}
    done: list[str] = []

    async def send(name: str, body: dict) -> httpx.Response:
        r = await client.post("/v1/completions", json=body, timeout=600)
        done.append(name)
        return r

    fat_task = asyncio.create_task(send("fat", fat))
    for _ in range(3000):  # the fat request holds every slot (bounded: 30 s)
        if engine.stats().running == 8 or fat_task.done():
            break
        await asyncio.sleep(0.01)
    assert engine.stats().running == 8, fat_task.done() and fat_task.result().text[:300]
    r = await send("plain", plain)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert done == ["plain"]  # answered while the fat one still runs
    assert engine.stats().preemptions_total >= 1  # the slot came from its share
    r = await fat_task
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert len(choices) == 16 and all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 16 * 400
