"""Two replicas behind a real SMG router (PyPI ``smg``), all on loopback: they join it by
themselves (``--register-with``), the router health-checks ``/ready`` and reads ``/v1/loads``
(a shrink shows in its view), requests sharing a prefix go to the replica that has it cached,
a draining replica leaves the router and gets no more traffic, and one shrunk below a single
request is taken out of rotation by the router's health check. Pools all free at the end."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest.proc import smg_router
from tests.e2e.conftest import ADMIN, MODEL, Server, start_server, stop_server

KEY = "replica-b-api-key"
B_AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIXES = [
    f"You are assistant number {k}. Answer briefly, kindly and only about topic {k}. " * 4
    for k in range(3)
]


@pytest.fixture
def router(tmp_path) -> Iterator[str]:
    with smg_router("cache_aware", tmp_path / "smg.log") as url:
        yield url


def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def workers(router: str) -> dict[str, dict]:
    listing = httpx.get(f"{router}/workers", timeout=5).json()["workers"]
    return {w["url"]: w for w in listing if w.get("status") == "ready" and w.get("is_healthy")}


def counters(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("veloxquant_requests_finished_total", "veloxquant_prefix_cache_")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def finished(server: Server) -> float:
    return counters(server).get('veloxquant_requests_finished_total{reason="length"}', 0.0)


def complete(router: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_two_replicas_behind_smg_register_route_by_prefix_and_drain(
    tmp_path, default_model_dir, router
):
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    # b requires an API key on /v1: it registers it, and the router presents it to b
    a = start_server(tmp_path, "--register-with", router, "--blas", "off", "--n-blocks", "4000")
    b = start_server(tmp_path, "--register-with", router, "--blas", "off", "--n-blocks", "4000",
                     "--api-key", KEY)  # fmt: skip
    started: list[Server] = []
    try:
        seen = until(lambda: len(workers(router)) == 2 and workers(router), 90, "2 workers")
        assert set(seen) == {a.base_url, b.base_url}
        assert all(w["runtime_type"] == "mlx" for w in seen.values())

        # the router's view is our /v1/loads, and follows a shrink
        assert httpx.get(f"{b.base_url}/v1/loads", timeout=5).status_code == 401
        assert KEY not in httpx.get(f"{router}/workers", timeout=5).text
        ours = httpx.get(f"{b.base_url}/v1/loads", headers=B_AUTH, timeout=5).json()["loads"][0]

        def capacity_seen() -> int | None:
            load = workers(router)[b.base_url].get("engine_load") or {}  # after a first poll
            return (load.get("loads") or [{}])[0].get("max_total_num_tokens")

        until(lambda: capacity_seen() == ours["max_total_num_tokens"], 15, "loads read")
        shrink = {"stream": "kv", "target_free": 1000}
        auth = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.post(f"{b.base_url}/admin/pool/shrink", json=shrink, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        shrunk = httpx.get(f"{b.base_url}/v1/loads", headers=B_AUTH, timeout=5).json()["loads"][0]
        assert shrunk["max_total_num_tokens"] < ours["max_total_num_tokens"]
        until(lambda: capacity_seen() == shrunk["max_total_num_tokens"], 15, "shrink seen")

        # prefix affinity: each prefix's requests land where it is cached
        for i in range(12):
            complete(router, PREFIXES[i % 3] + f"Question {i}?")
        per_replica = [finished(a), finished(b)]
        assert sum(per_replica) == 12, per_replica
        stats = [counters(s) for s in (a, b)]
        queries = sum(s.get("veloxquant_prefix_cache_queries_total", 0) for s in stats)
        hits = sum(s.get("veloxquant_prefix_cache_hits_total", 0) for s in stats)
        assert hits / queries > 0.5, (hits, queries)  # 9 of 12 requests find their prefix

        # a draining replica leaves the router, and the other one takes everything
        a.process.send_signal(signal.SIGTERM)
        until(lambda: set(workers(router)) == {b.base_url}, 30, "a deregistered")
        before = finished(b)
        for i in range(6):
            complete(router, f"After the drain, question {i}?")
        assert finished(b) == before + 6
        assert a.process.wait(30) == 0, a.log()
        assert "deregistered" in a.log()

        # a replica shrunk below one request turns /ready 503: the router's health check takes
        # it out of rotation and every request goes to the other one
        c = start_server(tmp_path, "--register-with", router, "--blas", "off", "--n-blocks",
                         "4000")  # fmt: skip
        started.append(c)
        # a server start, bounded as the first registration (a loaded 2-core machine)
        until(lambda: set(workers(router)) == {b.base_url, c.base_url}, 90, "c registered")
        r = httpx.post(f"{c.base_url}/admin/pool/shrink", headers=auth, timeout=30,
                       json={"stream": "kv", "target_free": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        until(lambda: set(workers(router)) == {b.base_url}, 30, "c out of rotation")
        before = finished(b)
        for i in range(6):
            complete(router, f"After the shrink, question {i}?")
        assert finished(b) == before + 6 and finished(c) == 0
        assert stop_server(c) == 0, c.log()
        b.wait_pool_free()
    finally:
        for server in (a, b, *started):
            if server.process.poll() is None:
                stop_server(server)
