"""Decode attention that reads quantized K and V where they lie (``--quantized-attention fused``).

The quantized dense layout's default (``mlx``) is mlx_lm's quantized attention: a product of
the queries with the K codes (``mx.quantized_matmul``), a mask, a softmax, a product with the V
codes, a handful of launches a layer. On MLX's CUDA backend (0.32) those products take only
contiguous operands, so every row is read to the working set's capacity and masked past its
own length; at 128 rows the two products ran far from the bandwidth their bytes need; and each
4-bit product is compiled the first time a server meets it, about 20 s apiece (BENCHMARKS.md).

``fused`` attends in one kernel a layer (``mx.fast.cuda_kernel``): one thread block per row and
KV head, ``WARPS`` warps over the row's own positions (position ``t`` to warp ``t % WARPS``), a
lane dequantizing ``head_dim / 32`` of each vector from its codes, its group's scale and bias
(``w = scale * q + bias``, MLX's affine codes, ``32 / bits`` values a word from the low bits
up), as ``kv.paged_attention``'s kernel reads floats: a running softmax per query head of the
KV head's group, the warps' partials combined through shared memory; scores and sums in
float32. Elsewhere ``fused`` computes the same attention in MLX ops (``reference``: the codes
through ``mx.quantized_matmul``, masked by each row's length), so the routing is the same on
every backend and is what the CPU tests run; the kernel runs only on CUDA, where the start
check (``kv.quantized_check.check_kernels``) compares it with the dequantized attention and
``benchmarks.step_anatomy`` measures it (its source also runs on a CPU through the tests'
emulation, ``tests/engine/cuda_emulation.py``). With a residual window (``--kv-recent-tokens``)
a second kernel reads each row's newest positions from its ring instead of its codes. With
few rows over long contexts (an agent's few sessions) a block per row and KV head would leave
most of the device idle, so a row's positions are split over up to ``MAX_SPLITS`` blocks
(``splits_for``), each writing an unnormalised partial that ``combine_partials`` joins.
"""

from __future__ import annotations

import textwrap
from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv import paged_attention
from veloxquant_mlx.kv.paged_attention import _COMBINE, _HEADER, _STATE, _STEP, WARPS

# The codes' layout and this lane's part of a vector; the kernel's block, row and KV head
_HEAD = """
    constexpr int E = D / 32;           // values a lane holds of each vector
    constexpr int PER = 32 / BITS;      // values a code word holds
    constexpr int WPOS = D * BITS / 32; // code words a position holds
    constexpr int NG = D / GS;          // groups (scale, bias) a position holds
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const int h = blockIdx.y;
    const int r = blockIdx.z;
    const int cap = kw_shape[2];
    const int len = lens[r];
    const float sc = scale[0];
    const size_t base = ((size_t)r * HKV + h) * (size_t)cap;  // the row's position 0
    const int i0 = lane * E;            // this lane's first value; all E in one group
    const int grp = i0 / GS;
"""
_LOOP = """    #pragma unroll 2
    for (int t = w; t < len; t += WARPS) {
        const size_t pos = base + t;
        float kx[E], vx[E];
"""
# One position's K and V, dequantized from the codes ...
_CODES_LOAD = """        const uint32_t* kp = kw + pos * WPOS;
        const uint32_t* vp = vw + pos * WPOS;
        const float ka = vq_float(ks[pos * NG + grp]);
        const float kc = vq_float(kb[pos * NG + grp]);
        const float va = vq_float(vs[pos * NG + grp]);
        const float vc = vq_float(vb[pos * NG + grp]);
        for (int e = 0; e < E; ++e) {
            const int i = i0 + e;
            const int shift = (i % PER) * BITS;
            kx[e] = ka * (float)((kp[i / PER] >> shift) & MASK) + kc;
            vx[e] = va * (float)((vp[i / PER] >> shift) & MASK) + vc;
        }
"""
# ... or, with a residual window, a row's newest RECENT positions from its ring instead
# (position p in slot p % RECENT of ``rk``/``rv [R, HKV, RECENT, D]``, the model's type)
_WINDOW_LOAD = (
    """        if (t >= len - RECENT) {
            const size_t slot = ((size_t)r * HKV + h) * RECENT + t % RECENT;
            for (int e = 0; e < E; ++e) {
                kx[e] = vq_float(rk[slot * D + i0 + e]);
                vx[e] = vq_float(rv[slot * D + i0 + e]);
            }
        } else {
"""
    + textwrap.indent(_CODES_LOAD, "    ")
    + "        }\n"
)


