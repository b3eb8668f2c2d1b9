"""The engine in a process of its own (``hosts.process.EngineProcess``): same tokens, same refusals,
same pool accounting as on a thread; a dead child fails its requests and never hangs a caller;
a child whose server vanished stops by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.hosts.process import EngineProcess
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.engine.types import (
    ENGINE_FAILED,
    CapacityReducedError,
    EngineNotReadyError,
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    SamplingParams,
    rejection_of,
)

GREEDY = SamplingParams(temperature=0.0)


def request(tokens, max_tokens=16, sampling=GREEDY, **kw) -> GenerationRequest:
    return GenerationRequest(tuple(tokens), max_tokens, sampling, **kw)


def assert_all_free(engine: EngineProcess) -> None:
    """As tests.conftest.assert_engine_all_free, through the child's view."""
    deadline = time.monotonic() + 30
    view = engine.view()
    while time.monotonic() < deadline:
        view = engine.view()
        if view.stats.running == 0 and view.stats.waiting == 0:
            break
        time.sleep(0.02)
    assert view.stats.blocks_in_use == 0, view.stats
    engine.reset_prefix_cache()
    pool = engine.view().pool
    assert pool is not None
    assert pool.stats.blocks_in_use() == 0, pool.stats
    assert pool.owners == {}, pool.owners


@pytest.fixture
def make_process(default_model_dir) -> Iterator[Callable[..., EngineProcess]]:
    made: list[EngineProcess] = []

    def make(**overrides) -> EngineProcess:
        config = EngineConfig(model_cache_dir=str(default_model_dir.parent), **overrides)
        engine = EngineProcess(config).start()
        made.append(engine)
        engine.wait_ready(120)
        return engine

    yield make
    for engine in made:
        if engine.alive:
            assert_all_free(engine)
        engine.shutdown(5)
        assert not engine.alive
        assert engine._process.poll() is not None, "the engine process outlived shutdown"


def test_tokens_logprobs_and_stop_strings_match_the_engine_on_a_thread(
    make_process, default_model_dir
):
    remote = make_process(kv_cache_mb=32)
    local = Engine(EngineConfig(model_cache_dir=str(default_model_dir.parent), kv_cache_mb=32))
    local.start().wait_ready(120)
    try:
        tok = remote.tokenizer
        prompts = [tok.encode(f"tell me a story number {i}" + " and more" * i) for i in range(5)]
        kw = {"logprobs": True, "top_logprobs": 2}
        theirs = [local.submit(request(p, 12 + i, **kw)) for i, p in enumerate(prompts)]
        ours = [remote.submit(request(p, 12 + i, **kw)) for i, p in enumerate(prompts)]
        for a, b in zip(theirs, ours, strict=True):
            (ta, fa), (tb, fb) = a.collect(60), b.collect(60)
            assert [t.token_id for t in ta] == [t.token_id for t in tb]
            assert [t.text for t in ta] == [t.text for t in tb]
            # batches form at different steps on the two engines: logprobs round differently
            for x, y in zip(ta, tb, strict=True):
                assert [i for i, _ in x.top_logprobs] == [i for i, _ in y.top_logprobs]
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert (fa.finish_reason, fa.usage) == (fb.finish_reason, fb.usage)
        text = local.submit(request(prompts[0], 12)).text(60)
        stop = text[3:6]
        a = local.submit(request(prompts[0], 12, stop=(stop,))).text(60)
        b = remote.submit(request(prompts[0], 12, stop=(stop,))).text(60)
        assert a == b and stop not in b
        scored, expected = remote.score(tuple(prompts[1]), 2), local.score(tuple(prompts[1]), 2)
        assert len(scored) == len(expected) == len(prompts[1])
        assert repr(scored) == repr(expected)  # one forward pass alone: the same bits
    finally:
        local.shutdown(5)


