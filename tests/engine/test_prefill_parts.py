"""``--prefill-parts``: while rows decode, a prompt's chunk is launched over several engine
turns, a run of its layers a turn, with their decode steps between. Every request gets the
same greedy tokens as with the chunk launched whole (dense, paged and int8 KV); the chunks'
launches were spread over turns; nothing is planned meanwhile; a request that leaves while its
chunk is being launched leaves nothing behind. The parts themselves: the hidden states that
end each run of layers. ``--prefill-parts auto``: the parts' arithmetic on given gaps
(``PrefillParts``), the choice per backend, and an engine that learns them from its own turns
(the same tokens, its chunks launched in more parts once a chunk is known to stall the
streams)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.engine.conftest import cancelled_while, long_prompt_beside_two_streams
from veloxquant_mlx.config.settings import Settings
from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop import layer_capture
from veloxquant_mlx.engine.loop.join_clock import OVERHEAD_TOKENS
from veloxquant_mlx.engine.loop.prefill_budget import UP_TO, DecodeGaps, PrefillBudget
from veloxquant_mlx.engine.loop.prefill_parts import START, PrefillParts
from veloxquant_mlx.engine.model import choices

MS = 0.001


def _serve(
    make_engine,
    parts: int | str,
    prompt_tokens: int = 300,
    stream_tokens: int = 60,
    first_tokens: int = 1,
    **overrides,
) -> tuple[list[list[int]], int, object]:
    """Two short requests decoding, then a long prompt arriving (chunks of 64 beside them);
    every request's tokens, the turns that began with a chunk being launched, the engine."""
    box: dict = {"staging": 0}

    def hook() -> None:  # engine thread, before each turn
        if "engine" in box and box["engine"]._core.runner.staging():
            box["staging"] += 1

    engine = make_engine(
        kv_cache_mb=32, prefill_budget=64, prefix_caching=False, prefill_parts=parts,
        step_hook=hook, **overrides,
    )  # fmt: skip
    box["engine"] = engine
    out = long_prompt_beside_two_streams(
        engine, seed=5, prompt_tokens=prompt_tokens, stream_tokens=stream_tokens,
        first_tokens=first_tokens,
    )  # fmt: skip
    return out, box["staging"], engine


@pytest.mark.parametrize(
    "kv", [{}, {"kv_layout": "paged"}, {"kv_format": "int8"}], ids=["dense", "paged", "int8"]
)
def test_a_chunk_launched_in_parts_gives_the_same_tokens(make_engine, kv):
    whole, staged_whole, _ = _serve(make_engine, 1, **kv)
    parts, staged, _ = _serve(make_engine, 4, **kv)
    assert parts == whole
    assert [len(t) for t in parts] == [60, 60, 8]
    assert staged_whole == 0
    # five chunks of the long prompt beside the decoding rows, three turns of parts each
    assert staged >= 5 * 3, staged


def test_parts_on_a_stream_of_their_own_give_the_same_tokens(make_engine):
    whole, _, _ = _serve(make_engine, 1, prefill_stream="on")
    parts, staged, _ = _serve(make_engine, 2, prefill_stream="on")
    assert parts == whole and staged >= 5


def test_a_request_that_leaves_while_its_chunk_is_launched_leaves_nothing(make_engine):
    engine = cancelled_while(
        make_engine, lambda runner: runner.staging(), 300, 9, prefill_budget=64, prefill_parts=4
    )
    assert not engine._core.runner.staging()


@pytest.mark.parametrize(
    ("n_layers", "parts", "ends"), [(4, 4, [1, 2, 3]), (4, 2, [2]), (5, 3, [1, 3]), (2, 4, [1])]
)
def test_stages_end_even_runs_of_layers(n_layers, parts, ends):
    outputs = [mx.array([i]) for i in range(n_layers)]
    got = layer_capture.stages(outputs, n_layers, parts)
    assert [int(a.item()) + 1 for a in got] == ends
    assert layer_capture.stages(outputs, n_layers + 1, parts) == []  # not one output a layer
    assert layer_capture.stages(outputs, n_layers, 1) == []


def test_capture_collects_each_layers_output_and_changes_no_logits(default_model):
    model, _ = default_model
    assert layer_capture.install(model) and layer_capture.install(model)  # idempotent
    tokens = mx.array([[5, 9, 200, 7, 31]])
    plain = model(tokens)
    with layer_capture.capturing(model) as outputs:
        captured = model(tokens)
    assert len(outputs) == len(model.layers)
    assert all(o.shape == outputs[0].shape for o in outputs)
    assert mx.array_equal(plain, captured).item()
    with layer_capture.capturing(model, on=False) as none:
        model(tokens)
    assert none == []


def _turns(parts: PrefillParts, budget: PrefillBudget, gaps_work: list[tuple[float, float]]):
    """Feed (gap, work) turns with 2 rows decoding through the budget (which feeds the gaps)
    into the parts, as the scheduler does."""
    for gap, work in gaps_work:
        counted = budget.observe(gap, 0, 2, touched=work > 0)
        parts.observe(gap, work, 2, counted)


