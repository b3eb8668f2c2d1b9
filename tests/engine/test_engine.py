"""The engine on real MLX: batching, admission, cancellation, sampling, failure, shutdown."""

from __future__ import annotations

import json
import logging
import random
import threading
import time

import mlx.core as mx
import pytest

from tests.engine.conftest import wait_idle
from veloxquant_mlx.engine.hosts import base as engine_module
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.engine.types import (
    CAPACITY_REDUCED,
    DRAINING,
    ENGINE_FAILED,
    REQUEST_FAILED,
    CapacityReducedError,
    EngineNotReadyError,
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    SamplingParams,
    TokenEvent,
)

GREEDY = SamplingParams(temperature=0.0)


def prompts(engine: Engine, n: int) -> list[list[int]]:
    words = ["hello world", "tell me a story", "what is the answer", "write python code"]
    return [
        engine.tokenizer.encode(f"{words[i % 4]} number {i}" + " and more" * (i % 5))
        for i in range(n)
    ]


def request(tokens, max_tokens=24, sampling=GREEDY, **kw) -> GenerationRequest:
    return GenerationRequest(tuple(tokens), max_tokens, sampling, **kw)


def token_ids(handle) -> list[int]:
    tokens, finish = handle.collect(60)
    assert isinstance(finish, FinishEvent)
    return [t.token_id for t in tokens]


def test_concurrent_greedy_requests_match_mlx_lm_batch_generate(engine, default_model):
    from mlx_lm import batch_generate

    model, tokenizer = default_model
    model.set_dtype(mx.float32)  # the engine runs float32 on a CPU ("auto")
    ps = prompts(engine, 6)
    handles = [engine.submit(request(p, max_tokens=20 + i)) for i, p in enumerate(ps)]
    ours = [token_ids(h) for h in handles]
    stock = batch_generate(
        model, tokenizer, ps, max_tokens=[20 + i for i in range(6)], return_token_ids=True
    ).token_ids
    assert ours == stock
    assert all(h.finish.finish_reason == "length" for h in handles)
    usage = handles[0].finish.usage
    assert usage.prompt_tokens == len(ps[0]) and usage.completion_tokens == 20
    assert usage.peak_kv_blocks > 0
    assert usage.peak_kv_bytes == usage.peak_kv_blocks * engine.kv_bytes_per_block


def test_a_request_alone_and_in_a_batch_agree_greedily(engine):
    ps = prompts(engine, 8)
    alone = token_ids(engine.submit(request(ps[3], max_tokens=30)))
    batch = [engine.submit(request(p, max_tokens=30)) for p in ps]
    assert token_ids(batch[3]) == alone
    for h in batch[:3] + batch[4:]:
        h.collect(60)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_8(engine):
    ps = prompts(engine, 8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = token_ids(engine.submit(request(ps[0], 30, seeded)))
    again = token_ids(engine.submit(request(ps[0], 30, seeded)))
    assert alone == again
    batch = [engine.submit(request(ps[0], 30, seeded))]
    batch += [
        engine.submit(request(p, 30, SamplingParams(temperature=1.0, seed=i)))
        for i, p in enumerate(ps[1:])
    ]
    assert token_ids(batch[0]) == alone
    for h in batch[1:]:
        h.collect(60)
    other_seed = token_ids(engine.submit(request(ps[0], 30, SamplingParams(0.9, 0.95, 50, seed=7))))
    assert other_seed != alone


def test_stop_strings_are_matched_across_tokens_and_never_emitted(engine):
    p = prompts(engine, 1)[0]
    full = engine.submit(request(p, max_tokens=40)).text(60)
    assert len(full) > 12
    stop = full[5:9]  # spans token boundaries in general
    handle = engine.submit(request(p, max_tokens=40, stop=(stop,)))
    text = handle.text(60)
    assert text == full[: full.index(stop)]
    assert handle.finish.finish_reason == "stop"
    never = engine.submit(request(p, max_tokens=40, stop=("\x00never\x00",)))
    assert never.text(60) == full and never.finish.finish_reason == "length"


def test_logprobs_are_reported_when_asked(engine):
    p = prompts(engine, 1)[0]
    tokens, _ = engine.submit(request(p, 5, logprobs=True, top_logprobs=3)).collect(60)
    for t in tokens:
        assert t.logprob is not None and t.logprob <= 0.0
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0][0] == t.token_id  # greedy: the sampled token is the top one
        assert [lp for _, lp in t.top_logprobs] == sorted(
            (lp for _, lp in t.top_logprobs), reverse=True
        )
    tokens, _ = engine.submit(request(p, 3)).collect(60)
    assert all(t.logprob is None for t in tokens)


