"""The official openai client against a real server process on loopback."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ADMIN, MODEL, start_server, stop_server

pytestmark = pytest.mark.usefixtures("pool_free_after")


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_completion(oai):
    r = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 0
    assert r.usage.model_extra["peak_kv_blocks"] > 0


def test_chat_completion(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=6, seed=3
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6


def test_streaming_completion_matches_non_streaming(oai):
    plain = oai.completions.create(model=MODEL, prompt="tell me", max_tokens=12, temperature=0)
    stream = oai.completions.create(
        model=MODEL,
        prompt="tell me",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_invalid_bytes_stream_as_they_are_made_not_at_the_end(oai, default_model):
    from veloxquant_mlx.engine.request.detokenize import gpt2_byte_decoder

    # mlx_lm.server would send nothing until the end: its detokenizer holds text ending in
    # U+FFFD. A logit bias makes the model emit the lone byte 0x80 every step.
    byte_0x80 = next(c for c, b in gpt2_byte_decoder().items() if b == 0x80)
    token = default_model[1].vocab[byte_0x80]
    stream = oai.completions.create(
        model=MODEL, prompt="hello", max_tokens=200, temperature=0, stream=True,
        logit_bias={str(token): 100},
    )  # fmt: skip
    arrivals = [(time.monotonic(), c.choices[0].text) for c in stream if c.choices]
    texts = [t for _, t in arrivals if t]
    assert texts == ["\ufffd"] * 200
    first_text = next(at for at, t in arrivals if t)
    assert first_text < arrivals[-1][0]  # the first came before the finish, not with it


def test_streaming_chat(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=8,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_errors_surface_as_the_right_exception_types(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, n=9)  # over --max-n


def test_concurrent_requests(oai):
    def one(i):
        return oai.completions.create(
            model=MODEL, prompt=f"request {i}", max_tokens=16, temperature=0
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    for r in results:  # greedy: EOS is possible in principle, then finish_reason says so
        done = r.choices[0].finish_reason
        assert (done == "length" and r.usage.completion_tokens == 16) or done == "stop"


def test_disconnect_mid_stream_frees_blocks(server, oai):
    stream = oai.completions.create(
        model=MODEL, prompt="go on", max_tokens=1500, stream=True, temperature=0
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert server.admin()["stats"]["blocks_in_use"] > 0
    request_id = stream.response.headers["x-request-id"]
    stream.close()  # the client hangs up
    server.wait_pool_free(timeout=10)
    # its access line counts what it used until then, and says the client went away
    line = ""
    for _ in range(100):
        line = next((x for x in server.log().splitlines() if f"id={request_id} " in x), "")
        if line:
            break
        time.sleep(0.05)
    fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
    assert fields["finish"] == "cancelled", line
    assert int(fields["prompt"]) > 0 and int(fields["completion"]) >= 6, line


def test_non_streaming_client_timeout_frees_blocks(server):
    short = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        short.completions.create(model=MODEL, prompt="long one", max_tokens=1800, temperature=0)
    server.wait_pool_free(timeout=10)


def test_metrics_parse_and_gauges_return_to_zero(server, oai):
    oai.completions.create(model=MODEL, prompt="metrics", max_tokens=4)
    server.wait_pool_free()
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "veloxquant_requests_running",
        "veloxquant_requests_waiting",
        "veloxquant_kv_cache_used_bytes",
        "veloxquant_block_pool_blocks_in_use",
    ):
        assert fams[name].samples[0].value == 0, name
    assert fams["veloxquant_request_duration_seconds"].type == "histogram"


def test_a_resent_answer_hits_the_cache_through_its_generated_tokens(oai, server):
    """An agent's next turn resends the answer as text; the server encodes it with the tokens
    it generated, so the cached pages match through the answer (re-encoding a random-weight
    model's answer gives other tokens: without this the hit stops where the answer starts)."""
    messages = [
        {"role": "system", "content": "You answer tersely. " * 20},
        {"role": "user", "content": "Write something long about resent answers."},
    ]
    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    first = chunks[-1].usage
    assert first.completion_tokens == 40 and answer
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And now something else."},
    ]
    second = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0
    ).usage
    cached = second.prompt_tokens_details.cached_tokens
    # the KV of the prompt and of the answer's tokens but the last (never fed back), in pages
    assert cached == (first.prompt_tokens + first.completion_tokens - 1) // 16 * 16
    assert second.prompt_tokens > first.prompt_tokens + first.completion_tokens
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    resent = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "veloxquant_resent_answers_total"
    ]
    assert resent and resent[0] >= 1


