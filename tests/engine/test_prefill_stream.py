"""``--prefill-stream``: prefill forwards on an MLX stream of their own. A long prompt prefilled
in chunks beside decoding rows gives every request the same greedy tokens as with one stream,
and its forwards (not the decode steps') ran on the other stream. ``--prefill-join ready``: the
prompt's row joins a later step than its last chunk's (once that chunk is probably done), with
the same tokens; a request that leaves while it waits to join leaves nothing behind."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from tests.engine.conftest import cancelled_while, long_prompt_beside_two_streams
from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop.join_clock import OVERHEAD_TOKENS, JoinClock
from veloxquant_mlx.engine.model.choices import prefill_join, prefill_stream
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams


class _Streams:
    """The model, recording (width, the stream it was called on) per forward (engine thread)."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls.append((inputs.shape[1], str(mx.default_stream(mx.default_device()))))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _serve(
    make_engine, mode: str, join: str = "ready", rate: float | None = None
) -> tuple[list[list[int]], list[tuple[int, str]], int]:
    """Two short requests decoding, then a long prompt arriving (chunks of 32 beside them);
    every request's tokens, the forwards' widths and streams, and the rows that joined late.
    ``rate``: the join clock's seconds per prompt token, held there."""
    box: dict = {}

    def hook() -> None:  # engine thread, before each turn
        runner = box["engine"]._core.runner
        if not isinstance(runner.model, _Streams):
            box["spy"] = runner.model = _Streams(runner.model)
        if rate is not None:
            runner._joins.clock.rate = rate

    engine = make_engine(
        kv_cache_mb=32, prefill_budget=32, prefix_caching=False, prefill_stream=mode,
        prefill_join=join, step_hook=hook,
    )  # fmt: skip
    box["engine"] = engine
    out = long_prompt_beside_two_streams(
        engine, seed=5, prompt_tokens=300, stream_tokens=40, reason=None
    )
    return out, box["spy"].calls, engine._core.runner.late_joins


def test_prefill_on_its_own_stream_gives_the_same_tokens(make_engine):
    on, calls, late = _serve(make_engine, "on")
    off, calls_off, late_off = _serve(make_engine, "off")
    now, _, late_now = _serve(make_engine, "on", join="now")
    assert on == off == now
    assert late >= 1  # the long prompt's row joined after its last chunk's step
    assert late_off == late_now == 0
    assert [len(t) for t in on] == [40, 40, 8]
    prefill = {s for w, s in calls if w > 1}
    decode = {s for w, s in calls if w == 1}
    assert prefill and decode and not prefill & decode, calls
    assert sum(w for w, _ in calls if w > 1) >= 300  # the long prompt went in chunks
    assert max(w for w, _ in calls) <= 32
    # with one stream every forward runs on the default one
    assert len({s for _, s in calls_off}) == 1


def test_a_row_waiting_to_join_joins_once_nobody_decodes(make_engine):
    # a clock that never calls the prefill done: the row joins when the others have ended
    slow, _, late = _serve(make_engine, "on", rate=1.0)
    off, _, _ = _serve(make_engine, "off")
    assert slow == off
    assert late >= 1


def test_a_request_that_leaves_while_waiting_to_join_leaves_nothing(make_engine):
    """Nothing held, and nothing wrong cached: its pages were copied into the prefix cache when
    its prefill completed, and its retry hits them and gives a cold prefill's tokens. (The
    paged layout never prefills on a stream of its own, so never waits to join.)"""

    def waiting(runner) -> bool:  # engine thread: the clock never calls a prefill done
        runner._joins.clock.rate = 1.0
        return runner.waiting_to_join() > 0

    engine = cancelled_while(
        make_engine, waiting, 200, 7, prefill_budget=32, prefill_stream="on", prefill_join="ready"
    )
    assert engine._core.runner.waiting_to_join() == 0
    # the same prompt again (``cancelled_while``'s), and on an engine that caches nothing
    rng = random.Random(7)
    prompt = tuple(rng.randrange(3, 2000) for _ in range(200))
    greedy = SamplingParams(temperature=0.0)
    plain = make_engine(kv_cache_mb=32, prefix_caching=False)
    runs = [e.submit(GenerationRequest(prompt, 8, greedy)).collect(120) for e in (engine, plain)]
    (tokens, finish), (cold, _) = runs
    assert [t.token_id for t in tokens] == [t.token_id for t in cold]
    assert finish.usage.cached_tokens == 192  # its 12 full pages
    # the fixture then checks the pool all free and no owner left


def test_join_clock_guesses_from_the_reads():
    now = [10.0]
    clock = JoinClock(rate=0.001, clock=lambda: now[0])
    first = clock.launched(100 - OVERHEAD_TOKENS)  # 0.1 s with a forward's own cost
    second = clock.launched(50 - OVERHEAD_TOKENS)  # queued behind it on the stream
    assert (first.start, first.done) == (10.0, pytest.approx(10.1))
    assert (second.start, second.done) == (pytest.approx(10.1), pytest.approx(10.15))
    assert not clock.due(first)
    now[0] = 10.12
    assert clock.due(first) and not clock.due(second)
    clock.learn(second, waited=0.04, at=10.17)  # it ran until 10.17: 0.07 s for 0.05
    assert clock.rate == pytest.approx(0.001 * 0.07 / 0.05)
    clock.learn(second, waited=0.5, at=11.0)  # a long wait grows the rate at most 2x
    assert clock.rate == pytest.approx(0.001 * 0.07 / 0.05 * 2)
    high = clock.rate
    clock.learn(second, waited=0.0, at=11.1)  # done before the read: a little lower
    assert clock.rate == pytest.approx(high * 0.9)
    for _ in range(2000):  # bounded below
        clock.learn(second, waited=0.0, at=11.0)
    assert clock.rate == pytest.approx(1e-7)
    now[0] = 20.0  # an idle stream starts a launch now
    assert clock.launched(10).start == 20.0


def test_bad_join_values_are_refused():
    assert prefill_join(EngineConfig()) is False
    assert prefill_join(EngineConfig(prefill_join="ready")) is True
    with pytest.raises(ValueError, match="prefill_join"):
        prefill_join(EngineConfig(prefill_join="later"))


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
    assert engine._core.runner.prefills.own_stream is False
    assert any("the paged layout" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("INFO", logger="veloxquant.engine"):
        dense = make_engine(kv_cache_mb=32, prefill_stream="on")
    assert dense._core.runner.prefills.own_stream is True
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert ready and "on a stream of its own, prefix caching" in ready[0], ready