def test_too_large_requests_are_rejected_before_any_allocation(make_engine):
    # 200 blocks per stream, 4 layers: 50 blocks (800 tokens) per layer for one request alone
    engine = make_engine(n_blocks=400)
    with pytest.raises(RequestTooLargeError, match="maximum context length is"):
        engine.submit(request([1] * 8200, max_tokens=100))
    with pytest.raises(RequestTooLargeError, match="whole pool"):
        engine.submit(request([1] * 900, max_tokens=10))
    assert engine.pool.stats.n_allocations == 0
    assert engine.stats().rejections_total == {"too_large": 2}


def test_a_pool_sized_for_n_requests_runs_n_at_once(make_engine):
    # 16 requests of 10 + 118 = 128 tokens: 8 blocks per layer and stream each, 4 layers, so
    # 16 x 4 x 8 = 512 blocks per stream hold all of them, with nothing padded or reserved.
    engine = make_engine(n_blocks=2 * 512, max_running=32, stream_interval=0.0)
    ps = prompts(engine, 16)
    handles = [engine.submit(request(p[:10], max_tokens=118)) for p in ps]
    most = 0
    while not all(h.done for h in handles):
        most = max(most, engine.stats().running)
        engine.pool.check_invariants()
        time.sleep(0.002)
    assert all(h.finish.finish_reason == "length" for h in handles)
    assert most == 16
    assert engine.stats().preemptions_total == 0 and engine.pool.stats.n_exhausted == 0
    # what each held: 2 streams x 4 layers x ceil(128 / 16) blocks, and no more
    assert {h.finish.usage.peak_kv_blocks for h in handles} == {2 * 4 * 8}


def test_a_full_pool_preempts_the_newest_and_recomputes_it(make_engine):
    # Room for 2 x 4 layers x 4 blocks (64 tokens) per stream: three requests that each grow
    # to 10 + 50 = 60 tokens cannot all run, so the newest is preempted and recomputed later;
    # its greedy tokens are the same as alone, and FIFO holds for first tokens.
    engine = make_engine(n_blocks=2 * 32, max_queue=8, stream_interval=0.0)
    ps = prompts(engine, 3)
    alone = [engine.submit(request(p[:10], max_tokens=50)).collect(60)[0] for p in ps]
    handles = [engine.submit(request(p[:10], max_tokens=50)) for p in ps]
    results = [h.collect(120) for h in handles]
    assert all(f.finish_reason == "length" for _, f in results)
    assert [[t.token_id for t in tokens] for tokens, _ in results] == [
        [t.token_id for t in tokens] for tokens in alone
    ]
    assert engine.stats().preemptions_total >= 1
    starts = [tokens[0].time for tokens, _ in results]
    assert starts == sorted(starts)


def test_a_request_that_outgrows_the_whole_pool_ends_with_length(make_engine):
    engine = make_engine(n_blocks=2 * 16)  # 4 blocks (64 tokens) per layer for one request
    tokens, finish = engine.submit(request([5, 6, 7], max_tokens=200)).collect(60)
    assert finish.finish_reason == "length" and finish.error is None
    assert len(tokens) == 64 - 3


def test_the_queue_is_bounded(make_engine):
    engine = make_engine(n_blocks=2 * 160, max_queue=3, max_running=1)
    ps = prompts(engine, 8)
    handles, rejected, messages = [], 0, []
    for p in ps:
        try:
            handles.append(engine.submit(request(p[:10], max_tokens=30)))
        except QueueFullError as exc:
            rejected += 1
            messages.append(str(exc))
    assert rejected >= 1 and engine.stats().rejections_total.get("queue_full") == rejected
    # the message counts what the bound counts: never more waiting than --max-queue
    assert all(int(m.split()[0]) <= 3 and "sequences waiting" in m for m in messages), messages
    assert all(h.collect(60)[1].finish_reason == "length" for h in handles)


