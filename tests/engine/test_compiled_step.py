"""Decode steps with the model's forward compiled (``--compiled-step``, kv/compiled_step.py):
the same tokens as eager steps, through joins, leaves, read-width and capacity changes; a model
whose forward cannot be traced is stepped eagerly, with one log line."""

from __future__ import annotations

import logging
import random
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _staggered(engine, seed: int, params: SamplingParams = GREEDY) -> list[list[int]]:
    """Five requests of different lengths, the later ones arriving while the first decode, so
    the batch's rows sit at different positions, rows leave (holes) and join again, and
    positions cross 128 (a read width) and 256 (the working set's capacity)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (12, 100, 7, 240, 30)]
    budgets = [200, 40, 90, 30, 60]
    handles = []
    first = iter(())
    early: list[int] = []  # the first request's tokens read while the others arrive
    for prompt, budget in zip(prompts, budgets, strict=True):
        handles.append(engine.submit(GenerationRequest(tuple(prompt), budget, params)))
        if len(handles) == 1:
            first = iter(handles[0].events(60))
        early.append(next(first).token_id)  # the first keeps decoding while the others join
    out = []
    for h in handles:
        tokens, finish = h.collect(120)
        assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
        out.append([t.token_id for t in tokens])
    out[0][:0] = early
    assert [len(t) for t in out] == budgets
    return out


def _traces(engine) -> dict[str, Any]:
    """Counts the compiled step's calls and traces (its forward runs once per trace)."""
    compiled = engine._core.runner.compiled
    assert compiled is not None, "the compiled step is off"
    seen: dict[str, Any] = {"calls": 0, "traces": 0, "compiled": compiled}
    forward = compiled._forward

    def traced(*args: mx.array) -> Any:
        seen["traces"] += 1
        return forward(*args)

    fn = mx.compile(traced)

    def called(*args: mx.array) -> Any:
        seen["calls"] += 1
        return fn(*args)

    compiled._fn = called  # (the engine thread is idle: no request yet)
    return seen


def test_compiled_steps_give_the_eager_steps_tokens(make_engine):
    eager = _staggered(make_engine(kv_cache_mb=32, compiled_step="off"), seed=3)
    engine = make_engine(kv_cache_mb=32, compiled_step="on")
    seen = _traces(engine)
    assert _staggered(engine, seed=3) == eager
    assert seen["compiled"].failed is None
    # every decode step went through it; traced once per shape met, not once per step
    assert seen["calls"] >= 200
    assert 1 <= seen["traces"] <= seen["calls"] // 5


def test_seeded_sampled_requests_are_the_same_compiled_or_eager(make_engine):
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    runs = [
        _staggered(make_engine(kv_cache_mb=32, compiled_step=mode), 7, sampled)
        for mode in ("off", "on")
    ]
    assert runs[0] == runs[1]
    assert len({t for row in runs[0] for t in row}) > 20  # sampled: not one repeated token


class _ReadsBack:
    """A model whose forward reads a value back on the host (which a trace cannot do)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if cache is not None and isinstance(cache[0].offset, mx.array):
            int(cache[0].offset.max())  # eager: evaluates; traced: raises
        return self._model(inputs, cache=cache)


def test_a_forward_that_does_not_compile_is_stepped_eagerly(make_engine, caplog):
    eager = _staggered(make_engine(kv_cache_mb=32, compiled_step="off"), seed=5)
    engine = make_engine(kv_cache_mb=32, compiled_step="on")
    runner = engine._core.runner
    compiled = runner.compiled
    runner.model = _ReadsBack(runner.model)  # (before any request: the engine thread is idle)
    with caplog.at_level(logging.WARNING, logger="veloxquant.engine"):
        assert _staggered(engine, seed=5) == eager
    assert runner.compiled is not compiled and runner.compiled.failed
    lines = [r for r in caplog.records if "do not compile" in r.getMessage()
             or "does not compile" in r.getMessage()]  # fmt: skip
    assert len(lines) == 1
