"""In-process app over httpx's ASGI transport, with the lifespan run by the fixture."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.conftest import assert_engine_all_free, assert_pool_all_free
from veloxquant_mlx.config import Settings
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.server.app import create_app, engine_config

ADMIN = "admin-key-for-tests"
MODEL = "veloxquant-tiny-llama"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settings(default_model_dir, **overrides) -> Settings:
    base = {
        "model_cache_dir": str(default_model_dir.parent),
        "admin_key": ADMIN,
        "n_blocks": 4000,
        "max_queue": 8,
        "drain_timeout": 5.0,
    }
    return Settings(**{**base, **overrides})


async def wait_idle(engine: Engine, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.blocks_in_use == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not idle: {engine.stats()}")


@pytest.fixture
async def client_for(default_model_dir):
    """Factory: an httpx client on a fresh app (and engine) made with setting overrides."""
    stack: list[tuple] = []

    async def make(**overrides) -> httpx.AsyncClient:
        s = settings(default_model_dir, **overrides)
        engine = Engine(engine_config(s)).start()
        await asyncio.to_thread(engine.wait_ready, 120)
        app = create_app(s, engine=engine)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client.engine = engine  # type: ignore[attr-defined]
        stack.append((client, lifespan, engine))
        return client

    yield make
    for client, lifespan, engine in stack:
        await client.aclose()
        if engine.alive:
            await wait_idle(engine)
            await asyncio.to_thread(assert_engine_all_free, engine)
        await lifespan.__aexit__(None, None, None)
        await asyncio.to_thread(engine.shutdown, 5)
        assert_pool_all_free(engine.pool)


@pytest.fixture
async def client(client_for) -> AsyncIterator[httpx.AsyncClient]:
    yield await client_for()