def test_a_request_taken_by_the_engine_still_counts_against_the_queue(make_engine):
    """The engine holds the second request taken from its inbox but not yet published as
    queued (its turn stopped there): a third is still refused (it was let past the bound)."""
    gate, inside, box = threading.Event(), threading.Event(), {}

    def hook() -> None:  # engine thread, after a turn's requests are applied
        engine = box.get("engine")
        if engine is not None and box.get("second") in engine._core._live and not gate.is_set():
            inside.set()
            gate.wait(30)

    engine = make_engine(n_blocks=2 * 160, max_queue=1, max_running=1, step_hook=hook)
    box["engine"] = engine
    ps = prompts(engine, 3)
    first = engine.submit(request(ps[0], max_tokens=400))
    next(e for e in first.events(30) if isinstance(e, TokenEvent))
    box["second"] = engine._next_request_id + 1
    second = engine.submit(request(ps[1], max_tokens=5))
    assert inside.wait(30)
    try:
        assert engine.stats().waiting == 1
        with pytest.raises(QueueFullError):
            engine.submit(request(ps[2], max_tokens=5))
    finally:
        gate.set()
    engine.cancel(first)
    assert first.collect(60)[1].finish_reason == "cancelled"
    assert second.collect(60)[1].finish_reason == "length"


def test_a_cancelled_queued_request_leaves_the_queue_at_once(make_engine):
    """Once the engine has applied a queued request's cancel (its turn stopped right after),
    the place it held is free to the next submit."""
    gate, inside, box = threading.Event(), threading.Event(), {}

    def hook() -> None:  # engine thread, after a turn's requests and cancels are applied
        second = box.get("second")
        if second is not None and second.done and not gate.is_set():
            inside.set()
            gate.wait(30)

    engine = make_engine(n_blocks=2 * 160, max_queue=1, max_running=1, step_hook=hook)
    ps = prompts(engine, 3)
    first = engine.submit(request(ps[0], max_tokens=400))
    next(e for e in first.events(30) if isinstance(e, TokenEvent))
    second = engine.submit(request(ps[1], max_tokens=5))
    while engine.stats().waiting != 1:
        time.sleep(0.001)
    box["second"] = second
    engine.cancel(second)
    assert inside.wait(30)
    try:
        third = engine.submit(request(ps[2], max_tokens=5))
    finally:
        gate.set()
    engine.cancel(first)
    assert second.collect(60)[1].finish_reason == "cancelled"
    assert first.collect(60)[1].finish_reason == "cancelled"
    assert third.collect(60)[1].finish_reason == "length"


def test_cancel_frees_blocks_whether_queued_prefilling_or_decoding(make_engine):
    engine = make_engine(n_blocks=2 * 600, prefill_step=16, max_running=2)
    ps = prompts(engine, 3)
    long_prompt = ps[0] * 40  # several prefill chunks
    decoding = engine.submit(request(ps[1], max_tokens=700 - len(ps[1])))
    next(e for e in decoding.events(30) if isinstance(e, TokenEvent))
    prefilling = engine.submit(request(long_prompt[:200], max_tokens=20))
    queued = engine.submit(request(ps[2], max_tokens=20))
    deadline = time.monotonic() + 10
    while engine.stats().running < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.stats().waiting == 1 and engine.stats().running == 2
    for h in (queued, prefilling, decoding):
        engine.cancel(h)
    for h in (queued, prefilling, decoding):
        _, finish = h.collect(30)
        assert finish.finish_reason == "cancelled"
        assert engine.pool.n_blocks_for(h.request_id) == 0
    wait_idle(engine)


