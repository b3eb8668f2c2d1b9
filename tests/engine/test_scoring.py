"""Prompt scoring (echo + logprobs) runs a chunk per engine turn: it equals one forward pass,
a generation sent after a long scoring job is answered before it ends, and a caller that gives
up stops it at the next chunk."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import CancelledError

import pytest

from tests.engine.conftest import wait_idle
from veloxquant_mlx.engine.request.scoring import prompt_logprobs
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


def test_chunked_scores_equal_one_forward_pass(make_engine):
    engine = make_engine(kv_cache_mb=32, prefill_budget=32, idle_prefill_budget=32)
    prompt = tuple(words(random.Random(1), 300))  # ten chunks
    got = engine.score(prompt, 3)
    want = prompt_logprobs(engine._core.runner.model, prompt, 3)
    assert len(got) == len(want) == 300 and got[0] == (None, ())
    for (lp, top), (lp_w, top_w) in zip(got[1:], want[1:], strict=True):
        assert lp == pytest.approx(lp_w, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in top_w]


def test_a_generation_is_answered_while_a_long_prompt_is_scored(make_engine):
    engine = make_engine(kv_cache_mb=32, prefill_budget=16, idle_prefill_budget=16)
    rng = random.Random(2)
    done: list[str] = []
    scorer = threading.Thread(
        target=lambda: (engine.score(tuple(words(rng, 1500)), 0), done.append("score"))
    )
    scorer.start()
    while not engine._core._scoring:  # bounded below by the join's timeout
        time.sleep(0.005)
    tokens, _ = engine.submit(
        GenerationRequest(tuple(words(rng, 8)), 4, SamplingParams(temperature=0.0))
    ).collect(120)
    done.append("generate")
    scorer.join(120)
    assert len(tokens) == 4 and done == ["generate", "score"]


def test_a_caller_that_gives_up_stops_the_scoring(make_engine):
    engine = make_engine(kv_cache_mb=32, prefill_budget=16, idle_prefill_budget=16)
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(CancelledError):
        engine.score(tuple(words(random.Random(3), 2000)), 5, cancelled=cancelled)
    assert time.monotonic() - started < 30
    for _ in range(200):  # the engine drops the job at its next chunk
        if not engine._core._scoring:
            break
        time.sleep(0.01)
    assert not engine._core._scoring
    wait_idle(engine)
