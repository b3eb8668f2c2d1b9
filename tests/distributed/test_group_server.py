"""``veloxquant-serve`` as a group of two ranks on the ring backend over loopback: rank 0 serves
HTTP and answers exactly as one process does (openai client), cancel, shrink and drain reach
every rank, the group shows in /metrics, /v1/loads and /admin/pool, and a rank that dies or
stops takes the group down (rank 0 exits 1) instead of leaving anyone waiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import ADMIN, free_port, start_server, stop_server
from tests.reliability.conftest import sse_events
from tests.support.group import kill_all, start_ranks

AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPTS = ["Hello there", "Tell me a story about a cat", "1 2 3 4 5 6"]


class Group:
    def __init__(self, procs: list[tuple[subprocess.Popen, Path]], base_url: str) -> None:
        self.procs = procs
        self.base_url = base_url

    @property
    def leader(self) -> subprocess.Popen:
        return self.procs[0][0]

    @property
    def follower(self) -> subprocess.Popen:
        return self.procs[1][0]

    def logs(self) -> list[str]:
        return [log.read_text() for _, log in self.procs]

    def ranks(self) -> list[dict]:
        r = httpx.get(f"{self.base_url}/admin/pool", headers=AUTH, timeout=30)
        r.raise_for_status()
        return r.json()["group"]["ranks"]

    def wait_all_free(self, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        ranks: list[dict] = []
        while time.monotonic() < deadline:
            httpx.post(f"{self.base_url}/admin/prefix-cache/reset", headers=AUTH, timeout=30)
            ranks = self.ranks()
            if all(r["in_use"] == 0 and r["owners"] == 0 and r["free"] == r["blocks"]
                   for r in ranks):  # fmt: skip
                return ranks
            time.sleep(0.1)
        raise AssertionError(f"not all free: {ranks}")


def start_group(tmp_path: Path, model_cache: str, *args: str) -> Group:
    port = free_port()
    cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--model-cache-dir", model_cache,
           "--admin-key", ADMIN, "--blas", "off", *args]  # fmt: skip
    procs = start_ranks(cmd, tmp_path, extra={0: ["--port", str(port)]})
    group = Group(procs, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for proc, _ in procs:
            if proc.poll() is not None:
                kill_all(procs)
                raise AssertionError(f"a rank exited {proc.returncode}: {group.logs()}")
        try:
            if httpx.get(f"{group.base_url}/ready", timeout=2).status_code == 200:
                return group
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    kill_all(procs)
    raise AssertionError(f"group not ready: {group.logs()}")


def answers(base_url: str, model: str) -> list[tuple[str, list[float]]]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0,
            logprobs=True,
        )
        content = r.choices[0].message.content or ""
        logprobs = [t.logprob for t in r.choices[0].logprobs.content]  # type: ignore[union-attr]
        out.append((content, logprobs))
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12,
        temperature=0, stream=True,
    )  # fmt: skip
    out.append(("".join(c.choices[0].delta.content or "" for c in stream if c.choices), []))
    return out


def assert_same_answers(one: list, two: list) -> None:
    for (text1, lp1), (text2, lp2) in zip(one, two, strict=True):
        assert text2 == text1
        assert lp2 == pytest.approx(lp1, abs=2e-3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_cache) -> list:
    """The single-process server's answers on the default model."""
    srv = start_server(tmp_path_factory.mktemp("single"), "--blas", "off")
    try:
        return answers(srv.base_url, "veloxquant-tiny-llama")
    finally:
        assert stop_server(srv) == 0


@pytest.fixture
def group(tmp_path, model_cache) -> Iterator[Group]:
    g = start_group(tmp_path, model_cache, "--group-timeout", "20")
    yield g
    kill_all(g.procs)


def test_a_tensor_parallel_group_serves_like_one_process(group, reference):
    assert_same_answers(reference, answers(group.base_url, "veloxquant-tiny-llama"))
    metrics = httpx.get(f"{group.base_url}/metrics", timeout=10).text
    assert 'parallel="tensor"' in metrics and 'world_size="2"' in metrics
    loads = httpx.get(f"{group.base_url}/v1/loads", timeout=10).json()
    assert (loads["world_size"], loads["parallel"], loads["dp_rank_count"]) == (2, "tensor", 1)
    ranks = group.wait_all_free()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["blocks"] == ranks[1]["blocks"]