def test_random_cancels_under_load_leak_nothing(make_engine):
    engine = make_engine(n_blocks=2 * 400, max_queue=64)
    rng = random.Random(5)
    handles = [
        engine.submit(request(p[: rng.randint(3, 12)], max_tokens=rng.randint(5, 60)))
        for p in prompts(engine, 24)
    ]
    for h in rng.sample(handles, 10):
        time.sleep(rng.random() * 0.02)
        engine.cancel(h)
    reasons = {h.collect(60)[1].finish_reason for h in handles}
    assert reasons <= {"cancelled", "length", "stop"} and "cancelled" in reasons
    wait_idle(engine)
    engine.pool.check_invariants()


def test_shrink_never_takes_blocks_in_use(make_engine):
    engine = make_engine(n_blocks=2 * 400)
    p = prompts(engine, 1)[0]
    h = engine.submit(request(p, max_tokens=200))
    next(e for e in h.events(30) if isinstance(e, TokenEvent))
    retired = engine.shrink("kv", 0)
    stats = engine.pool.stats
    assert retired > 0 and stats.n_retired == retired
    assert stats.blocks_in_use() > 0 and stats.n_blocks == stats.blocks_in_use()
    # It needs more blocks than the shrunk pool has and nobody can be preempted for it: the
    # operator took the memory, so it ends 503-style (capacity_reduced), its blocks freed.
    _, finish = h.collect(60)
    assert (finish.finish_reason, finish.error_code) == ("error", CAPACITY_REDUCED)
    with pytest.raises(ValueError):
        engine.shrink("x", 0)


def test_engine_death_fails_every_request_cleanly(make_engine):
    calls = {"n": 0}

    def fault():
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected fault")

    engine = make_engine(n_blocks=2 * 400, step_hook=fault, max_running=2)
    handles = [engine.submit(request(p, max_tokens=50)) for p in prompts(engine, 4)]
    for h in handles:
        _, finish = h.collect(30)
        assert finish.finish_reason == "error" and finish.error_code == ENGINE_FAILED
        assert "RuntimeError" in finish.error and "injected" not in finish.error  # no details
    deadline = time.monotonic() + 10
    while engine.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.alive and not engine.ready
    with pytest.raises(EngineNotReadyError):
        engine.submit(request([1, 2, 3]))
    assert engine.pool.stats.blocks_in_use() == 0


def test_an_engine_out_of_device_memory_says_which_settings_bound_it(make_engine, caplog):
    """MLX's allocation failure kills the step (it is no request's own): the log says so with
    MLX's figures and the settings that bound the memory. (Raised where a step would raise
    it: a real one needs a device this machine has not.)"""
    calls = {"n": 0}

    def fault():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    caplog.set_level(logging.ERROR, logger="veloxquant.engine")
    engine = make_engine(n_blocks=2 * 400, step_hook=fault, max_running=2)
    handles = [engine.submit(request(p, max_tokens=50)) for p in prompts(engine, 2)]
    for h in handles:
        _, finish = h.collect(30)
        assert finish.error_code == ENGINE_FAILED and "memory" not in finish.error
    lines = [r.getMessage() for r in caplog.records if r.name == "veloxquant.engine"]
    advice = [line for line in lines if line.startswith("the device ran out of memory")]
    assert len(advice) == 1 and "--mlx-cache-limit-mb" in advice[0] and "MiB alive" in advice[0]
    assert engine.pool.stats.blocks_in_use() == 0


def test_shutdown_drains_running_and_fails_waiting_with_draining(make_engine):
    engine = make_engine(n_blocks=2 * 160)
    ps = prompts(engine, 4)
    handles = [engine.submit(request(p[:8], max_tokens=20)) for p in ps]
    time.sleep(0.02)
    engine.shutdown(drain_timeout=30)
    finishes = [h.collect(5)[1] for h in handles]
    assert finishes[0].finish_reason == "length"
    for f in finishes[1:]:
        assert f.finish_reason == "length" or (
            f.finish_reason == "error" and f.error_code == DRAINING
        )
    assert not engine.alive
    with pytest.raises(EngineNotReadyError):
        engine.submit(request(ps[0]))


