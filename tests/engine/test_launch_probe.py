"""The launch probe times a real decode: every layout and launch mode gives generate_step's
greedy tokens (its first row's), with the store sized as asked."""

from __future__ import annotations

import mlx.core as mx
import pytest

from benchmarks.launch_probe import run
from benchmarks.single_stream import prefill


@pytest.mark.parametrize("mode", ["ahead", "after", "sync"])
@pytest.mark.parametrize("layout, extra_mb", [("paged", 0.0), ("paged", 2.0), ("dense", 0.0)])
def test_each_mode_decodes_what_generate_step_does(default_model, layout, extra_mb, mode):
    from mlx_lm.generate import generate_step

    model, _ = default_model
    prompt = [3 + (7 * i) % 1997 for i in range(37)]
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12)]
    _, layers, y0 = prefill(model, prompt)
    result, tokens = run(model, layers, y0, 2, layout, mode, extra_mb, 12)
    assert tokens == expected
    assert result["rows"] == 2 and result["tok_s"] > 0
    if layout == "paged":
        assert result["store_mib"] >= extra_mb