def test_refusals_only_the_engine_can_decide_arrive_as_their_errors(make_process):
    engine = make_process(kv_cache_mb=32, max_running=1, max_queue=1)
    prompt = engine.tokenizer.encode("hello there")
    handles = [engine.submit(request(prompt, 64)) for _ in range(6)]
    finishes = [h.collect(60)[1] for h in handles]
    refused = [rejection_of(f) for f in finishes]
    assert any(isinstance(r, QueueFullError) for r in refused), finishes
    assert finishes[0].finish_reason == "length" and refused[0] is None
    stats = engine.stats()
    assert stats.rejections_total.get("queue_full", 0) == sum(
        isinstance(r, QueueFullError) for r in refused
    )


def test_static_checks_raise_at_submit_and_are_counted(make_process):
    engine = make_process(kv_cache_mb=32)
    with pytest.raises(InvalidRequestError) as exc:
        engine.submit(request([engine.vocab_size + 5], 4))
    assert exc.value.param == "prompt"
    window = engine.context_window
    assert window is not None
    with pytest.raises(RequestTooLargeError):
        engine.submit(request([5], window))
    assert engine.stats().rejections_total == {"invalid": 1, "too_large": 1}


def test_shrink_and_the_pool_view_cross_the_process(make_process):
    engine = make_process(n_blocks=2048, max_running=4)
    prompt = engine.tokenizer.encode("a prompt of some length " * 20)
    before = engine.view().pool
    assert before is not None and before.stats.n_blocks == 2048
    running = engine.submit(request(prompt, 200))
    next(iter(running.events(60)))  # it holds blocks now
    retired = engine.shrink("kv", 600)  # per stream; never a block in use
    after = engine.view().pool
    assert after is not None and retired > 0
    assert after.stats.n_blocks == 2048 - retired
    assert all(n <= 600 for n in after.free.values()), after.free
    assert running.collect(60)[1].finish_reason == "length"
    # a prompt the shrunk pool cannot hold is refused by the child, with its own error
    engine.shrink("kv", 10)
    small = engine.view().pool
    assert small is not None and small.stats.n_blocks == 20
    refused = engine.submit(request(prompt, 4)).collect(60)[1]
    assert isinstance(rejection_of(refused), CapacityReducedError), refused
    with pytest.raises(ValueError):
        engine.shrink("x", 1)


def test_cancel_in_the_child_frees_the_request(make_process):
    engine = make_process(kv_cache_mb=32)
    handle = engine.submit(request(engine.tokenizer.encode("cancel me"), 1000))
    next(iter(handle.events(60)))
    engine.cancel(handle)
    assert handle.collect(60)[1].finish_reason == "cancelled"


def test_a_killed_child_fails_every_request_and_the_facade_says_dead(make_process):
    engine = make_process(kv_cache_mb=32)
    prompt = engine.tokenizer.encode("hello")
    handles = [engine.submit(request(prompt, 2000)) for _ in range(3)]
    for h in handles:
        next(iter(h.events(60)))
    os.kill(engine.pid, signal.SIGKILL)
    for h in handles:
        finish = h.collect(30)[1]
        assert finish.finish_reason == "error" and finish.error_code == ENGINE_FAILED
    deadline = time.monotonic() + 10
    while engine.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.alive and not engine.ready
    with pytest.raises(EngineNotReadyError):
        engine.submit(request(prompt, 4))
    with pytest.raises(EngineNotReadyError):
        engine.shrink("kv", 0)
    assert engine.view().stats.alive is False  # the last view, marked dead


def test_a_model_that_cannot_load_raises_its_error_from_wait_ready(tmp_path):
    engine = EngineProcess(EngineConfig(model=str(tmp_path / "missing"))).start()
    try:
        with pytest.raises(FileNotFoundError, match="not a local directory"):
            engine.wait_ready(120)
        assert not engine.ready
    finally:
        engine.shutdown(0)
    assert engine._process.poll() is not None


ORPHAN = textwrap.dedent(
    """
    import os, sys
    from veloxquant_mlx.engine.config import EngineConfig
    from veloxquant_mlx.engine.hosts.process import EngineProcess

    engine = EngineProcess(EngineConfig(model_cache_dir=sys.argv[1], kv_cache_mb=16)).start()
    engine.wait_ready(120)
    print(engine.pid, flush=True)
    os._exit(0)  # no shutdown, no atexit: as if the server were killed
    """
)


