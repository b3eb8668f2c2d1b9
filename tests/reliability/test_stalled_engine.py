"""An engine process that stops (SIGSTOP: swapping, a debugger, a hung driver) is reported
honestly and never freezes the server: sends to it never block the event loop, /metrics keeps
answering with the last figures and their age, /ready turns 503 engine_stalled after
--engine-stall-timeout and /health after four times that; once it runs again, everything
completes and the pool is all free."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.reliability.conftest import MODEL, start_server, stop_server


def _child_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return next(int(c) for c in children if "hosts.child" in Path(f"/proc/{c}/cmdline").read_text())


def test_a_stopped_engine_process_is_reported_and_the_server_keeps_answering(
    tmp_path, default_model_dir
):
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path, "--engine-process", "--n-blocks", "4000", "--engine-stall-timeout", "1",
    )  # fmt: skip
    base = srv.base_url
    child = _child_pid(srv.process.pid)
    results: list[int] = []

    def long_prompt(i: int) -> None:
        body = {"model": MODEL, "prompt": f"prompt {i} " + "word " * 1000, "max_tokens": 4}
        try:
            results.append(httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code)
        except httpx.HTTPError:
            results.append(0)

    os.kill(child, signal.SIGSTOP)
    threads = [threading.Thread(target=long_prompt, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        # The event loop is not blocked by the sends: health answers at once, and so does
        # /metrics, with the last figures and how old they are.
        started = time.monotonic()
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 2
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(f"{base}/ready", timeout=10)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        metrics = httpx.get(f"{base}/metrics", timeout=10)
        assert metrics.status_code == 200
        age = re.search(r"^veloxquant_engine_snapshot_age_seconds (\S+)$", metrics.text, re.M)
        assert age is not None and float(age.group(1)) > 0, metrics.text[:500]
        stalled = re.search(r"^veloxquant_engine_stalled_seconds (\S+)$", metrics.text, re.M)
        assert stalled is not None and float(stalled.group(1)) > 1
        deadline = time.monotonic() + 20
        while httpx.get(f"{base}/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "/health never reported the stall"
            time.sleep(0.2)
        assert httpx.get(f"{base}/health", timeout=10).json()["error"]["code"] == "engine_stalled"
    finally:
        os.kill(child, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert results and all(code in (200, 429, 503) for code in results), results
    assert results.count(200) > 0
    deadline = time.monotonic() + 20
    while httpx.get(f"{base}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "never ready again"
        time.sleep(0.2)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    srv.wait_pool_free()
    assert stop_server(srv) == 0, srv.log()