def test_cancel_shrink_and_drain_reach_every_rank(group):
    body = {"model": "veloxquant-tiny-llama", "prompt": "a b c", "max_tokens": 3000,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{group.base_url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break  # the client goes away mid-stream: the request is cancelled everywhere
    group.wait_all_free()
    before = group.ranks()[0]["blocks"]
    r = httpx.post(f"{group.base_url}/admin/pool/shrink", headers=AUTH, timeout=30,
                   json={"stream": "kv", "target_free": 1000})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["retired"] > 0
    ranks = group.ranks()
    assert ranks[0]["blocks"] == ranks[1]["blocks"] < before
    # whole token blocks (2 streams x 4 layers... one stream here: 4 layers) on every rank
    assert ranks[0]["free"] % 4 == 0
    r = httpx.post(f"{group.base_url}/v1/completions", timeout=60,
                   json={**body, "stream": False, "max_tokens": 5})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    group.wait_all_free()
    group.leader.send_signal(signal.SIGTERM)  # drain: rank 0 stops the group
    assert group.leader.wait(60) == 0, group.logs()[0]
    assert group.follower.wait(60) == 0, group.logs()[1]
    assert "rank 0 drained; pool all free" in group.logs()[1]


def test_a_pipeline_group_serves_like_one_process(tmp_path, model_cache, qwen2_dir):
    srv = start_server(tmp_path, "--blas", "off", "--model", str(qwen2_dir))
    try:
        one = answers(srv.base_url, "tiny-qwen2")
    finally:
        assert stop_server(srv) == 0
    g = start_group(tmp_path, model_cache, "--model", str(qwen2_dir), "--pipeline")
    try:
        assert_same_answers(one, answers(g.base_url, "tiny-qwen2"))
        ranks = g.wait_all_free()
        assert ranks[0]["blocks"] == 2 * ranks[1]["blocks"]  # 2 layers on rank 0, 1 on rank 1
        g.leader.send_signal(signal.SIGTERM)
        assert g.leader.wait(60) == 0 and g.follower.wait(60) == 0, g.logs()
    finally:
        kill_all(g.procs)


def _stream_in_background(base_url: str, results: list, started: threading.Event) -> None:
    body = {"model": "veloxquant-tiny-llama", "prompt": "x y", "max_tokens": 1900,
            "temperature": 0, "stream": True}  # fmt: skip
    lines = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            lines.append(line)
            started.set()
    results.append("\n".join(lines))


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_follower_that_dies_or_stops_takes_the_group_down(tmp_path, model_cache, fault):
    """SIGKILL: the next collective fails at once. SIGSTOP: nothing fails, nothing answers;
    the watchdog gives up after --group-timeout. Either way the stream ends with its error
    and rank 0 exits 1 (for its supervisor to restart the group)."""
    g = start_group(tmp_path, model_cache, "--group-timeout", "4")
    try:
        results: list[str] = []
        started = threading.Event()
        t = threading.Thread(target=_stream_in_background, args=(g.base_url, results, started))
        t.start()
        assert started.wait(60)
        os.kill(g.follower.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t.join(60)
        assert not t.is_alive()
        assert g.leader.wait(60) == 1, g.logs()[0]
        events = sse_events(results[0])
        assert events[-1] == "[DONE]", results[0][-2000:]
        assert events[-2]["error"]["code"] == "engine_error", results[0][-2000:]
        if fault == "stop":
            assert "the group is dead" in g.logs()[0]
    finally:
        kill_all(g.procs)


def test_an_idle_group_notices_a_dead_follower(tmp_path, model_cache):
    g = start_group(tmp_path, model_cache)
    try:
        os.kill(g.follower.pid, signal.SIGKILL)
        assert g.leader.wait(30) == 1, g.logs()[0]  # the heartbeat's collective failed
    finally:
        kill_all(g.procs)


def test_followers_exit_when_rank_0_dies(tmp_path, model_cache):
    g = start_group(tmp_path, model_cache)
    try:
        os.kill(g.leader.pid, signal.SIGKILL)
        assert g.follower.wait(30) == 1, g.logs()[1]
        assert "lost the group" in g.logs()[1]
    finally:
        kill_all(g.procs)
