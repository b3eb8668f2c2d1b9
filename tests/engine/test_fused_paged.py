"""``--paged-attention fused``: attention through the block tables gives stock mlx_lm's tokens.

On this CPU ``fused`` runs ``paged_attention.reference`` (the kernel's arguments, in MLX ops); on
MLX's CUDA backend the kernel, whose tokens ``benchmarks.single_stream`` checks against stock. The
routing (the fetched K and V are the new token only, attention reads the store) is the same on
both, and is what these tests run: every layer of every decode step must have attended through
the tables, and a model it cannot serve must be refused at load, not answered wrongly.
"""

from __future__ import annotations

import random

import mlx.core as mx

from tests.engine.conftest import refused_at_start
from tests.engine.test_layouts import (  # noqa: F401 (arch_model: a fixture)
    arch_model,
    serve_greedy,
    stock_tokens,
)
from veloxquant_mlx.engine.hosts.thread import EngineConfig
from veloxquant_mlx.kv import paged_attention


def test_fused_matches_stock_with_rows_joining_and_leaving(arch_model, monkeypatch):  # noqa: F811
    path, model = arch_model
    if "sliding" in path.name:
        assert_refused(path, "paged-attention gather", kv_layout="paged")
        return
    calls: list[int] = []
    real = paged_attention.reference

    def counted(queries, *args):
        calls.append(queries.shape[0])
        return real(queries, *args)

    monkeypatch.setattr(paged_attention, "reference", counted)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 23, 9, 41, 3, 17, 30, 12)]
    lengths = [12, 5, 20, 9, 16, 3, 11, 7]
    ours = serve_greedy(path, prompts, lengths, kv_layout="paged", paged_attention="fused")
    for p, n, got in zip(prompts, lengths, ours, strict=True):
        assert got == stock_tokens(model, p, n)
    layers = len(model.layers)
    # every decode step attended through the tables in every layer, multi-row steps included
    assert calls and len(calls) % layers == 0 and max(calls) > 1


def test_reference_reads_each_rows_blocks_through_its_table():
    """``reference`` (what the kernel computes) against attention over each row's own
    contiguous K and V, with rows of different lengths, blocks out of order and the new token
    given apart from the store."""
    rng = random.Random(11)
    heads, q_heads, dim, bs, n_layers = 2, 4, 8, 4, 2
    lens = [1, 6, 13]
    n_blocks = 4
    n_ids = 2 * n_layers * len(lens) * n_blocks + 1
    mx.random.seed(0)
    store = mx.random.normal((n_ids * heads * bs, dim))
    ids = list(range(n_ids - 1))
    rng.shuffle(ids)
    tabs = mx.array(ids[: 2 * n_layers * len(lens) * n_blocks]).reshape(
        2 * n_layers, len(lens), n_blocks
    )
    rows = len(lens)
    queries = mx.random.normal((rows, q_heads, 1, dim))
    k_new = mx.random.normal((rows, heads, 1, dim))
    v_new = mx.random.normal((rows, heads, 1, dim))
    layer = 1
    got = paged_attention.reference(
        queries, k_new, v_new, store, tabs, layer, mx.array(lens), 0.5, bs
    )
    blocks = store.reshape(-1, heads, bs, dim)
    for r, n in enumerate(lens):
        parts = []
        for s, new in ((0, k_new), (1, v_new)):
            table = tabs[2 * layer + s, r].tolist()
            x = mx.concatenate([blocks[b] for b in table], axis=1)[:, : n - 1]  # [H, n-1, D]
            parts.append(mx.concatenate([x, new[r]], axis=1)[None])
        want = mx.fast.scaled_dot_product_attention(
            queries[r : r + 1], parts[0], parts[1], scale=0.5
        )
        assert mx.allclose(got[r : r + 1], want, atol=1e-5).item()


def test_fused_needs_the_paged_layout(arch_model):  # noqa: F811
    path, _ = arch_model
    assert_refused(path, "needs --kv-layout paged", kv_layout="dense")


def assert_refused(path, match: str, **config) -> None:
    """An engine of ``--paged-attention fused`` and ``config`` fails to start, saying ``match``."""
    refused_at_start(
        EngineConfig(model=str(path), paged_attention="fused", **config), match, ValueError
    )
