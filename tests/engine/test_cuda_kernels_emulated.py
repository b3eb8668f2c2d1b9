"""The CUDA kernels (``kv.quantized_attention``'s, without and with a residual window, and
``kv.paged_attention``'s), which run only on MLX's CUDA backend, run here through
``cuda_emulation`` (every CUDA thread a CPU thread) on real inputs: their output equals the same
attention in MLX ops (over the dequantized codes; with a window, ``QuantizedDenseKV.attend``'s
own computation; the paged kernel's ``reference``), rows at their own lengths, int8 and int4,
grouped query heads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.engine.cuda_emulation import compiler, emulate
from veloxquant_mlx.kv import codec as kv_codec
from veloxquant_mlx.kv import quantized_attention, quantized_kernels
from veloxquant_mlx.kv.quantized import QuantizedDenseKV

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler here")


@pytest.mark.parametrize(
    ("bits", "dim", "n_kv", "per_kv", "lengths", "recent", "splits"),
    [
        (8, 128, 2, 4, [9, 300], 0, 1),
        (4, 64, 2, 2, [5, 131, 40], 0, 1),
        (8, 128, 2, 4, [9, 300], 16, 1),
        (4, 64, 2, 2, [5, 131, 40], 32, 1),  # a window longer than a row
        (8, 128, 2, 4, [9, 300], 0, 2),  # split over positions
        (4, 64, 2, 2, [5, 131, 40], 0, 4),  # a row of 5 in 4 splits: one empty
        (8, 64, 1, 4, [3, 77], 16, 4),  # split, with a window
    ],
)
@pytest.mark.parametrize("step", quantized_kernels.STEPS)
def test_the_kernel_computes_what_the_mlx_ops_do(
    tmp_path, bits, dim, n_kv, per_kv, lengths, recent, splits, step
):
    _check_kernel(tmp_path, bits, dim, n_kv, per_kv, lengths, recent, splits, step)


@pytest.mark.parametrize(
    ("per_kv", "recent", "splits"), [(1, 0, 1), (8, 0, 2), (3, 8, 1), (6, 0, 1), (32, 0, 1)]
)
def test_the_tile_step_takes_any_group_of_query_heads(tmp_path, per_kv, recent, splits):
    """The tile step's scores for groups of 1, 8 and 32 query heads a KV head, and of 3 and 6
    (not powers of two), with a window and a split."""
    _check_kernel(tmp_path, 8, 64, 1, per_kv, [7, 90], recent, splits, "tile")


@pytest.mark.parametrize(
    ("bits", "dim", "group", "per_kv", "lengths", "recent", "splits"),
    [
        (8, 64, 32, 3, [1, 33, 64, 65], 0, 1),  # tiles cut at 32: one lane, a full one, one over
        (4, 64, 32, 1, [300, 31], 8, 1),  # a window, one tile reading ring and codes
        (8, 64, 64, 8, [257, 2], 0, 4),  # more positions than the block's warps take at once
        (4, 32, 32, 2, [40, 3], 0, 1),  # 32-wide heads: one value a lane
    ],
)
def test_the_tile_step_at_tile_edges_and_groups(
    tmp_path, bits, dim, group, per_kv, lengths, recent, splits
):
    """The ``tile`` kernels around a tile's 32 positions (a row of one, of 33, of 65), groups
    of 32 codes, odd query-head groups, a window inside one tile, a row longer than the
    block's warps take in one pass (8 x 32), heads 32 wide."""
    _check_kernel(tmp_path, bits, dim, 2, per_kv, lengths, recent, splits, "tile", group)


def test_the_tile_step_takes_codes_in_whole_words():
    assert quantized_kernels.tile_runs(8, 32) and quantized_kernels.tile_runs(4, 32)
    assert quantized_kernels.tile_runs(4, 64) and quantized_kernels.tile_runs(8, 128)
    assert not quantized_kernels.tile_runs(2, 32) and not quantized_kernels.tile_runs(4, 16)


