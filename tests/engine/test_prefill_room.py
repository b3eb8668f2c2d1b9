"""A prompt's prefill caches hold room for the whole prompt: a long prompt's chunks, and a cached
turn's new tokens after its cached pages, are written in place (a stock cache copies itself
whole every 256 tokens it grows, and a cached turn's pages were copied twice), with the same
greedy tokens as one forward and as a cold start."""

from __future__ import annotations

import random

import pytest
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class _Caches:
    """The model, recording each prefill forward's first cache as it was before and after
    (offset, buffer length, buffer id) (engine thread)."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __call__(self, inputs, *args, **kwargs):
        cache = (kwargs.get("cache") or [None])[0]
        if not isinstance(cache, KVCache) or cache.keys is None:
            return self.model(inputs, *args, **kwargs)
        before = (cache.offset, cache.keys.shape[2], id(cache.keys))
        out = self.model(inputs, *args, **kwargs)
        self.calls.append((inputs.shape[1], before, (cache.offset, cache.keys.shape[2])))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def _spied(make_engine, **overrides):
    box: dict = {}

    def hook() -> None:  # engine thread, before each turn
        runner = box["engine"]._core.runner
        if not isinstance(runner.model, _Caches):
            box["spy"] = runner.model = _Caches(runner.model)

    engine = make_engine(kv_cache_mb=32, step_hook=hook, **overrides)
    box["engine"] = engine
    return engine, box


def _tokens(engine, prompt: list[int], n: int = 8) -> list[int]:
    tokens, finish = engine.submit(GenerationRequest(tuple(prompt), n, GREEDY)).collect(120)
    assert isinstance(finish, FinishEvent) and finish.error is None
    return [t.token_id for t in tokens]


def test_a_long_prompts_chunks_write_into_one_buffer(make_engine):
    rng = random.Random(3)
    prompt = [rng.randrange(3, 2000) for _ in range(300)]
    whole = _tokens(make_engine(kv_cache_mb=32, prefix_caching=False), prompt)
    engine, box = _spied(make_engine, prefill_budget=32, idle_prefill_budget=32,
                         prefix_caching=False)  # fmt: skip
    assert _tokens(engine, prompt) == whole
    calls = box["spy"].calls  # every chunk after the first (which made the cache)
    assert len(calls) >= 8
    lengths = {length for _, _, (_, length) in calls}
    assert lengths == {len(prompt)}, "the cache never grew: room for the prompt from the start"


def test_a_cached_turn_starts_with_room_for_its_new_tokens(make_engine):
    rng = random.Random(4)
    first = [rng.randrange(3, 2000) for _ in range(100)]
    turn = first + [rng.randrange(3, 2000) for _ in range(60)]
    cold = _tokens(make_engine(kv_cache_mb=32, prefix_caching=False), turn)
    engine, box = _spied(make_engine, prefix_caching=True)
    _tokens(engine, first)
    box["spy"].calls.clear()
    assert _tokens(engine, turn) == cold
    (width, (offset, length, _), (after, length_after)), *_ = box["spy"].calls
    assert offset > 0 and offset % 16 == 0, "the turn started from its cached pages"
    assert length == length_after == len(turn), "room for the new tokens, written in place"
    assert width == len(turn) - offset and after == len(turn)


def test_a_scored_prompts_chunks_write_into_one_buffer(default_model):
    """Prompt scoring (``echo`` with ``logprobs``) feeds stock caches a chunk at a time too:
    after its first chunk they hold room for the whole prompt, and the scores equal one
    forward's (``tests/engine/test_scoring.py`` holds them through the engine)."""
    from veloxquant_mlx.engine.request.scoring import ScoringJob, prompt_logprobs

    model, _ = default_model
    prompt = tuple(random.Random(6).randrange(3, 2000) for _ in range(300))
    job, lengths = ScoringJob(prompt, 2), set()
    while not job.step(model, 32):
        lengths.add(job._caches[0].keys.shape[2])
    assert lengths == {len(prompt)}
    want = prompt_logprobs(model, prompt, 2)
    assert [t for t, _ in job.scores[1:]] == pytest.approx([t for t, _ in want[1:]], abs=1e-4)