def test_stats_are_a_frozen_snapshot(engine):
    before = engine.stats()
    engine.submit(request(prompts(engine, 1)[0], max_tokens=4)).collect(30)
    after = engine.stats()
    assert after.generated_tokens_total == before.generated_tokens_total + 4
    assert (
        after.requests_finished_total.get("length", 0)
        == before.requests_finished_total.get("length", 0) + 1
    )
    with pytest.raises(AttributeError):
        after.running = 3  # type: ignore[misc]


def test_grow_on_exhaustion_is_honoured_up_to_max_blocks(make_engine):
    # starts with room for 5 blocks per stream (not one layer set of a prompt); may grow
    engine = make_engine(n_blocks=10, grow_on_exhaustion=True, max_blocks=2 * 160)
    ps = prompts(engine, 4)
    handles = [engine.submit(request(p[:10], max_tokens=30)) for p in ps]
    assert all(h.collect(60)[1].finish_reason == "length" for h in handles)
    stats = engine.pool.stats
    assert stats.n_grown > 0 and stats.n_blocks <= 2 * 160
    with pytest.raises(RequestTooLargeError):
        engine.submit(request([1] * 1500, max_tokens=10))  # over max_blocks even alone


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(make_engine):
    engine = make_engine(n_blocks=2 * 1200, prefill_step=64)
    ps = prompts(engine, 2)
    running = engine.submit(request(ps[0], max_tokens=400))
    events = running.events(30)
    next(e for e in events if isinstance(e, TokenEvent))
    long_prompt = (ps[1] * 200)[:1400]  # 22 prefill chunks of 64
    late = engine.submit(request(long_prompt, max_tokens=2))
    first_late = next(e for e in late.events(60) if isinstance(e, TokenEvent)).time
    late_done = late.collect(60)
    assert late_done[1].finish_reason == "length"
    # the running request kept decoding while the long prompt was being prefilled
    during = [
        e for e in events if isinstance(e, TokenEvent) and late.submitted_at < e.time < first_late
    ]
    assert len(during) >= 10


class _Widths:
    """The model, recording the width of every forward it runs (the engine thread's only)."""

    def __init__(self, model) -> None:
        self.model, self.widths = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.widths.append(inputs.shape[1])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_prompt_one_chunk_holds_goes_in_whole_not_split_by_the_budget_left(make_engine):
    gate, box = threading.Event(), {}

    def hook() -> None:  # engine thread, before a turn: wrap the model, hold the first turn
        runner = box["engine"]._core.runner
        if not isinstance(runner.model, _Widths):
            box["spy"] = runner.model = _Widths(runner.model)
        gate.wait(30)

    engine = make_engine(
        prefill_budget=100, idle_prefill_budget=100, prefix_caching=False, step_hook=hook
    )
    box["engine"] = engine
    ps = [(p * 60)[:60] for p in prompts(engine, 3)]
    handles = [engine.submit(request(p, max_tokens=4)) for p in ps]
    gate.set()
    for h in handles:
        assert len(token_ids(h)) == 4
    # the budget (100) holds one 60-token prompt and 40 tokens of the next: the next waits a
    # turn and goes in whole (split, it would take two forwards of 40 and 20)
    assert sorted(w for w in box["spy"].widths if w > 1) == [60, 60, 60]


def test_a_shrunk_pool_refuses_with_503_what_the_configured_pool_would_hold(make_engine):
    engine = make_engine(n_blocks=2 * 400)
    assert engine.shrink("kv", 0) == 800
    with pytest.raises(CapacityReducedError):
        engine.submit(request([1, 2, 3], max_tokens=10))
    with pytest.raises(RequestTooLargeError):
        engine.submit(request([1] * 1700, max_tokens=10))  # over the configured pool too
    assert engine.stats().rejections_total == {"capacity": 1, "too_large": 1}


