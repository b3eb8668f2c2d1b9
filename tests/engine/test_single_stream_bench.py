"""The single-stream benchmark's bare decode loop is the decode it claims to time: over stock
caches and over each ``StepCache`` layout it gives ``generate_step``'s greedy tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from benchmarks.single_stream import decode_loop


@pytest.mark.parametrize("layout", ["stock", "dense", "paged"])
def test_the_bare_loop_decodes_what_generate_step_does(default_model_dir, layout):
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(default_model_dir))
    prompt = [3 + (7 * i) % 1997 for i in range(37)]  # past two blocks of 16
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    rate, build_ms, tokens = decode_loop(model, prompt, 20, layout)
    assert tokens == expected
    assert rate > 0 and build_ms > 0
