"""The quantized layout's start checks: a route's output against the dequantized attention
(``check_kernels``) and what a residual window costs (``window_bytes``). Engine thread, at load.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.kv import quantized_attention
from veloxquant_mlx.kv.codec import KVCodec
from veloxquant_mlx.kv.quantized import QuantizedDenseKV

# A quantized attention's output against the dequantized attention at start: the largest
# difference as a fraction of the largest output. mlx_lm's on a CPU in bfloat16 (its scores in
# the model's type) is within 3% (float16 0.4%, float32 0); a wrong one is off by its whole size
# (MLX 0.32.4's CUDA route: 1.2-1.4x; BENCHMARKS.md). A quarter leaves another backend's
# rounding room and still catches a route that reads the wrong codes.
ROUTE_TOLERANCE = 0.25


def window_bytes(n_layers: int, heads: int, head_dim: int, codec: KVCodec, recent: int) -> int:
    """Bytes one row's residual window takes in one stream (K, or V, of every layer, in the
    model's type)."""
    return n_layers * heads * head_dim * recent * codec.dtype.size


def check_kernels(
    codec: KVCodec, n_heads: int, n_kv_heads: int, head_dim: int, recent: int = 0,
    kernel: bool = False,
) -> None:  # fmt: skip
    """Run a decode step's quantized attention through this layout once for this geometry: one
    row (a step without a mask) and two rows at different lengths (masked; the longer pair split
    over positions where the kernel runs), read as the engine's steps read them, by the route
    the server will take (``kernel``: ``--quantized-attention fused``). A backend may lack a
    kernel for some operands (MLX 0.32's CUDA ``quantized_matmul`` refused a row's first
    positions of a longer buffer) or compute a wrong one (the same backend's quantized attention
    was off by more than its own size: BENCHMARKS.md), and a format that cannot run right must
    be refused at start, not serve wrong tokens: without a window, the step's output must agree
    with the same attention over the dequantized codes (``kv.quantized_attention.dequantized``)
    within ``ROUTE_TOLERANCE`` (a window's: the dequantized codes and the ring).

    Raises:
        ValueError: One line naming the format, the shape and what to try.
    """
    if not codec.quantized:
        return
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    bits, group, scale = codec.bits or 8, codec.group_size, head_dim**-0.5
    for lengths in ([9], [9, 300], [9, 1100]):  # the last split over positions on CUDA
        kv = QuantizedDenseKV(1, codec, recent=recent, kernel=kernel)
        rows = len(lengths)
        try:
            for row, n in enumerate(lengths):
                x = mx.random.normal((1, n_kv_heads, n, head_dim), key=mx.random.key(row))
                kv.put_row(row, [(x.astype(codec.dtype), x.astype(codec.dtype))], None)
            batch = kv.step_batch(lengths)
            kv.begin_step(batch, 0)
            new = mx.ones((rows, n_kv_heads, 1, head_dim), dtype=codec.dtype)
            keys, values = kv.write_read(0, new, new, batch)
            queries = mx.random.normal((rows, n_heads, 1, head_dim), key=mx.random.key(7))
            queries = queries.astype(codec.dtype)
            if kv.fused:
                out = kv.attend(0, queries, keys, values, scale)
            else:  # (mlx_lm scales its queries in place: a copy)
                out = quantized_scaled_dot_product_attention(
                    mx.array(queries), keys, values, scale, batch.mask(None), group, bits
                )
            mx.eval(out)
        except (RuntimeError, ValueError) as exc:
            reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise ValueError(
                f"--kv-format {codec.name}: MLX on {mx.default_device()} cannot run quantized "
                f"attention for {head_dim}-wide heads at group size {group} "
                f"({reason}); try --kv-group-size {32 if group == 64 else 64} or "
                "--kv-format auto"
            ) from None
        lens = batch.positions + 1
        if recent:
            want = kv.window_reference(0, queries, scale).astype(mx.float32)
        else:
            want = quantized_attention.dequantized(queries, kv.qk[0], kv.qv[0], lens, scale,
                                                   bits, group).astype(mx.float32)  # fmt: skip
        gap = float(mx.abs(out.astype(mx.float32) - want).max())
        size = float(mx.abs(want).max())
        if not gap <= ROUTE_TOLERANCE * size:
            route = "fused" if kernel else "mlx"
            instead = "--quantized-attention " + ("mlx" if kernel else "fused")
            if recent:
                route, instead = "with a residual window", "--kv-recent-tokens 0"
            elif not kernel and not quantized_attention.kernel_runs(
                head_dim, n_heads // n_kv_heads, group
            ):
                instead = "--kv-format auto"
            raise ValueError(
                f"--kv-format {codec.name}: quantized attention ({route}) on "
                f"{mx.default_device()} differs from the dequantized attention by {gap:.3g} "
                f"(outputs up to {size:.3g}; {head_dim}-wide heads, group size {group}): "
                f"wrong on this backend; use {instead}"
            )
