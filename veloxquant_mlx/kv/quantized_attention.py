"""Decode attention that reads quantized K and V where they lie (``--quantized-attention fused``).

The quantized dense layout's default (``mlx``) is mlx_lm's quantized attention: a product of
the queries with the K codes (``mx.quantized_matmul``), a mask, a softmax, a product with the V
codes, a handful of launches a layer. On MLX's CUDA backend (0.32) those products take only
contiguous operands, so every row is read to the working set's capacity and masked past its
own length; at 128 rows the two products ran far from the bandwidth their bytes need; and each
4-bit product is compiled the first time a server meets it, about 20 s apiece (BENCHMARKS.md).

``fused`` attends in one kernel a layer (``mx.fast.cuda_kernel``; sources in
``kv.quantized_kernels``): one thread block per row and KV head, ``WARPS`` warps over the row's
own positions, 32 positions a warp at a time (``tile``: a lane scores its own position for every
query head of the KV head's group from the K codes, then the warp reads the tile's V codes lanes
over the head's dims), dequantizing from the codes, each group's scale and bias (``w = scale * q
+ bias``, MLX's affine codes, ``32 / bits`` values a word from the low bits up): a running
softmax per query head, the warps' partials combined through shared memory; scores and sums in
float32. Codes whose groups do not fill 16-byte words take the ``plain`` kernel (a warp per
position). Elsewhere ``fused`` computes the same attention in MLX ops (``reference``: the codes
through ``mx.quantized_matmul``, masked by each row's length), so the routing is the same on
every backend and is what the CPU tests run; the kernel runs only on CUDA, where the start check
(``kv.quantized_check.check_kernels``) compares it with the dequantized attention and
``benchmarks.step_anatomy`` measures it (its source also runs on a CPU through the tests'
emulation, ``tests/engine/cuda_emulation.py``). With a residual window (``--kv-recent-tokens``)
a second kernel reads each row's newest positions from its ring instead of its codes. With few
rows over long contexts (an agent's few sessions) a block per row and KV head would leave most
of the device idle, so a row's positions are split over up to ``MAX_SPLITS`` blocks
(``splits_for``), each writing an unnormalised partial that ``combine_partials`` joins.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv import paged_attention
from veloxquant_mlx.kv.paged_attention import _HEADER, WARPS
from veloxquant_mlx.kv.quantized_kernels import SOURCES, STEPS, tile_runs

# ``splits_for``: split until the blocks reach this many (about two per SM of an H100 / H200) ...
TARGET_BLOCKS = 256
# ... while each split keeps at least this many positions, and never into more than MAX_SPLITS
MIN_SPLIT_POSITIONS = 512
MAX_SPLITS = 32


def splits_for(blocks: int, width: int) -> int:
    """Blocks a row's positions are split over, a power of two: 1 where ``blocks`` (rows x KV
    heads) fill the device already or the rows are short."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and blocks * splits < TARGET_BLOCKS
        and width // (2 * splits) >= MIN_SPLIT_POSITIONS
    ):
        splits *= 2
    return splits


def combine_partials(
    top: mx.array, total: mx.array, acc: mx.array, dim: int, dtype: mx.Dtype
) -> mx.array:
    """The split kernel's partials (``top``/``total [rows, HQ, splits]``, ``acc [rows, HQ,
    splits, D]``, float32; an empty split has top -1e30 and total 0) joined into the attention's
    output ``[rows, HQ, 1, D]`` in ``dtype``."""
    rows, n_q, splits = top.shape
    acc = acc.reshape(rows, n_q, splits, dim)
    weight = mx.exp(top - top.max(axis=-1, keepdims=True))
    out = (acc * weight[..., None]).sum(axis=-2) / (total * weight).sum(axis=-1, keepdims=True)
    return out.reshape(rows, n_q, 1, dim).astype(dtype)


