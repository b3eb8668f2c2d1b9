"""``--prefill-parts``: while rows decode, a prompt's chunk is launched over several engine
turns, a run of its layers a turn, with their decode steps between. Every request gets the
same greedy tokens as with the chunk launched whole (dense, paged and int8 KV); the chunks'
launches were spread over turns; nothing is planned meanwhile; a request that leaves while its
chunk is being launched leaves nothing behind. The parts themselves: the hidden states that
end each run of layers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.engine.conftest import cancelled_while, long_prompt_beside_two_streams
from veloxquant_mlx.engine.loop import layer_capture


def _serve(make_engine, parts: int, **overrides) -> tuple[list[list[int]], int]:
    """Two short requests decoding, then a 300-token prompt arriving (chunks of 64 beside
    them); every request's tokens, and the turns that began with a chunk being launched."""
    box: dict = {"staging": 0}

    def hook() -> None:  # engine thread, before each turn
        if "engine" in box and box["engine"]._core.runner.staging():
            box["staging"] += 1

    engine = make_engine(
        kv_cache_mb=32, prefill_budget=64, prefix_caching=False, prefill_parts=parts,
        step_hook=hook, **overrides,
    )  # fmt: skip
    box["engine"] = engine
    out = long_prompt_beside_two_streams(engine, seed=5, prompt_tokens=300, stream_tokens=60)
    return out, box["staging"]


@pytest.mark.parametrize(
    "kv", [{}, {"kv_layout": "paged"}, {"kv_format": "int8"}], ids=["dense", "paged", "int8"]
)
def test_a_chunk_launched_in_parts_gives_the_same_tokens(make_engine, kv):
    whole, staged_whole = _serve(make_engine, 1, **kv)
    parts, staged = _serve(make_engine, 4, **kv)
    assert parts == whole
    assert [len(t) for t in parts] == [60, 60, 8]
    assert staged_whole == 0
    # five chunks of the long prompt beside the decoding rows, three turns of parts each
    assert staged >= 5 * 3, staged


def test_parts_on_a_stream_of_their_own_give_the_same_tokens(make_engine):
    whole, _ = _serve(make_engine, 1, prefill_stream="on")
    parts, staged = _serve(make_engine, 2, prefill_stream="on")
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
