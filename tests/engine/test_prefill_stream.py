"""``--prefill-stream``: prefill forwards on an MLX stream of their own. A long prompt prefilled
in chunks beside decoding rows gives every request the same greedy tokens as with one stream,
and its forwards (not the decode steps') ran on the other stream."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.model.choices import prefill_stream
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent

GREEDY = SamplingParams(temperature=0.0)


class _Streams:
    """The model, recording (width, the stream it was called on) per forward (engine thread)."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls.append((inputs.shape[1], str(mx.default_stream(mx.default_device()))))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _serve(make_engine, mode: str) -> tuple[list[list[int]], list[tuple[int, str]]]:
    """Two short requests decoding, then a long prompt arriving (chunks of 32 beside them);
    every request's tokens, and the forwards' widths and streams."""
    box: dict = {}

    def hook() -> None:  # engine thread, before each turn
        runner = box["engine"]._core.runner
        if not isinstance(runner.model, _Streams):
            box["spy"] = runner.model = _Streams(runner.model)

    engine = make_engine(
        kv_cache_mb=32, prefill_budget=32, prefix_caching=False, prefill_stream=mode,
        step_hook=hook,
    )  # fmt: skip
    box["engine"] = engine
    rng = random.Random(5)
    short = [[rng.randrange(3, 2000) for _ in range(12)] for _ in range(2)]
    long = [rng.randrange(3, 2000) for _ in range(300)]
    handles = [engine.submit(GenerationRequest(tuple(p), 40, GREEDY)) for p in short]
    first = next(iter(handles[0].events(60)))  # decoding before the long one arrives
    assert isinstance(first, TokenEvent)
    handles.append(engine.submit(GenerationRequest(tuple(long), 8, GREEDY)))
    out = []
    for h in handles:
        tokens, finish = h.collect(120)
        assert isinstance(finish, FinishEvent)
        out.append([t.token_id for t in tokens])
    out[0].insert(0, first.token_id)
    return out, box["spy"].calls


def test_prefill_on_its_own_stream_gives_the_same_tokens(make_engine):
    on, calls = _serve(make_engine, "on")
    off, calls_off = _serve(make_engine, "off")
    assert on == off
    assert [len(t) for t in on] == [40, 40, 8]
    prefill = {s for w, s in calls if w > 1}
    decode = {s for w, s in calls if w == 1}
    assert prefill and decode and not prefill & decode, calls
    assert sum(w for w, _ in calls if w > 1) >= 300  # the long prompt went in chunks
    assert max(w for w, _ in calls) <= 32
    # with one stream every forward runs on the default one
    assert len({s for _, s in calls_off}) == 1


def test_auto_is_off_on_a_cpu_and_bad_values_are_refused():
    assert prefill_stream(EngineConfig(prefill_stream="on")) is True
    assert prefill_stream(EngineConfig(prefill_stream="off")) is False
    if mx.default_device() == mx.cpu:
        assert prefill_stream(EngineConfig()) is False
    with pytest.raises(ValueError, match="prefill_stream"):
        prefill_stream(EngineConfig(prefill_stream="sometimes"))


def test_the_paged_layout_keeps_one_stream(make_engine, caplog):
    # its prefills read cached pages from the blocks decode steps write in place
    with caplog.at_level("INFO", logger="veloxquant.engine"):
        engine = make_engine(kv_cache_mb=32, kv_layout="paged", prefill_stream="on")
    assert engine._core.runner._own_stream is False
    assert any("the paged layout" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("INFO", logger="veloxquant.engine"):
        dense = make_engine(kv_cache_mb=32, prefill_stream="on")
    assert dense._core.runner._own_stream is True
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert ready and "on a stream of its own, prefix caching" in ready[0], ready
