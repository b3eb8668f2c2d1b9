"""The attention benchmark compares ways of computing one thing: over ragged rows every method
but ``uniform`` gives the masked attention mlx_lm's caches ask for, alone and inside a model
step through the engine's ``StepCache``."""

from __future__ import annotations

import mlx.core as mx

from benchmarks.attention_bench import _MASKS, build_model, methods, model_step


def test_every_ragged_method_computes_the_masked_attention():
    mx.random.seed(1)
    rows, hq, hkv, d, width = 5, 4, 2, 16, 40
    lengths = [40, 7, 23, 1, 39]
    q = mx.random.normal((rows, hq, 1, d))
    k = mx.random.normal((rows, hkv, width, d))
    v = mx.random.normal((rows, hkv, width, d))
    _MASKS.clear()
    found = {name: fn(q, k, v, d**-0.5, lengths) for name, fn in methods().items()}
    # the reference, written out: row i attends to its first lengths[i] keys
    expected = []
    for i, n in enumerate(lengths):
        kk = mx.repeat(k[i, :, :n], hq // hkv, axis=0)
        vv = mx.repeat(v[i, :, :n], hq // hkv, axis=0)
        w = mx.softmax((q[i] @ kk.swapaxes(-1, -2)) * d**-0.5, axis=-1)
        expected.append(w @ vv)
    expected_all = mx.stack(expected)
    for name in ("bool", "additive", "rows", "cudnn2", "matmul"):
        assert found[name].shape == (rows, hq, 1, d)
        assert mx.allclose(found[name], expected_all, atol=1e-5).item(), name
    # and the floor is not: rows shorter than the width see keys they must not
    assert not mx.allclose(found["uniform"], expected_all, atol=1e-3).item()


def test_a_model_step_gives_the_same_logits_whichever_way_it_attends():
    model, config = build_model("tiny", mx.float32)
    out = model_step(model, config, rows=3, width=40, repeats=1, dtype=mx.float32)
    for name in ("additive", "rows", "cudnn2", "matmul"):
        assert out[f"step_{name}_maxdiff"] < 1e-4, (name, out)
        assert out[f"step_{name}_ms"] > 0
