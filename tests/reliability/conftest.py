"""The reliability catalogue's tools: one app (and engine) per module driven in process, real
server processes for what needs real sockets, and the checks every answer must pass."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from tests.conftest import assert_engine_all_free
from tests.e2e.conftest import ADMIN, MODEL, Server, start_server, stop_server
from veloxquant_mlx.config import Settings
from veloxquant_mlx.server.app import create_app

API_KEY = "reliability-api-key"
ERROR_KEYS = {"message", "type", "param", "code"}
# What must never reach a client: a stack trace, a source path, an exception's repr.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/root|/home|/usr/|site-packages|0x[0-9a-f]{6,}")

__all__ = ["ADMIN", "API_KEY", "MODEL", "Server", "assert_error", "start_server", "stop_server"]


def assert_error(
    r: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    """``r`` is an OpenAI-shaped error with ``status`` (and ``code``/``param`` if given) that
    leaks nothing about the server's insides."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert not LEAKS.search(r.text), r.text
    if code is not None:
        assert err["code"] == code, body
    if param is not None:
        assert err["param"] == param, body
    if status in (429, 503):
        assert "retry-after" in r.headers, r.headers
    return err


def wait_pool_free(engine, timeout: float = 20.0) -> None:
    """Wait until ``engine`` holds no block for a request, then check it all free."""
    deadline = time.monotonic() + timeout
    while engine.stats().blocks_in_use and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_engine_all_free(engine)


@pytest.fixture(scope="module")
def app_client(default_model_dir) -> Iterator[TestClient]:
    """One app with its own engine for a whole module (TestClient runs the lifespan); the pool
    is checked all free after every test and at the end."""
    settings = Settings(
        model_cache_dir=str(default_model_dir.parent),
        admin_key=ADMIN,
        api_key=API_KEY,
        n_blocks=4000,
        max_queue=16,
        drain_timeout=5.0,
        max_body_bytes=64 * 1024,
    )
    app = create_app(settings)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client
        wait_pool_free(app.state.vq.engine)


@pytest.fixture
def pool_free(app_client) -> Iterator[None]:
    yield
    wait_pool_free(app_client.app.state.vq.engine)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    """A real server process with small, quick edge limits and an API key."""
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path_factory.mktemp("edge"),
        "--n-blocks", "4000", "--api-key", API_KEY,
        "--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1",
        "--max-connections", "16", "--max-body-bytes", "4096", "--max-header-bytes", "8192",
    )  # fmt: skip
    yield srv
    srv.wait_pool_free()
    assert stop_server(srv) == 0, srv.log()


def good_completion(base_url: str, **extra) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": "still serving?", "max_tokens": 4, **extra},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )


def sse_events(text: str) -> list:
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


# The in-process async app factory of the server tests (httpx over ASGI, lifespan run).
from tests.server.conftest import anyio_backend, client_for  # noqa: E402

__all__ += ["anyio_backend", "client_for"]