def kernel_runs(head_dim: int, group: int, group_size: int) -> bool:
    """Whether ``fused`` runs the kernel here: where the paged kernel would
    (``paged_attention.kernel_runs``: MLX's CUDA backend, a head dim of whole warps, the warps'
    partials for ``group`` query heads per KV head in shared memory), with each lane's values
    inside one quantization group. Elsewhere it runs the same attention in MLX ops
    (``reference``)."""
    return paged_attention.kernel_runs(head_dim, group) and group_size % (head_dim // 32) == 0


class QuantizedAttention:
    """The kernels (without and with a residual window, split or not over positions) and their
    constant input (the scale), made at first use; one per ``QuantizedDenseKV``. ``step``: how
    a block's warps take the positions (``kv.quantized_kernels``): ``tile`` (32 positions a
    warp, the server's) where the codes allow it (``tile_runs``), else ``plain`` (a warp per
    position, and ``benchmarks``' yardstick). Engine thread only."""

    def __init__(self, step: str = "tile") -> None:
        if step not in STEPS:
            raise ValueError(f"the kernels' step is one of {', '.join(STEPS)}, got {step!r}")
        self.step = step
        self._kernels: dict[tuple[bool, bool, str], Any] = {}  # (window, split, step) -> kernel
        self._scales: dict[float, mx.array] = {}

    def _kernel(self, window: bool, split: bool, step: str) -> Any:
        got = self._kernels.get((window, split, step))
        if got is None:
            ring = ["rk", "rv"] if window else []
            got = self._kernels[(window, split, step)] = mx.fast.cuda_kernel(
                name=f"vq_quantized_decode_{step}"
                + ("_window" if window else "")
                + ("_split" if split else ""),
                input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", *ring, "lens", "scale"],
                output_names=["acc_out", "top_out", "total_out"] if split else ["out"],
                source=SOURCES[(window, split, step)],
                header=_HEADER,
            )
        return got

    def _scale(self, scale: float) -> mx.array:
        constant = self._scales.get(scale)
        if constant is None:
            constant = self._scales[scale] = mx.array([scale], dtype=mx.float32)
        return constant

    def __call__(
        self,
        queries: mx.array,
        keys: tuple[mx.array, ...],
        values: tuple[mx.array, ...],
        lens: mx.array,
        scale: float,
        bits: int,
        group_size: int,
        ring: tuple[mx.array, mx.array] | None = None,
        width: int = 0,
        splits: int | None = None,
    ) -> mx.array:
        """One new token per row over each row's first ``lens`` positions: ``queries [rows,
        HQ, 1, D]``; ``keys``/``values`` the layer's working set as stored, ``(codes, scales,
        biases)`` of ``[R, HKV, capacity, D * bits / 32]`` (uint32) and ``[R, HKV, capacity,
        D / group_size]`` with ``R >= rows`` (the new token in place); ``lens [rows]`` int32.
        With ``ring`` (a residual window: ``[R, HKV, recent, D]`` each, position ``p`` in slot
        ``p % recent``, the queries' dtype) each row's newest ``recent`` positions are read from
        it instead of the codes, one softmax over both (what ``kv.quantized.QuantizedDenseKV
        .attend`` computes in MLX ops). ``width``: the longest row's length, which with the rows
        decides the split over positions (``splits_for``; ``splits`` overrides it). Returns
        ``[rows, HQ, 1, D]`` in the queries' dtype. CUDA only (``kernel_runs``); lazy, like any
        MLX op."""
        rows, n_q, _, dim = queries.shape
        n_kv = keys[0].shape[1]
        if splits is None:
            splits = splits_for(rows * n_kv, width)
        template: list[tuple[str, Any]] = [
            ("T", queries.dtype),
            ("D", dim),
            ("HKV", n_kv),
            ("G", n_q // n_kv),
            ("BITS", bits),
            ("GS", group_size),
        ]
        if ring is not None:
            template.append(("RECENT", ring[0].shape[2]))
        if splits > 1:
            template.append(("SPLITS", splits))
        template.append(("WARPS", WARPS))
        step = self.step if self.step != "tile" or tile_runs(bits, group_size) else "plain"
        kernel = self._kernel(ring is not None, splits > 1, step)
        common = {
            "inputs": [queries, *keys, *values, *(ring or ()), lens, self._scale(scale)],
            "template": template,
            "grid": (WARPS * 32, n_kv, rows * splits),
            "threadgroup": (WARPS * 32, 1, 1),
        }
        if splits == 1:
            (out,) = kernel(
                **common, output_shapes=[(rows, n_q, 1, dim)], output_dtypes=[queries.dtype]
            )
            return out
        acc, top, total = kernel(
            **common,
            output_shapes=[(rows, n_q, splits * dim), (rows, n_q, splits), (rows, n_q, splits)],
            output_dtypes=[mx.float32] * 3,
        )
        return combine_partials(top, total, acc, dim, queries.dtype)


def reference(
    queries: mx.array,
    keys: tuple[mx.array, ...],
    values: tuple[mx.array, ...],
    lens: mx.array,
    scale: float,
    bits: int,
    group_size: int,
) -> mx.array:
    """``QuantizedAttention`` in MLX ops, on any backend (the same arguments): mlx_lm's quantized
    attention (``mx.quantized_matmul``) over each row's whole capacity, masked past its own
    length. What ``fused`` runs where the kernel does not."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    rows = queries.shape[0]
    seen = mx.arange(keys[0].shape[2])[None, :] < lens[:, None]
    kw, ks, kb = (p[:rows] for p in keys)
    vw, vs, vb = (p[:rows] for p in values)
    return quantized_scaled_dot_product_attention(
        mx.array(queries),  # (it scales its queries in place)
        (kw, ks, kb),
        (vw, vs, vb),
        scale,
        seen[:, None, None, :],
        group_size,
        bits,
    )


def float_attention(
    queries: mx.array, keys: mx.array, values: mx.array, seen: mx.array, scale: float
) -> mx.array:
    """One query per row over ``keys``/``values [rows, HKV, L, D]`` where ``seen [rows, L]``,
    in float32 products: the start check's yardstick, which no quantized product enters.
    Returns ``[rows, HQ, 1, D]`` in the queries' dtype."""
    rows, n_heads, _, dim = queries.shape
    n_kv = keys.shape[1]
    q = queries.astype(mx.float32).reshape(rows, n_kv, n_heads // n_kv, dim) * scale
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # [rows, kv, group, L]
    scores = mx.where(seen[:, None, None, :], scores, mx.array(-float("inf"), mx.float32))
    out = mx.softmax(scores, axis=-1) @ values.astype(mx.float32)
    return out.reshape(rows, n_heads, 1, -1).astype(queries.dtype)


def dequantized(
    queries: mx.array,
    keys: tuple[mx.array, ...],
    values: tuple[mx.array, ...],
    lens: mx.array,
    scale: float,
    bits: int,
    group_size: int,
) -> mx.array:
    """The same attention over the codes dequantized (``mx.dequantize``, then
    ``float_attention``)."""
    rows = queries.shape[0]
    kw, ks, kb = (p[:rows] for p in keys)
    vw, vs, vb = (p[:rows] for p in values)
    k = mx.dequantize(kw, ks, kb, group_size=group_size, bits=bits)
    v = mx.dequantize(vw, vs, vb, group_size=group_size, bits=bits)
    seen = mx.arange(k.shape[2])[None, :] < lens[:, None]
    return float_attention(queries, k, v, seen, scale)