def test_tokens_are_held_for_the_stream_interval_and_flushed_with_the_finish(make_engine):
    # An interval far longer than the request: the first token goes out at once, every later
    # one only with the finish, in order, nothing lost.
    engine = make_engine(kv_cache_mb=32, stream_interval=30.0)
    handle = engine.submit(request(prompts(engine, 1)[0], max_tokens=20))
    arrivals: list[tuple[float, TokenEvent | FinishEvent]] = []
    for event in handle.events(60):
        arrivals.append((time.monotonic(), event))
    tokens = [e for _, e in arrivals if isinstance(e, TokenEvent)]
    assert len(tokens) == 20 and isinstance(arrivals[-1][1], FinishEvent)
    last_made = tokens[-1].time
    assert all(arrived >= last_made for arrived, _ in arrivals[1:])
    alone = make_engine(kv_cache_mb=32, stream_interval=0.0)
    assert [t.token_id for t in tokens] == token_ids(
        alone.submit(request(prompts(alone, 1)[0], max_tokens=20))
    )


def test_a_request_is_due_at_its_first_token_and_then_once_per_interval():
    from veloxquant_mlx.engine.request.faults import RequestFault
    from veloxquant_mlx.engine.request.handle import RequestHandle
    from veloxquant_mlx.engine.request.running import Running

    handle = RequestHandle(1, request([1, 2, 3]))
    run = Running(handle, detokenizer=None, fault=RequestFault(1, []))  # type: ignore[arg-type]

    def make(t: float) -> TokenEvent:
        event = TokenEvent(0, "x", t)
        run.pending.append(event)
        return event

    assert not run.is_due(0.0, 0.01)  # nothing pending
    first = make(0.0)
    assert run.is_due(0.0, 0.01)  # the first token at once
    assert run.take_all(0.0) == [first]
    a, b = make(0.003), make(0.006)
    assert not run.is_due(0.006, 0.01)  # within the interval: held
    c = make(0.011)
    assert run.is_due(0.011, 0.01)
    assert run.take_all(0.011) == [a, b, c] and run.pending == []  # everything held, in order
    d = make(0.015)
    assert not run.is_due(0.015, 0.01)  # the interval counts from the last delivery
    assert run.take_all(0.015) == [d]  # taken anyway when another request's delivery goes out


def test_a_requests_first_text_goes_out_at_once_even_after_an_empty_first_token():
    """A first token with no text (part of a character, a held stop-string prefix) went out
    at once, and then the first text waited a whole interval: the client's first visible
    token came an interval late."""
    from veloxquant_mlx.engine.request.faults import RequestFault
    from veloxquant_mlx.engine.request.handle import RequestHandle
    from veloxquant_mlx.engine.request.running import Running

    run = Running(RequestHandle(1, request([1, 2, 3])), None, RequestFault(1, []))  # type: ignore[arg-type]
    run.pending.append(TokenEvent(0, "", 0.0))
    assert run.is_due(0.0, 0.025) and len(run.take_all(0.0)) == 1  # the first token, no text
    run.pending.append(TokenEvent(0, "", 0.004))
    assert not run.is_due(0.004, 0.025)  # still nothing to show: held
    run.pending.append(TokenEvent(0, "hi", 0.008))
    assert run.is_due(0.008, 0.025)  # the first text: at once
    assert len(run.take_all(0.008)) == 2
    run.pending.append(TokenEvent(0, "more", 0.012))
    assert not run.is_due(0.012, 0.025)  # after that, the interval again


# ---------------------------------------------------------------------- fault isolation


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", "vocab"), ("top_k", "vocab+1"), ("prompt", "vocab"), ("logit_bias", "vocab")],
)
def test_submit_rejects_what_the_model_cannot_take(engine, field, value):
    vocab = engine.vocab_size
    bad = vocab + (1 if value.endswith("+1") else 0)
    prompt, sampling = [1, 2, 3], SamplingParams(temperature=1.0)
    if field == "top_k":
        sampling = SamplingParams(temperature=1.0, top_k=bad)
    elif field == "prompt":
        prompt = [1, bad]
    else:
        sampling = SamplingParams(temperature=1.0, logit_bias=((bad, 1.0),))
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(GenerationRequest(tuple(prompt), 4, sampling))
    assert info.value.param == field
    assert engine.stats().rejections_total.get("invalid") == 1


