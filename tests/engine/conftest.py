"""An engine on the embedded default model; every test must leave its pool all free."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import assert_engine_all_free, assert_pool_all_free
from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent


def refused_at_start(
    config: EngineConfig, match: str, error: type[BaseException] = Exception
) -> BaseException:
    """An engine of ``config`` fails to load with ``error`` saying ``match``; it is shut down
    either way. Returns the error."""
    engine = Engine(config).start()
    try:
        with pytest.raises(error, match=match) as info:
            engine.wait_ready(120)
    finally:
        engine.shutdown(5)
    return info.value


def cancelled_while(
    make_engine: Callable[..., Engine],
    when: Callable[[Any], bool],
    prompt_tokens: int,
    seed: int,
    **overrides: Any,
) -> Engine:
    """Two requests decoding 60 tokens, then a fresh prompt of ``prompt_tokens`` arriving,
    cancelled from the engine thread at the first turn ``when(runner)`` holds: it ends
    cancelled with no token, the two by length. Returns the engine (``make_engine``'s
    fixture then checks its pool all free and no owner left)."""
    box: dict[str, Any] = {}
    greedy = SamplingParams(temperature=0.0)

    def hook() -> None:  # engine thread, before each turn
        engine = box.get("engine")
        ready = engine is not None and when(engine._core.runner)  # (called every turn)
        if ready and "long" in box and not box.get("cancelled"):
            box["cancelled"] = True
            engine.cancel(box["long"])

    engine = make_engine(kv_cache_mb=32, step_hook=hook, **overrides)
    box["engine"] = engine
    rng = random.Random(seed)
    short = [engine.submit(GenerationRequest(tuple(range(5, 17)), 60, greedy)) for _ in range(2)]
    assert isinstance(next(iter(short[0].events(60))), TokenEvent)
    box["long"] = engine.submit(
        GenerationRequest(tuple(rng.randrange(3, 2000) for _ in range(prompt_tokens)), 8, greedy)
    )
    tokens, finish = box["long"].collect(120)
    assert box.get("cancelled") and tokens == []
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "cancelled"
    for h in short:
        _, done = h.collect(120)
        assert isinstance(done, FinishEvent) and done.finish_reason == "length"
    return engine


def long_prompt_beside_two_streams(
    engine: Engine,
    seed: int,
    prompt_tokens: int,
    stream_tokens: int,
    first_tokens: int = 1,
    reason: str | None = "length",
) -> list[list[int]]:
    """Two 12-token prompts decoding ``stream_tokens`` greedy tokens; after the first's
    ``first_tokens`` tokens, a fresh ``prompt_tokens``-token prompt (8 tokens) arrives. Waits
    for all three (each ending by ``reason``, unless None) and returns their token ids."""
    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(seed)
    short = [[rng.randrange(3, 2000) for _ in range(12)] for _ in range(2)]
    long = [rng.randrange(3, 2000) for _ in range(prompt_tokens)]
    handles = [engine.submit(GenerationRequest(tuple(p), stream_tokens, greedy)) for p in short]
    events = iter(handles[0].events(60))
    first = [next(events) for _ in range(first_tokens)]  # decoding before the long one arrives
    assert all(isinstance(e, TokenEvent) for e in first)
    handles.append(engine.submit(GenerationRequest(tuple(long), 8, greedy)))
    out = []
    for h in handles:
        tokens, finish = h.collect(120)
        assert isinstance(finish, FinishEvent)
        assert reason is None or finish.finish_reason == reason
        out.append([t.token_id for t in tokens])
    out[0][:0] = [e.token_id for e in first]
    return out


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


@pytest.fixture
def make_engine(default_model_dir) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        step_hook = overrides.pop("step_hook", None)
        config = EngineConfig(model_cache_dir=str(default_model_dir.parent), **overrides)
        engine = Engine(config, step_hook=step_hook).start()
        engine.wait_ready(120)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        if engine.alive:
            wait_idle(engine)
            assert_engine_all_free(engine)
        engine.shutdown(5)
        assert not engine.alive
        assert_pool_all_free(engine.pool)


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(kv_cache_mb=32)