def test_auto_parts_keep_a_turn_within_twice_a_decode_only_one():
    budget = PrefillBudget(512, 2048)  # a fixed budget still keeps the reference gaps
    parts = PrefillParts(None, budget.gaps)
    assert parts.auto and parts.parts(256, 2) == START  # nothing known yet
    _turns(parts, budget, [(10 * MS, 0.0)] * 20)
    assert budget.reference(2) == pytest.approx(10 * MS)
    assert parts.parts(256, 2) == START  # a reference, no rate yet
    # A whole chunk of 256 tokens: its turn 40 ms over the reference, the next 20 ms (its
    # cost showing late, as on a stream of its own), then a clean turn closes the window.
    work = 256 + OVERHEAD_TOKENS
    _turns(parts, budget, [(50 * MS, work), (30 * MS, 0.0), (10 * MS, 0.0)])
    assert parts.rate == pytest.approx(60 * MS / work)
    # 60 ms of chunk over 10 ms a turn allowed (ratio 2): six parts; a chunk half as much
    # work, three; a row count with no reference of its own, START
    assert parts.parts(256, 2) == 6
    assert parts.parts((256 + OVERHEAD_TOKENS) // 2 - OVERHEAD_TOKENS, 2) == 3
    assert parts.parts(256, 4) == START
    assert parts.parts(100_000, 2) == 16  # at most
    # Parts that measure cheap bring the rate down: six parts of 4 ms over, then clean
    _turns(parts, budget, [(14 * MS, work / 6)] * 6 + [(10 * MS, 0.0)] * 2)
    assert parts.rate < 60 * MS / work
    assert parts.parts(256, 2) < 6
    # Many rows decoding: whole (the scheduler must keep up with arrivals)
    assert parts.parts(256, UP_TO + 1) == 1
    parts.reset()
    assert parts.rate is None and parts.parts(256, 2) == START


def test_turns_that_do_not_count_teach_nothing():
    gaps = DecodeGaps()
    parts = PrefillParts(None, gaps)
    parts.observe(1.0, 500.0, 0, gaps.observe(1.0, True, 0))  # nobody decoding
    parts.observe(1.0, 0.0, 2, gaps.observe(1.0, False, 2))  # after an idle engine
    assert gaps.reference(2) is None and parts.rate is None
    fixed = PrefillParts(4, gaps)
    for _ in range(20):
        fixed.observe(10 * MS, 0.0, 2, gaps.observe(10 * MS, False, 2))
    fixed.observe(500 * MS, 100.0, 2, gaps.observe(500 * MS, True, 2))
    assert fixed.parts(256, 2) == 4 and fixed.parts(256, 100) == 4 and fixed.rate is None
    with pytest.raises(ValueError):
        PrefillParts(None, gaps, ratio=1.0)


def test_the_parts_per_backend_and_as_set(monkeypatch):
    assert choices.prefill_parts(EngineConfig()) == choices.PREFILL_PARTS["cpu"] == 1
    assert choices.prefill_parts(EngineConfig(prefill_parts="8")) == 8
    assert choices.prefill_parts(EngineConfig(prefill_parts=3)) == 3
    assert choices.prefill_parts(EngineConfig(prefill_parts="adaptive")) is None
    # never learned in a group: each rank's own clock would make their plans differ
    assert choices.prefill_parts(EngineConfig(prefill_parts="adaptive"), grouped=True) == 1
    monkeypatch.setitem(choices.PREFILL_PARTS, "cpu", None)  # a backend whose auto is adaptive
    assert choices.prefill_parts(EngineConfig()) is None
    assert choices.prefill_parts(EngineConfig(), grouped=True) == 1
    with pytest.raises(ValueError, match="prefill_parts"):
        choices.prefill_parts(EngineConfig(prefill_parts="17"))
    assert Settings().prefill_parts == "auto"
    assert Settings(prefill_parts="adaptive").prefill_parts == "adaptive"
    with pytest.raises(ValueError, match="prefill_parts"):
        Settings(prefill_parts="0")


def test_adaptive_parts_learn_from_the_engines_turns_with_the_same_tokens(make_engine):
    # On this CPU a 64-token chunk over hundreds of cached tokens is several decode steps
    # long: once one is measured, later chunks go in parts (how many depends on the machine's
    # load, which moves the chunks' cost and the steps' gaps alike: 3-8 seen). The streams
    # decode 400 tokens, so they outlast the prompt's chunks however many parts a loaded
    # machine's timings teach (with 120 a busy CI machine's learned parts outran them once:
    # the last chunks went in whole, beside nobody).
    auto, staged, engine = _serve(make_engine, "adaptive", 600, 400, first_tokens=6)
    whole, staged_whole, _ = _serve(make_engine, 1, 600, 400, first_tokens=6)
    assert auto == whole
    assert staged_whole == 0 and staged >= 9 * (START - 1), staged  # nine chunks beside
    learned = engine._core.scheduler.parts
    assert learned.rate is not None and learned.rate > 0
    assert learned.gaps.reference(2) is not None  # the two streams' own gaps
    assert learned.parts(64, 2) > 1