def test_any_int64_or_uint64_seed_samples_and_negative_seeds_are_reproducible(engine):
    for seed in (-1, -(2**63), 2**63, 2**64 - 1):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        a = engine.submit(GenerationRequest((1, 2, 3), 6, sampling)).collect(30)
        b = engine.submit(GenerationRequest((1, 2, 3), 6, sampling)).collect(30)
        assert a[1].finish_reason == "length"
        assert [t.token_id for t in a[0]] == [t.token_id for t in b[0]]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_a_failing_sampler_fails_its_request_alone(engine, monkeypatch):
    """The issue's crash: top_k at the vocabulary raised inside the batched step and killed the
    engine. With the edge check bypassed, the real sampler still fails: only its request ends."""
    monkeypatch.setattr(engine_module, "static_problem", lambda *args: None)
    ps = prompts(engine, 3)
    good = [engine.submit(request(p, max_tokens=40)) for p in ps[:2]]
    time.sleep(0.05)  # the good ones are decoding
    bad = engine.submit(
        GenerationRequest(
            tuple(ps[2]), 40, SamplingParams(temperature=1.0, top_k=engine.vocab_size)
        )
    )
    _tokens, finish = bad.collect(30)
    assert finish.finish_reason == "error" and finish.error_code == REQUEST_FAILED
    assert "sampler" in finish.error and "ValueError" in finish.error
    for h in good:
        assert h.collect(30)[1].finish_reason == "length"
    assert engine.alive and engine.ready
    after = engine.submit(request(ps[0], max_tokens=5)).collect(30)
    assert after[1].finish_reason == "length"


class FailsAtFifthToken:
    """A real detokenizer that raises at its 5th token (fault injection)."""

    def __init__(self, inner):
        self.inner, self.n = inner, 0

    def add_token(self, token):
        self.n += 1
        if self.n == 5:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "bug")
        return self.inner.add_token(token)

    def finalize(self):
        return self.inner.finalize()


def test_a_failing_grammar_or_detokenizer_fails_its_request_alone(engine, monkeypatch):
    """Fault injection into the real step: one request's grammar raises at its 3rd token,
    another's detokenizer at its 5th; the third request is untouched."""
    from veloxquant_mlx.engine.request.grammar import GrammarRow
    from veloxquant_mlx.server.structured import schema_grammar

    parts = engine._core.parts
    real_advance, real_factory = GrammarRow.advance, parts.new_detokenizer
    calls = {"n": 0}

    def advance(self, token):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("grammar bug")
        return real_advance(self, token)

    made = {"n": 0}

    def detokenizer():
        made["n"] += 1
        detok = real_factory()
        return detok if made["n"] != 2 else FailsAtFifthToken(detok)

    monkeypatch.setattr(GrammarRow, "advance", advance)
    monkeypatch.setattr(parts, "new_detokenizer", detokenizer)
    assert engine.grammars is not None
    grammar = engine.grammars.compile(schema_grammar({"type": "string", "minLength": 20}, "s"))
    ps = prompts(engine, 3)
    faulty = engine.submit(
        GenerationRequest(tuple(ps[0]), 30, SamplingParams(0.0), grammar=grammar)
    )
    time.sleep(0.02)
    broken_text = engine.submit(request(ps[1], max_tokens=30))
    fine = engine.submit(request(ps[2], max_tokens=30))
    f1, f2 = faulty.collect(30)[1], broken_text.collect(30)[1]
    assert (f1.finish_reason, f1.error_code) == ("error", REQUEST_FAILED)
    assert "grammar" in f1.error and "RuntimeError" in f1.error
    assert (f2.finish_reason, f2.error_code) == ("error", REQUEST_FAILED)
    assert "detokenizer" in f2.error
    assert fine.collect(30)[1].finish_reason == "length"
    assert engine.alive


def test_drain_deadline_fails_running_requests_with_draining(make_engine):
    engine = make_engine(n_blocks=2 * 400)
    h = engine.submit(request(prompts(engine, 1)[0], max_tokens=300))
    while not h.done and engine.stats().running == 0:
        time.sleep(0.01)
    engine.shutdown(drain_timeout=0.05)
    _tokens, finish = h.collect(10)
    assert (finish.finish_reason, finish.error_code) == ("error", DRAINING)


