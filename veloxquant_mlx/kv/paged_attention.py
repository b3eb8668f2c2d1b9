"""Decode attention that reads the paged store where its blocks lie (``--paged-attention fused``).

The paged layout's default (``gather``) copies each row's K and V blocks out of the store into
attention's layout every step, two gathers a layer, then runs MLX's attention on the copies.
``fused`` attends through the block tables instead: on MLX's CUDA backend one kernel a layer
(``mx.fast.cuda_kernel``), which reads each row's keys and values from the store block by
block and the step's new token from the layer's new K and V (it reaches the store when the
next step begins, as in ``gather``). Elsewhere ``fused`` computes the same thing in MLX ops (the
gather, then MLX's attention), so the routing is the same on every backend and is what the
CPU tests run; the kernel itself runs only on CUDA, where ``benchmarks.single_stream`` and
``benchmarks.step_bench`` check its tokens against stock mlx_lm (and its source runs on a CPU
through the tests' emulation, ``tests/engine/cuda_emulation.py``, against ``reference``).

The kernel: one thread block per row and KV head, ``WARPS`` warps over the row's positions
(position ``t`` to warp ``t % WARPS``), a lane holding ``head_dim / 32`` of each vector. Each
warp keeps a running softmax (max, sum, weighted V) per query head of the KV head's group, so
a key and a value are loaded once for all of the group's query heads; the warps' partials are
combined through shared memory at the end. Scores and sums are float32, as MLX's attention.
No length limit; no shape is compiled in but the model's (heads, head_dim, block size, dtype).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.kv.attention import cuda_available

WARPS = 8  # per thread block: 256 threads
SHARED_BYTES = 40 * 1024  # the warps' partials, under CUDA's 48 KiB of static shared memory

_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ inline float vq_float(float x) { return x; }
__device__ inline float vq_float(__half x) { return __half2float(x); }
__device__ inline float vq_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline void vq_store(float* p, float v) { *p = v; }
__device__ inline void vq_store(__half* p, float v) { *p = __float2half(v); }
__device__ inline void vq_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
"""

# The pieces ``kv.quantized_attention``'s kernels share: each query head's state (its query,
# running max, weight sum and weighted V), one position's online-softmax step, and the warps'
# partials combined through shared memory into ``out``.
_STATE = """    float qv[G][E];
    float m[G], l[G], acc[G][E];
    for (int g = 0; g < G; ++g) {
        const T* qp = q + ((size_t)r * (HKV * G) + h * G + g) * D + lane * E;
        for (int e = 0; e < E; ++e) {
            qv[g][e] = vq_float(qp[e]) * sc;
            acc[g][e] = 0.0f;
        }
        m[g] = -1e30f;
        l[g] = 0.0f;
    }
"""
_STEP = """        for (int g = 0; g < G; ++g) {
            float s = 0.0f;
            for (int e = 0; e < E; ++e) {
                s += qv[g][e] * kx[e];
            }
            for (int o = 16; o > 0; o >>= 1) {
                s += __shfl_xor_sync(0xffffffff, s, o);
            }
            const float mn = fmaxf(m[g], s);
            const float c = expf(m[g] - mn);
            const float p = expf(s - mn);
            l[g] = l[g] * c + p;
            for (int e = 0; e < E; ++e) {
                acc[g][e] = acc[g][e] * c + p * vx[e];
            }
            m[g] = mn;
        }
"""
_COMBINE = """    __shared__ float sm[WARPS][G];
    __shared__ float sl[WARPS][G];
    __shared__ float sacc[WARPS][G][D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            sm[w][g] = m[g];
            sl[w][g] = l[g];
        }
        for (int e = 0; e < E; ++e) {
            sacc[w][g][lane * E + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
        const int g = i / D;
        const int d = i % D;
        float mx_ = -1e30f;
        for (int j = 0; j < WARPS; ++j) {
            mx_ = fmaxf(mx_, sm[j][g]);
        }
        float total = 0.0f;
        float sum = 0.0f;
        for (int j = 0; j < WARPS; ++j) {
            const float f = expf(sm[j][g] - mx_);
            total += sl[j][g] * f;
            sum += sacc[j][g][d] * f;
        }
        vq_store(out + ((size_t)r * (HKV * G) + h * G + g) * D + d, sum / total);
    }
"""
_SOURCE = (
    """
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const int h = blockIdx.y;
    const int r = blockIdx.z;
    const int rows = lens_shape[0];
    const int nb = tabs_shape[2];
    const int len = lens[r];
    const float sc = scale[0];
    const int* ktab = tabs + ((size_t)(2 * layer[0]) * rows + r) * nb;
    const int* vtab = tabs + ((size_t)(2 * layer[0] + 1) * rows + r) * nb;
"""
    + _STATE
    + """    for (int t = w; t < len; t += WARPS) {
        const T* kp;
        const T* vp;
        if (t == len - 1) {
            kp = kn + ((size_t)r * HKV + h) * D;
            vp = vn + ((size_t)r * HKV + h) * D;
        } else {
            const size_t kb = (size_t)ktab[t / BS];
            const size_t vb = (size_t)vtab[t / BS];
            kp = store + ((kb * HKV + h) * BS + t % BS) * D;
            vp = store + ((vb * HKV + h) * BS + t % BS) * D;
        }
        float kx[E], vx[E];
        for (int e = 0; e < E; ++e) {
            kx[e] = vq_float(kp[lane * E + e]);
            vx[e] = vq_float(vp[lane * E + e]);
        }
"""
    + _STEP
    + "    }\n"
    + _COMBINE
)