def _check_kernel(tmp_path, bits, dim, n_kv, per_kv, lengths, recent, splits, step, group=None):
    codec = kv_codec.parse(f"int{bits}", "float32", dim, group)
    kv = QuantizedDenseKV(1, codec, recent=recent)
    for row, n in enumerate(lengths):
        x = mx.random.normal((1, n_kv, n, dim), key=mx.random.key(row))
        kv.put_row(row, [(x, x * 0.7 + 0.1)], None)
    batch = kv.step_batch(lengths)
    kv.begin_step(batch, 0)
    new = mx.random.normal((len(lengths), n_kv, 1, dim), key=mx.random.key(50))
    kv.write_read(0, new, new * 0.5, batch)
    q = mx.random.normal((len(lengths), n_kv * per_kv, 1, dim), key=mx.random.key(9))
    scale, lens = dim**-0.5, batch.positions + 1
    if recent:
        want = kv.attend(0, q, None, None, scale)
    else:
        want = quantized_attention.dequantized(
            q, kv.qk[0], kv.qv[0], lens, scale, bits, codec.group_size
        )
    names = ("kw", "ks", "kb", "vw", "vs", "vb")
    parts = (*kv.qk[0], *kv.qv[0])
    inputs = {"q": np.array(q), **{n: np.array(p) for n, p in zip(names, parts, strict=True)}}
    if recent:
        inputs |= {"rk": np.array(kv.rk[0]), "rv": np.array(kv.rv[0])}
    inputs |= {"lens": np.array(lens), "scale": np.array([scale], dtype=np.float32)}
    template = {"D": dim, "HKV": n_kv, "G": per_kv, "BITS": bits, "GS": codec.group_size}
    if recent:
        template["RECENT"] = recent
    if splits > 1:
        template["SPLITS"] = splits
    template["WARPS"] = quantized_attention.WARPS
    source = quantized_kernels.SOURCES[(bool(recent), splits > 1, step)]
    rows, n_q = len(lengths), n_kv * per_kv
    if splits == 1:
        outputs = {"out": int(np.prod(want.shape))}
    else:
        outputs = {"acc_out": rows * n_q * splits * dim, "top_out": rows * n_q * splits}
        outputs["total_out"] = rows * n_q * splits
    result = emulate(
        source,
        inputs,
        template,
        outputs,
        (n_kv, rows * splits),
        quantized_attention.WARPS * 32,
        tmp_path,
    )
    if splits == 1:
        got = result["out"].reshape(want.shape)
    else:
        got = np.array(
            quantized_attention.combine_partials(
                mx.array(result["top_out"]).reshape(rows, n_q, splits),
                mx.array(result["total_out"]).reshape(rows, n_q, splits),
                mx.array(result["acc_out"]).reshape(rows, n_q, splits * dim),
                dim,
                mx.float32,
            )
        )
    assert np.abs(got - np.array(want)).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize(
    ("dim", "n_kv", "per_kv", "lengths"), [(64, 2, 4, [1, 37, 70]), (128, 1, 2, [16, 33])]
)
def test_the_paged_kernel_computes_what_its_reference_does(tmp_path, dim, n_kv, per_kv, lengths):
    """``--paged-attention fused``'s kernel (``kv.paged_attention``) the same way: rows reading
    their blocks through shuffled tables, the step's new token from the layer's new K and V."""
    from veloxquant_mlx.kv import paged_attention

    block, n_layers, layer = 16, 2, 1
    rows, per_row = len(lengths), -(-max(lengths) // block)
    n_blocks = 2 * n_layers * rows * per_row
    store = mx.random.normal((n_blocks * n_kv * block, dim), key=mx.random.key(1))
    ids = np.random.default_rng(0).permutation(n_blocks).astype(np.int32)
    tabs = mx.array(ids.reshape(2 * n_layers, rows, per_row))
    q = mx.random.normal((rows, n_kv * per_kv, 1, dim), key=mx.random.key(2))
    kn = mx.random.normal((rows, n_kv, 1, dim), key=mx.random.key(3))
    vn = mx.random.normal((rows, n_kv, 1, dim), key=mx.random.key(4))
    lens = mx.array(lengths, dtype=mx.int32)
    scale = dim**-0.5
    want = paged_attention.reference(q, kn, vn, store, tabs, layer, lens, scale, block)
    inputs = {
        "q": np.array(q),
        "kn": np.array(kn),
        "vn": np.array(vn),
        "store": np.array(store),
        "tabs": np.array(tabs),
        "layer": np.array([layer], dtype=np.int32),
        "lens": np.array(lens),
        "scale": np.array([scale], dtype=np.float32),
    }
    template = {"D": dim, "BS": block, "HKV": n_kv, "G": per_kv, "WARPS": paged_attention.WARPS}
    got = emulate(
        paged_attention._SOURCE,
        inputs,
        template,
        {"out": int(np.prod(want.shape))},
        (n_kv, rows),
        paged_attention.WARPS * 32,
        tmp_path,
    )["out"].reshape(want.shape)
    assert np.abs(got - np.array(want)).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