def test_shrink_answers_queued_requests_that_no_longer_fit_and_the_queue_moves_on(make_engine):
    engine = make_engine(n_blocks=2 * 400, max_running=1)
    ps = prompts(engine, 4)
    running = engine.submit(request(ps[0][:4], max_tokens=120))
    while engine.stats().running == 0:
        time.sleep(0.01)
    big = engine.submit(request((ps[1] * 20)[:100], max_tokens=30))  # fits the pool, queued
    small = engine.submit(request(ps[2][:4], max_tokens=8))
    # Retire every free block: the pool is now what `running` holds, too small for `big`.
    engine.shrink("kv", 0)
    _tokens, finish = big.collect(10)
    assert (finish.finish_reason, finish.error_code) == ("error", CAPACITY_REDUCED)
    # `running` outgrows the shrunk pool (capacity_reduced); `small` then fits what it freed.
    assert running.collect(30)[1].error_code == CAPACITY_REDUCED
    assert small.collect(30)[1].finish_reason == "length"  # not stuck behind anyone


def test_an_abandoned_engine_answers_requests_and_commands_that_wait(make_engine):
    """The group watchdog's path: the engine thread is stuck (here in the step hook, in a real
    group in a collective); ``abandon`` from another thread fails the running request and the
    shrink still waiting for a turn, at once, not after the caller's own timeout."""
    stuck, release = threading.Event(), threading.Event()

    def hook():
        stuck.set()
        release.wait(30)

    engine = make_engine(n_blocks=2 * 400, step_hook=hook)
    handle = engine.submit(request(prompts(engine, 1)[0], max_tokens=50))
    assert stuck.wait(30)
    outcome: dict[str, BaseException] = {}

    def shrink():
        try:
            engine.shrink("kv", 0, timeout=30)
        except BaseException as exc:  # the answer under test
            outcome["error"] = exc

    caller = threading.Thread(target=shrink)
    caller.start()
    time.sleep(0.2)  # the command is queued behind the stuck turn
    started = time.monotonic()
    engine._core.abandon("a rank of the model's group stopped answering")
    caller.join(10)
    assert not caller.is_alive() and time.monotonic() - started < 5
    assert isinstance(outcome.get("error"), EngineNotReadyError)
    _, finish = handle.collect(5)
    assert (finish.finish_reason, finish.error_code) == ("error", ENGINE_FAILED)
    assert not engine.alive
    release.set()  # the thread comes back (a real stuck one never does) and ends cleanly
    engine.shutdown(5)
    assert engine.pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_constrained_step_launches_its_forward_before_making_the_masks(make_engine, layout):
    """With a grammar row decoding in the dense layout, a step's forward is launched before the
    host waits for the previous tokens and fills the masks (``Runner._early_forward``); never
    in the paged layout, whose steps must wait for the previous one (in-place writes). The
    constrained answer holds its schema and the plain row beside it its greedy tokens."""
    from veloxquant_mlx.server.structured import schema_grammar

    early: list[bool] = []
    box: dict[str, Engine] = {}

    def hook() -> None:  # engine thread, before each turn
        engine = box.get("engine")
        runner = None if engine is None else engine._core.runner
        if runner is not None and any(r is not None for r in runner.rows):
            early.append(runner._early_forward(runner._constrained(runner.rows)))

    engine = make_engine(kv_layout=layout, step_hook=hook)
    box["engine"] = engine
    assert engine.grammars is not None
    schema = {
        "type": "object",
        "properties": {"n": {"type": "boolean"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    grammar = engine.grammars.compile(schema_grammar(schema, "s"))
    ps = prompts(engine, 2)
    alone = [t.token_id for t in engine.submit(request(ps[1], max_tokens=24)).collect(30)[0]]
    early.clear()
    constrained = engine.submit(
        GenerationRequest(tuple(ps[0]), 40, SamplingParams(0.0), grammar=grammar)
    )
    plain = engine.submit(request(ps[1], max_tokens=24))
    tokens, finish = constrained.collect(60)
    assert finish.finish_reason == "stop"
    assert isinstance(json.loads("".join(t.text for t in tokens))["n"], bool)
    assert [t.token_id for t in plain.collect(60)[0]] == alone
    assert any(early) == (layout == "dense")
