"""What the app does before it serves: the heap loaded so far frozen out of Python's cyclic
collector while it serves (a fresh server's second request met its first full pass over the
model and tokenizer), and back when the app stops (a process may make more apps)."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest

from tests.conftest import assert_pool_all_free
from tests.server.conftest import MODEL, settings
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.server.app import create_app, engine_config

pytestmark = pytest.mark.anyio


async def test_the_loaded_heap_is_frozen_while_serving_and_back_after(default_model_dir):
    s = settings(default_model_dir)
    engine = Engine(engine_config(s)).start()
    await asyncio.to_thread(engine.wait_ready, 120)
    app = create_app(s, engine=engine)
    lifespan = app.router.lifespan_context(app)
    gc.unfreeze()
    await lifespan.__aenter__()
    try:
        assert gc.get_freeze_count() > 0
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": MODEL, "max_tokens": 4, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and "[DONE]" in r.text
    finally:
        await lifespan.__aexit__(None, None, None)
        await asyncio.to_thread(engine.shutdown, 5)
    assert gc.get_freeze_count() == 0
    assert_pool_all_free(engine.pool)
