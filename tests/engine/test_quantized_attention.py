"""``--quantized-attention fused`` (``kv.quantized_attention``): its MLX-ops route against the
dequantized attention, where the kernel runs, the start check that holds the kernel to the
dequantized attention, and the refusals. (Served tokens through the route: ``test_kv_format``
and ``test_kv_formats``.)"""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.engine.conftest import refused_at_start
from veloxquant_mlx.engine.hosts.thread import EngineConfig
from veloxquant_mlx.kv import codec as kv_codec
from veloxquant_mlx.kv import quantized_attention
from veloxquant_mlx.kv.attention import cuda_available
from veloxquant_mlx.kv.quantized import QuantizedDenseKV
from veloxquant_mlx.kv.quantized_check import check_kernels


def stored(rows: int, heads: int, width: int, dim: int, bits: int, group: int, seed: int):
    x = mx.random.normal((rows, heads, width, dim), key=mx.random.key(seed))
    return tuple(mx.quantize(x, group_size=group, bits=bits))


@pytest.mark.parametrize(("bits", "group", "per_kv"), [(8, 64, 4), (4, 32, 1), (4, 64, 2)])
def test_the_route_in_mlx_ops_is_the_dequantized_attention(bits, group, per_kv):
    """Rows at their own lengths inside one capacity: ``reference`` (what ``fused`` runs off
    CUDA: MLX's quantized products, masked per row) and the codes dequantized then attended in
    float32 agree, and a position past a row's length changes nothing."""
    rows, n_kv, dim, width = 3, 2, 64, 96
    keys = stored(rows, n_kv, width, dim, bits, group, 1)
    values = stored(rows, n_kv, width, dim, bits, group, 2)
    q = mx.random.normal((rows, n_kv * per_kv, 1, dim), key=mx.random.key(3))
    lens = mx.array([1, 40, 96], dtype=mx.int32)
    args = (q, keys, values, lens, dim**-0.5, bits, group)
    got = quantized_attention.reference(*args)
    want = quantized_attention.dequantized(*args)
    assert got.shape == (rows, n_kv * per_kv, 1, dim)
    assert mx.allclose(got, want, atol=1e-4).item()
    # row 0 sees only its first position: the output is that position's V
    first_v = mx.dequantize(*(p[0, :, :1] for p in values), group_size=group, bits=bits)
    assert mx.allclose(got[0, ::per_kv, 0], first_v[:, 0], atol=1e-4).item()
    # codes past each row's length are not read
    scrambled = tuple(
        mx.where(mx.arange(width)[None, None, :, None] >= 40, p[::-1], p) for p in keys
    )
    again = quantized_attention.reference(q, scrambled, values, lens, dim**-0.5, bits, group)
    assert mx.allclose(again[:2], got[:2]).item()


def test_the_kernel_runs_only_on_cuda_and_for_shapes_it_holds():
    on_cuda = cuda_available() and mx.default_device() == mx.gpu
    assert quantized_attention.kernel_runs(128, 4, 64) == on_cuda
    for dim, per_kv, group in ((48, 4, 64), (128, 64, 64), (256, 1, 4)):
        assert not quantized_attention.kernel_runs(dim, per_kv, group)


def test_the_start_check_holds_the_kernel_to_the_dequantized_attention(monkeypatch):
    """Where the kernel runs (CUDA) its output is compared with the dequantized attention at
    start; a kernel that reads the wrong codes refuses the start in one line. The kernel cannot
    run on this CPU, so a wrong one (attending over the values of the wrong rows) stands in."""
    codec = kv_codec.parse("int8", "bfloat16", 64, None)
    check_kernels(codec, 8, 2, 64, kernel=True)  # the route in MLX ops passes
    monkeypatch.setattr(quantized_attention, "kernel_runs", lambda *a: True)

    def wrong(self, queries, keys, values, lens, scale, bits, group, **kwargs):
        flipped = tuple(p[::-1] for p in values)
        return quantized_attention.reference(queries, keys, flipped, lens, scale, bits, group)

    monkeypatch.setattr(quantized_attention.QuantizedAttention, "__call__", wrong)
    with pytest.raises(ValueError, match="use --quantized-attention mlx") as info:
        check_kernels(codec, 8, 2, 64, kernel=True)
    assert "\n" not in str(info.value) and "differs from the dequantized" in str(info.value)


@pytest.mark.parametrize("kernel_here", [False, True])
def test_the_start_check_refuses_mlx_lms_route_where_it_computes_wrong(monkeypatch, kernel_here):
    """MLX 0.32.4's CUDA quantized attention was off by more than its own outputs' size; that
    cannot happen on this CPU, so a wrong one (the queries' sign flipped) stands in: the start
    is refused in one line that names what to use instead (the fused route where its kernel
    runs, else the model's own format). Each dtype's own route passes here."""
    from mlx_lm.models import base

    for dtype in ("bfloat16", "float16", "float32"):
        for fmt in ("int8", "int4"):
            check_kernels(kv_codec.parse(fmt, dtype, 128, None), 32, 8, 128)
    original = base.quantized_scaled_dot_product_attention

    def wrong(queries, *args, **kwargs):
        return original(-queries, *args, **kwargs)

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", wrong)
    monkeypatch.setattr(quantized_attention, "kernel_runs", lambda *a: kernel_here)
    instead = "--quantized-attention fused" if kernel_here else "--kv-format auto"
    with pytest.raises(ValueError, match=f"wrong on this backend; use {instead}") as info:
        check_kernels(kv_codec.parse("int8", "bfloat16", 128, None), 32, 8, 128)
    assert "\n" not in str(info.value)