def test_admin_shrink_with_and_without_key(server):
    url = f"{server.base_url}/admin/pool/shrink"
    body = {"stream": "kv", "target_free": 2900}
    assert httpx.post(url, json=body, timeout=10).status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200 and r.json()["retired"] == 200


def test_shrink_under_load_never_touches_running_requests(server, oai):
    errors: list[BaseException] = []
    finished: list[str] = []

    def load():
        for i in range(4):
            try:
                r = oai.completions.create(model=MODEL, prompt=f"load {i}", max_tokens=60)
                finished.append(r.choices[0].finish_reason)
            except openai.InternalServerError as exc:  # the shrunk pool cannot hold it
                if exc.status_code != 503 or exc.code != "capacity_reduced":
                    errors.append(exc)
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    for target in (2000, 1000, 0):
        time.sleep(0.2)
        r = httpx.post(
            f"{server.base_url}/admin/pool/shrink",
            json={"stream": "kv", "target_free": target},
            headers=auth,
            timeout=30,
        )
        assert r.status_code == 200
    for t in threads:
        t.join(120)
    assert errors == []
    # Every request completed, or was answered 503 capacity_reduced because the shrunk pool
    # could not hold it; the ones that ran past a full pool were preempted and recomputed.
    assert finished and set(finished) <= {"length", "stop"}


def test_sigterm_drains_and_exits_zero(tmp_path, default_model_dir):
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(tmp_path, "--n-blocks", "2000", "--drain-timeout", "20")
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
    result: dict = {}

    def slow():
        result["r"] = client.completions.create(
            model=MODEL, prompt="drain me", max_tokens=300, temperature=0
        )

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    assert stop_server(srv) == 0, srv.log()
    t.join(30)
    assert result["r"].choices[0].finish_reason == "length"  # finished, not cut off
    assert "draining" in srv.log()


def test_invalid_settings_fail_at_start_with_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.server", "--port", "70000", "--max-running", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "port" in lines[0] and "max_running" in lines[0]
    r = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.server", "--gil-switch-interval-ms", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "gil_switch_interval_ms" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not a local model directory" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.server", "--max-queue", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "max_queue" in r.stderr


def test_a_pool_that_cannot_serve_stops_the_server_at_start(tmp_path, default_model_dir):
    """--n-blocks 8 used to start and then answer 400 to everything."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.server", "--n-blocks", "8", "--port", "0",
         "--model-cache-dir", str(default_model_dir.parent), "--admin-key", ADMIN],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("veloxquant-serve: cannot start: the KV pool (8 blocks")
    assert "--kv-cache-mb" in last and "Traceback" not in r.stderr


@pytest.mark.parametrize("damage", ["truncated weights", "a config value of the wrong type"])
def test_a_model_that_cannot_load_stops_with_one_line(tmp_path, default_model_dir, damage):
    """A truncated safetensors file or ``hidden_size: "abc"``: exit 3 with one line, no
    traceback (it used to log 20-30 lines of one first)."""
    import json
    import shutil
    import subprocess
    import sys

    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    if damage == "truncated weights":
        weights = next(model.glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    r = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.server", "--model", str(model), "--port", "0",
         "--admin-key", ADMIN],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("veloxquant-serve: cannot start: ")
