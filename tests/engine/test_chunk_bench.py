"""The chunk benchmark times ways of computing one thing: a prefill chunk's forward over a
cached context gives the same logits by every prefill attention route, and each route's
attention alone is MLX's own."""

from __future__ import annotations

import mlx.core as mx

from benchmarks.chunk_bench import attention_variants, chunk_logits
from benchmarks.models import build
from veloxquant_mlx.engine.loop import last_logits
from veloxquant_mlx.kv import attention


def test_every_route_gives_one_chunks_logits_and_attention():
    model = build("tiny")
    attention.install(model)
    last_logits.install(model)
    stock = chunk_logits(model, 300, 24, None)
    for route in ("exp", "exp2", "buckets"):
        ours = chunk_logits(model, 300, 24, route)
        assert mx.allclose(ours, stock, atol=1e-4).item(), route
    # a different context does change them: the comparison can fail
    assert not mx.allclose(chunk_logits(model, 301, 24, None), stock, atol=1e-4).item()
    found = attention_variants(model, 200, 40, repeats=1)
    assert set(found) == {"sdpa", "grouped", "passes", "buckets"}
    assert all(diff < 1e-4 for _, _, diff in found.values()), found
