"""Two replicas behind a real SMG router (PyPI ``smg``), all on loopback: they join it by
themselves (``--register-with``), the router health-checks ``/ready`` and reads ``/v1/loads``
(a shrink shows in its view), requests sharing a prefix go to the replica that has it cached,
and a draining replica leaves the router and gets no more traffic. Pools all free at the end."""

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
    try:
        seen = until(lambda: len(workers(router)) == 2 and workers(router), 30, "2 workers")
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
        b.wait_pool_free()
    finally:
        for server in (a, b):
            if server.process.poll() is None:
                stop_server(server)


def test_a_shrunk_replica_gets_less_of_the_traffic(tmp_path, default_model_dir):
    """Round robin alone splits this load 24/24 (checked first, same run). After a shrink that
    leaves replica b room for about one request, its queue and KV usage show in /v1/loads, the
    router's overload protection leaves it out while a is under its thresholds, and b serves
    clearly fewer (17-18 of 48 in runs here)."""
    import asyncio

    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    with smg_router("round_robin", tmp_path / "smg-rr.log",
                    "--worker-overload-waiting-requests", "1") as rr:  # fmt: skip
        a = start_server(tmp_path, "--register-with", rr, "--blas", "off", "--n-blocks", "4000")
        b = start_server(tmp_path, "--register-with", rr, "--blas", "off", "--n-blocks", "4000")
        try:
            until(lambda: len(workers(rr)) == 2, 30, "2 workers")

            async def load() -> list[int]:
                gate = asyncio.Semaphore(8)
                async with httpx.AsyncClient(timeout=120) as client:

                    async def one(i: int) -> int:
                        body = {"model": MODEL, "prompt": f"request {i} " + "word " * 20,
                                "max_tokens": 64, "temperature": 0}  # fmt: skip
                        async with gate:
                            r = await client.post(f"{rr}/v1/completions", json=body)
                            return r.status_code

                    return await asyncio.gather(*(one(i) for i in range(48)))

            assert set(asyncio.run(load())) == {200}
            assert finished(a) == finished(b) == 24  # round robin, nobody overloaded
            shrink = {"stream": "kv", "target_free": 24}
            auth = {"Authorization": f"Bearer {ADMIN}"}
            r = httpx.post(f"{b.base_url}/admin/pool/shrink", json=shrink, headers=auth, timeout=30)
            assert r.status_code == 200, r.text
            time.sleep(2.5)  # the router's next load polls see b's capacity
            assert set(asyncio.run(load())) == {200}
            served_a, served_b = finished(a) - 24, finished(b) - 24
            assert served_a + served_b == 48
            assert served_b <= 21 < served_a, (served_a, served_b)
            a.wait_pool_free()
            b.wait_pool_free()
        finally:
            for server in (a, b):
                if server.process.poll() is None:
                    stop_server(server)