def test_auto_takes_the_kernel_where_it_runs(monkeypatch):
    from veloxquant_mlx.engine.model.formats import Formats
    from veloxquant_mlx.engine.model.kv_routes import quantized_kernel

    int8 = kv_codec.parse("int8", "bfloat16", 128, None)
    bf16 = kv_codec.parse("auto", "bfloat16", 128, None)
    one = Formats(codecs={"int8": int8}, block=int8)
    none = Formats(codecs={"bfloat16": bf16}, block=bf16)
    on_cuda = cuda_available() and mx.default_device() == mx.gpu
    assert quantized_kernel("auto", one, 128, 4) == on_cuda
    assert quantized_kernel("fused", one, 128, 4) and not quantized_kernel("mlx", one, 128, 4)
    assert not quantized_kernel("auto", none, 128, 4)
    monkeypatch.setattr(quantized_attention, "kernel_runs", lambda *a: True)
    assert quantized_kernel("auto", one, 128, 4) and not quantized_kernel("auto", none, 128, 4)
    with pytest.raises(ValueError, match="needs --kv-format int8 or int4"):
        quantized_kernel("fused", none, 128, 4)


def test_a_step_through_the_route_reads_the_codes_where_they_lie():
    """The fused layout hands the model the new token only and attends over the working set
    itself: the step's output equals the dequantized attention over every row's codes with the
    new token written in place."""
    codec = kv_codec.parse("int4", "float32", 64, None)
    kv = QuantizedDenseKV(1, codec, kernel=True)
    assert kv.fused
    for row, n in enumerate((5, 70)):
        x = mx.random.normal((1, 2, n, 64), key=mx.random.key(row))
        kv.put_row(row, [(x, x * 0.5)], None)
    batch = kv.step_batch([5, 70])
    kv.begin_step(batch, 0)
    new = mx.random.normal((2, 2, 1, 64), key=mx.random.key(9))
    keys, values = kv.write_read(0, new, new, batch)
    assert keys is new and values is new  # the new token only
    q = mx.random.normal((2, 8, 1, 64), key=mx.random.key(4))
    got = kv.attend(0, q, keys, values, 0.125)
    lens = mx.array([6, 71], dtype=mx.int32)
    want = quantized_attention.dequantized(q, kv.qk[0], kv.qv[0], lens, 0.125, 4, codec.group_size)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_fused_without_a_quantized_format_is_refused_at_start(default_model_dir):
    refused_at_start(
        EngineConfig(model_cache_dir=str(default_model_dir.parent), quantized_attention="fused"),
        "--quantized-attention fused needs --kv-format",
    )


def test_the_start_check_holds_a_residual_window_to_its_dequantized_attention(monkeypatch):
    """With ``--kv-recent-tokens`` the step attends over codes and ring (MLX's quantized
    products for the codes, on every backend): it is compared with the same attention over the
    dequantized codes and the ring; a wrong one (the codes' scores flipped in sign) stands in
    for a backend that computes it wrong, and the start is refused in one line."""
    codec = kv_codec.parse("int8", "bfloat16", 128, None)
    for recent in (16, 512):  # a window inside the rows, and one past them
        check_kernels(codec, 32, 8, 128, recent)
    original = mx.quantized_matmul

    def wrong(x, *args, **kwargs):
        return (
            original(-x, *args, **kwargs)
            if kwargs.get("transpose")
            else original(x, *args, **kwargs)
        )

    monkeypatch.setattr(mx, "quantized_matmul", wrong)
    with pytest.raises(ValueError, match="use --kv-recent-tokens 0") as info:
        check_kernels(codec, 32, 8, 128, 16)
    assert "\n" not in str(info.value) and "with a residual window" in str(info.value)


def test_a_row_is_split_over_positions_only_where_blocks_are_few_and_rows_long():
    splits_for = quantized_attention.splits_for
    assert splits_for(128 * 8, 30_000) == 1  # 128 rows x 8 KV heads fill the device
    assert splits_for(4 * 8, 400) == 1  # short rows
    assert splits_for(4 * 8, 6_000) == 8  # 256 blocks, 750 positions each
    assert splits_for(1, 1_000_000) == quantized_attention.MAX_SPLITS
    for blocks, width in ((1, 2_048), (8, 30_000), (32, 1_100)):
        n = splits_for(blocks, width)
        assert n & (n - 1) == 0 and width // n >= quantized_attention.MIN_SPLIT_POSITIONS