def kernel_runs(head_dim: int, group: int) -> bool:
    """Whether ``fused`` runs the kernel here: MLX's CUDA backend as the default device, a head
    dim of whole warps, and the warps' partials for ``group`` query heads per KV head in shared
    memory. Elsewhere it runs the same attention in MLX ops (``reference``)."""
    fits = head_dim % 32 == 0 and WARPS * group * (head_dim + 2) * 4 <= SHARED_BYTES
    return fits and cuda_available() and mx.default_device() == mx.gpu


class PagedAttention:
    """The kernel and its constant inputs (a layer's index, a scale), made at first use; one
    per ``PagedKV``. Engine thread only."""

    def __init__(self) -> None:
        self._kernel: Any = None
        self._constants: dict[tuple[str, float], mx.array] = {}

    def _constant(self, kind: str, value: float, dtype: mx.Dtype) -> mx.array:
        got = self._constants.get((kind, value))
        if got is None:
            got = self._constants[(kind, value)] = mx.array([value], dtype=dtype)
        return got

    def __call__(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        store: mx.array,
        tabs: mx.array,
        layer: int,
        lens: mx.array,
        scale: float,
        block_size: int,
    ) -> mx.array:
        """One new token per row, attending through block tables: ``queries [rows, HQ, 1, D]``;
        ``keys``/``values [rows, HKV, 1, D]`` the layer's new token (position ``lens - 1``);
        the store ``[blocks * HKV * block_size, D]`` (``kv.paged.PagedKV``'s); ``tabs [2L,
        rows, blocks]`` int32, layer ``l``'s K block ids at ``2l``, V's at ``2l + 1``; ``lens
        [rows]`` int32, each row's tokens with the new one. All in the store's dtype. Returns
        ``[rows, HQ, 1, D]``. CUDA only (``kernel_runs``); lazy, like any MLX op."""
        rows, n_q, _, dim = queries.shape
        n_kv = keys.shape[1]
        if self._kernel is None:
            self._kernel = mx.fast.cuda_kernel(
                name="vq_paged_decode",
                input_names=["q", "kn", "vn", "store", "tabs", "layer", "lens", "scale"],
                output_names=["out"],
                source=_SOURCE,
                header=_HEADER,
            )
        inputs = [
            queries,
            keys,
            values,
            store,
            tabs,
            self._constant("layer", layer, mx.int32),
            lens,
            self._constant("scale", scale, mx.float32),
        ]
        (out,) = self._kernel(
            inputs=inputs,
            template=[
                ("T", store.dtype),
                ("D", dim),
                ("BS", block_size),
                ("HKV", n_kv),
                ("G", n_q // n_kv),
                ("WARPS", WARPS),
            ],
            grid=(WARPS * 32, n_kv, rows),
            threadgroup=(WARPS * 32, 1, 1),
            output_shapes=[(rows, n_q, 1, dim)],
            output_dtypes=[store.dtype],
        )
        return out


def reference(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    store: mx.array,
    tabs: mx.array,
    layer: int,
    lens: mx.array,
    scale: float,
    block_size: int,
) -> mx.array:
    """``PagedAttention`` in MLX ops, on any backend (the same arguments): each row's blocks
    gathered into attention's layout, the new token put at ``lens - 1``, masked past each row's
    own length, MLX's attention. What ``fused`` runs where the kernel does not."""
    rows, _, _, dim = queries.shape
    n_kv = keys.shape[1]
    nb = tabs.shape[2]
    blocks = store.reshape(-1, n_kv, block_size, dim)  # block id -> [heads, block_size, dim]
    at = (lens - 1).reshape(rows, 1, 1, 1)

    def read(ids: mx.array, new: mx.array) -> mx.array:
        x = blocks[ids].transpose(0, 2, 1, 3, 4).reshape(rows, n_kv, nb * block_size, dim)
        return mx.put_along_axis(x, at, new, axis=2)

    k = read(tabs[2 * layer], keys)
    v = read(tabs[2 * layer + 1], values)
    mask = (mx.arange(nb * block_size)[None, :] < lens[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