# The same online-softmax step with fewer instructions a position (``QuantizedAttention(fast=
# True)``): the group's G partial scores are summed over the warp in one transposed butterfly
# (each stage halves the heads a lane sums: 10 shuffles for G = 4 where ``_STEP`` takes 20,
# then each head's score broadcast from a lane that holds it), and one exponential a position
# and head (``__expf`` of minus the gap between the score and the running max: the old sum's
# factor or the new weight) where ``_STEP`` takes two precise ones. A G that is not a power
# of two reduces head by head, as ``_STEP``.
_FAST_STEP = """        constexpr bool FOLD = (G & (G - 1)) == 0 && G <= 32;
        float s[G];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            s[g] = 0.0f;
            for (int e = 0; e < E; ++e) {
                s[g] += qv[g][e] * kx[e];
            }
        }
        if (FOLD) {
            int o = 16;
            #pragma unroll
            for (int n = G; n > 1; n >>= 1, o >>= 1) {
                const bool up = (lane & o) != 0;
                #pragma unroll
                for (int i = 0; i < n / 2; ++i) {
                    const float give = up ? s[i] : s[i + n / 2];
                    const float keep = up ? s[i + n / 2] : s[i];
                    s[i] = keep + __shfl_xor_sync(0xffffffff, give, o);
                }
            }
            for (; o > 0; o >>= 1) {
                s[0] += __shfl_xor_sync(0xffffffff, s[0], o);
            }
            const float mine = s[0];  // head g's whole score is in lanes g * 32 / G ...
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                s[g] = __shfl_sync(0xffffffff, mine, g * (32 / G));
            }
        } else {
            for (int g = 0; g < G; ++g) {
                for (int o = 16; o > 0; o >>= 1) {
                    s[g] += __shfl_xor_sync(0xffffffff, s[g], o);
                }
            }
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const float gap = s[g] - m[g];
            const float x = __expf(-fabsf(gap));
            const float c = gap > 0.0f ? x : 1.0f;  // the running sums' factor
            const float p = gap > 0.0f ? 1.0f : x;  // this position's weight
            l[g] = l[g] * c + p;
            for (int e = 0; e < E; ++e) {
                acc[g][e] = acc[g][e] * c + p * vx[e];
            }
            m[g] = gap > 0.0f ? s[g] : m[g];
        }
"""


def _kernel_source(load: str, step: str = _STEP) -> str:
    return _HEAD + _STATE + _LOOP + load + step + "    }\n" + _COMBINE


_SOURCE = _kernel_source(_CODES_LOAD)
_WINDOW_SOURCE = _kernel_source(_WINDOW_LOAD)
_FAST_SOURCE = _kernel_source(_CODES_LOAD, _FAST_STEP)
_FAST_WINDOW_SOURCE = _kernel_source(_WINDOW_LOAD, _FAST_STEP)

# Split over positions (flash-decoding): with few rows a block per (row, KV head) leaves most of
# the device idle over a long context, so ``SPLITS`` blocks share a row's positions, each writes
# its unnormalised partial (max score, sum of weights, weighted V) in float32, and
# ``combine_partials`` joins them in MLX ops.
_SPLIT_EDITS = (
    ("    const int r = blockIdx.z;\n",
     "    const int r = blockIdx.z / SPLITS;\n    const int part = blockIdx.z % SPLITS;\n"),
    ("    for (int t = w; t < len; t += WARPS) {\n",
     "    const int span = (len + SPLITS - 1) / SPLITS;\n"
     "    const int lo = part * span;\n"
     "    const int hi = lo + span < len ? lo + span : len;\n"
     "    for (int t = lo + w; t < hi; t += WARPS) {\n"),
    ("        vq_store(out + ((size_t)r * (HKV * G) + h * G + g) * D + d, sum / total);\n",
     "        const size_t at = ((size_t)r * (HKV * G) + h * G + g) * SPLITS + part;\n"
     "        acc_out[at * D + d] = sum;\n"
     "        if (d == 0) {\n"
     "            top_out[at] = mx_;\n"
     "            total_out[at] = total;\n"
     "        }\n"),
)  # fmt: skip


def _split(source: str) -> str:
    for old, new in _SPLIT_EDITS:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


_SPLIT_SOURCE = _split(_SOURCE)
_SPLIT_WINDOW_SOURCE = _split(_WINDOW_SOURCE)
_FAST_SPLIT_SOURCE = _split(_FAST_SOURCE)
_FAST_SPLIT_WINDOW_SOURCE = _split(_FAST_WINDOW_SOURCE)
# (window, split, fast) -> the kernel's source
SOURCES = {
    (False, False, False): _SOURCE,
    (True, False, False): _WINDOW_SOURCE,
    (False, True, False): _SPLIT_SOURCE,
    (True, True, False): _SPLIT_WINDOW_SOURCE,
    (False, False, True): _FAST_SOURCE,
    (True, False, True): _FAST_WINDOW_SOURCE,
    (False, True, True): _FAST_SPLIT_SOURCE,
    (True, True, True): _FAST_SPLIT_WINDOW_SOURCE,
}
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
    """The kernels (without and with a residual window) and their constant input (the scale),
    made at first use; one per ``QuantizedDenseKV``. ``fast``: their step with the folded
    reduction and one exponential (``_FAST_STEP``; ``benchmarks.step_anatomy``'s ``+fast``
    measures it against the plain one, which the server runs). Engine thread only."""

    def __init__(self, fast: bool = False) -> None:
        self.fast = fast
        self._kernels: dict[tuple[bool, bool], Any] = {}  # (window, split) -> kernel
        self._scales: dict[float, mx.array] = {}

    def _kernel(self, window: bool, split: bool) -> Any:
        got = self._kernels.get((window, split))
        if got is None:
            source = SOURCES[(window, split, self.fast)]
            ring = ["rk", "rv"] if window else []
            got = self._kernels[(window, split)] = mx.fast.cuda_kernel(
                name="vq_quantized_decode"
                + ("_window" if window else "")
                + ("_split" if split else "")
                + ("_fast" if self.fast else ""),
                input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", *ring, "lens", "scale"],
                output_names=["acc_out", "top_out", "total_out"] if split else ["out"],
                source=source,
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
        kernel = self._kernel(ring is not None, splits > 1)
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