def test_the_child_stops_by_itself_when_the_server_process_vanishes(tmp_path, default_model_dir):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    out = subprocess.run(
        [sys.executable, str(script), str(default_model_dir.parent)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state == "Z":  # exited; its new parent has not reaped it yet
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the engine process outlived its server by 30 s")


def test_a_finish_from_the_child_is_the_last_event_and_carries_usage(make_process):
    engine = make_process(kv_cache_mb=32)
    handle = engine.submit(request(engine.tokenizer.encode("usage please"), 9))
    events = list(handle.events(60))
    assert isinstance(events[-1], FinishEvent) and handle.done
    assert events[-1].usage.completion_tokens == len(events) - 1 == 9
    assert events[-1].usage.peak_kv_blocks > 0


def test_a_grammar_is_compiled_again_in_the_child_and_holds(make_process):
    """The compiled matcher never crosses the pipe: the child compiles the text on its own
    workers, then decodes under it; a request cancelled while its grammar compiles ends
    cancelled without reaching the engine."""
    import json

    from veloxquant_mlx.server.structured import schema_grammar

    engine = make_process(kv_cache_mb=32)
    assert engine.grammars is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = engine.grammars.compile(schema_grammar(schema, "s"))
    sampled = SamplingParams(temperature=1.0, seed=3)
    handle = engine.submit(request(engine.tokenizer.encode("json"), 24, sampled, grammar=grammar))
    events, finish = handle.collect(60)
    text = engine.tokenizer.decode([e.token_id for e in events])
    if finish.finish_reason == "stop":  # a cut-off output is a prefix of the grammar's
        assert isinstance(json.loads(text)["a"], int), text
    wide = {"type": "object", "required": [f"o{j}" for j in range(12)], "properties": {
        f"o{j}": {"type": "object", "properties": {f"a{j}_{i}": {} for i in range(400)}}
        for j in range(12)}}  # fmt: skip
    slow = engine.grammars.compile(schema_grammar(wide, "s"))
    handle = engine.submit(request(engine.tokenizer.encode("json"), 4, grammar=slow))
    engine.cancel(handle)
    assert handle.collect(60)[1].finish_reason == "cancelled"


def test_a_score_the_caller_gives_up_stops_in_the_child(make_process):
    """The cancel crosses the pipe: the child's scoring stops at its next chunk, so a request
    sent afterwards is not kept waiting behind the rest of the prompt."""
    engine = make_process(kv_cache_mb=32, prefill_budget=16, idle_prefill_budget=16)
    prompt = tuple(range(3, 2003))  # 125 chunks of 16
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    with pytest.raises(CancelledError):
        engine.score(prompt, 5, cancelled=cancelled)
    tokens, finish = engine.submit(request(engine.tokenizer.encode("after"), 3)).collect(60)
    assert len(tokens) == 3 and finish.finish_reason == "length"
    # scored whole, the same prompt is the same scores (the cancel left nothing behind)
    assert len(engine.score(prompt[:40], 1)) == 40


def test_the_childs_prefix_cache_survives_a_restart_on_disk(make_process, tmp_path):
    """--prefix-cache-dir with the engine in its own process: the child writes its pages when
    it stops, a new child loads them, and its snapshot carries the disk counters across."""
    prompt = list(range(3, 83))  # 5 full pages
    first = make_process(kv_cache_mb=32, prefix_cache_dir=str(tmp_path))
    answer = [t.token_id for t in first.submit(request(prompt, 12)).collect(60)[0]]
    first.shutdown(5)
    assert len(list(tmp_path.rglob("*.safetensors"))) == (80 + 12) // 16
    again = make_process(kv_cache_mb=32, prefix_cache_dir=str(tmp_path), prefix_cache_preload_gb=0)
    tokens, finish = again.submit(request(prompt, 12)).collect(60)
    assert [t.token_id for t in tokens] == answer
    assert finish.usage.cached_tokens == 79 // 16 * 16
    stats = again.stats()
    assert stats.prefix_disk and stats.prefix_disk_hits_total == 79 // 16
