"""What a router reads from a replica: ``GET /v1/loads`` in SMG's schema, following the engine
(running, waiting, tokens held, capacity after a shrink), and ``--metrics-compat vllm``'s
aliases in Prometheus text; without the flag, no colon-named metric at all."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ADMIN, wait_idle
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams
from veloxquant_mlx.server.rates import RateWindow

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": f"Bearer {ADMIN}"}
SNAPSHOT_KEYS = {
    "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
    "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
    "max_running_requests", "num_waiting_uncached_tokens",
}  # fmt: skip


def long_request(engine, tag: int = 0, words: int = 40) -> GenerationRequest:
    prompt = engine.tokenizer.encode(f"request {tag}: " + "tell me more " * words)
    return GenerationRequest(tuple(prompt), 400, SamplingParams(temperature=0.0))


async def first_token(handle) -> None:
    async for _ in handle:
        return


async def loads_when(client, check, query: str = "") -> dict:
    """The first load report that passes ``check`` (the engine publishes its snapshot after
    the step whose tokens a client already has, so the report may lag by a step)."""
    snap: dict = {}
    for _ in range(200):
        snap = (await client.get(f"/v1/loads{query}")).json()["loads"][0]
        if check(snap):
            return snap
        await asyncio.sleep(0.01)
    raise AssertionError(f"the loads never passed the check: {snap}")


async def test_loads_follow_the_engine_and_a_shrink(client_for):
    client = await client_for(n_blocks=4096, max_running=2)
    idle = (await client.get("/v1/loads")).json()
    assert idle["dp_rank_count"] == 1 and len(idle["loads"]) == 1
    snap = idle["loads"][0]
    assert set(snap) == SNAPSHOT_KEYS
    assert snap["num_running_reqs"] == snap["num_used_tokens"] == 0
    # 4096 blocks over K and V of 4 layers: 512 token blocks of 16
    assert snap["max_total_num_tokens"] == 4096 // (2 * 4) * 16
    assert snap["max_running_requests"] == 2 and snap["token_usage"] == 0.0

    engine = client.engine
    handles = [engine.submit(long_request(engine, i)) for i in range(3)]  # 2 run, 1 waits
    await asyncio.gather(*(first_token(h) for h in handles[:2]))
    busy = await loads_when(
        client, lambda s: s["num_running_reqs"] == 2, "?include=core,memory,queues"
    )
    assert busy["num_waiting_reqs"] == 1
    assert busy["num_total_reqs"] == 3
    prompt = len(handles[0].request.prompt_tokens)
    assert 2 * prompt <= busy["num_used_tokens"] <= 2 * (prompt + 400 + 16)
    assert 0 < busy["token_usage"] <= 1 and busy["utilization"] == 1.0
    assert busy["num_waiting_uncached_tokens"] > 0
    assert busy["memory"]["token_capacity"] == busy["max_total_num_tokens"]
    assert busy["queues"]["waiting"] == 1

    r = await client.post("/admin/pool/shrink", json={"stream": "kv", "target_free": 64},
                          headers=AUTH)  # fmt: skip
    assert r.status_code == 200, r.text
    shrunk = (await client.get("/v1/loads")).json()["loads"][0]
    assert shrunk["max_total_num_tokens"] < snap["max_total_num_tokens"]
    assert shrunk["token_usage"] > busy["token_usage"]
    for h in handles:
        engine.cancel(h)
    await wait_idle(engine)
    after = (await client.get("/v1/loads")).json()["loads"][0]
    assert after["num_running_reqs"] == after["num_used_tokens"] == 0


async def test_a_pool_shrunk_below_one_request_is_not_ready(client_for):
    """/ready is what routers health-check: a replica that can no longer hold its smallest
    request (a one-token prompt and one block of completion) answers 503, so the router
    sends its traffic elsewhere; a smaller shrink leaves it ready."""
    client = await client_for(n_blocks=4096)
    assert (await client.get("/ready")).status_code == 200
    r = await client.post("/admin/pool/shrink", json={"stream": "kv", "target_free": 64},
                          headers=AUTH)  # fmt: skip
    assert r.status_code == 200
    assert (await client.get("/ready")).status_code == 200  # 64 per stream: 16 token blocks
    r = await client.post("/admin/pool/shrink", json={"stream": "kv", "target_free": 4},
                          headers=AUTH)  # fmt: skip
    assert r.status_code == 200
    r = await client.get("/ready")
    assert r.status_code == 503 and r.headers["retry-after"] == "30"
    assert r.json()["error"]["code"] == "capacity_reduced"
    assert (await client.get("/health")).status_code == 200  # alive: nothing to restart


def test_the_rate_window_is_tokens_per_second_over_its_window():
    rate = RateWindow(window=10.0)
    assert rate.update(0, now=100.0) == 0.0
    assert rate.update(500, now=105.0) == pytest.approx(100.0)
    assert rate.update(1500, now=110.0) == pytest.approx(150.0)
    # samples older than the window drop out: 1500 -> 3500 over 111 -> 121 is 200 tok/s
    rate.update(1500, now=111.0)
    assert rate.update(3500, now=121.0) == pytest.approx(200.0, rel=0.05)


async def test_vllm_aliases_only_with_the_flag(client_for):
    plain = await client_for()
    names = {f.name for f in text_string_to_metric_families((await plain.get("/metrics")).text)}
    assert not any(":" in n for n in names)

    compat = await client_for(metrics_compat="vllm", n_blocks=4096)
    engine = compat.engine
    handle = engine.submit(long_request(engine))
    await first_token(handle)
    await loads_when(compat, lambda s: s["num_running_reqs"] == 1)
    text = (await compat.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["vllm:num_requests_running"].samples[0]
    assert running.value == 1 and running.labels == {"model_name": "veloxquant-tiny-llama"}
    assert families["vllm:num_requests_waiting"].samples[0].value == 0
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0 < usage < 1
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info == {"block_size": "16", "num_gpu_blocks": "512", "enable_prefix_caching": "True"}
    assert "vllm:prefix_cache_queries" in families and "vllm:prefix_cache_hits" in families
    engine.cancel(handle)
    await wait_idle(engine)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--register-with", "router:30000"], "must be an http(s) URL"),
        (["--register-with", "http://r:1", "--host", "0.0.0.0"], "needs --advertise-url"),
        (["--register-with", "http://r:1", "--port", "0"], "needs --advertise-url"),
        (["--advertise-url", "me:8000"], "must be an http(s) URL"),
    ],
)
def test_a_registration_the_router_could_not_use_stops_at_start(argv, message):
    from veloxquant_mlx.config.settings import SettingsError, load_settings

    with pytest.raises(SettingsError) as exc:
        load_settings(argv)
    assert message in str(exc.value.code)
    ok = load_settings(["--register-with", "http://r:1", "--port", "0", "--advertise-url",
                        "http://me:8000"])  # fmt: skip
    assert ok.register_with == "http://r:1" and ok.advertise_url == "http://me:8000"
