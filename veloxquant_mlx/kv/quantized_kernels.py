"""The CUDA sources of ``kv.quantized_attention``'s kernels (``mx.fast.cuda_kernel`` bodies).

Two ways to lay a thread block's work over a row's positions, each with and without a residual
window (a ring of the newest positions in the model's type) and split or not over positions:

- ``plain``: a warp per position (position ``t`` to warp ``t % WARPS``), a lane dequantizing
  ``head_dim / 32`` values of each K and V vector; each query head's score is summed over the
  warp's lanes by shuffles, and each position costs a running softmax update.
- ``tile``: a warp takes 32 positions at once. A lane scores its own position for all of the
  group's query heads, reading the whole K vector's codes (16-byte loads) against the queries
  in shared memory, and applying each quantization group's scale and bias once to the group's
  dot product (``scale * (q . codes) + bias * sum(q)``); one max and one rescale a tile; then
  the warp reads the tile's V vectors one after the other, lanes over the head's dims, each
  position's weight broadcast from the lane that scored it. No shuffle sums a score, and codes
  become floats by a bit pattern (``0x4B000000 | code`` is ``2**23 + code``) rather than
  conversion instructions. Needs each quantization group's codes in whole 16-byte words
  (``tile_runs``).

Every kernel ends in ``paged_attention._COMBINE`` (the warps' partials joined through shared
memory); the split ones write unnormalised partials for ``combine_partials`` instead.
"""

from __future__ import annotations

import textwrap

from veloxquant_mlx.kv.paged_attention import _COMBINE, _STATE, _STEP

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
    const int lo = 0;    // the positions this block reads
    const int hi = len;
"""
_LOOP = """    #pragma unroll 2
    for (int t = lo + w; t < hi; t += WARPS) {
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


def _kernel_source(load: str, step: str = _STEP) -> str:
    return _HEAD + _STATE + _LOOP + load + step + "    }\n" + _COMBINE


_SOURCE = _kernel_source(_CODES_LOAD)
_WINDOW_SOURCE = _kernel_source(_WINDOW_LOAD)


# ``tile``: the queries (scaled) and their sums over each quantization group in shared memory,
# then 32 positions a warp at a time
_TILE_STATE = """    constexpr int WG = GS * BITS / 32;  // code words a group holds
    constexpr float TWO23 = 8388608.0f;  // 0x4B000000 | c reads as 2**23 + c
    __shared__ float4 sq[G][D / 4];
    __shared__ float sqs[G][NG];
    {
        const T* qp = q + ((size_t)r * (HKV * G) + h * G) * D;
        float* flat = reinterpret_cast<float*>(&sq[0][0]);
        for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
            flat[i] = vq_float(qp[i]) * sc;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * NG; i += WARPS * 32) {
        const float* qg = reinterpret_cast<const float*>(&sq[i / NG][0]) + (i % NG) * GS;
        float sum = 0.0f;
        for (int j = 0; j < GS; ++j) {
            sum += qg[j];
        }
        sqs[i / NG][i % NG] = sum;
    }
    __syncthreads();
    float m[G], l[G], acc[G][E];
    for (int g = 0; g < G; ++g) {
        m[g] = -1e30f;
        l[g] = 0.0f;
        for (int e = 0; e < E; ++e) {
            acc[g][e] = 0.0f;
        }
    }
    for (int t0 = lo + w * 32; t0 < hi; t0 += WARPS * 32) {
        const int t = t0 + lane;  // the position this lane scores
        float s[G];
        for (int g = 0; g < G; ++g) {
            s[g] = -1e30f;
        }
        if (t < hi) {
"""
# A lane's score of its position from the K codes, group by group
_TILE_CODES_SCORE = """            const size_t pos = base + t;
            const uint4* kp = reinterpret_cast<const uint4*>(kw + pos * WPOS);
            for (int g = 0; g < G; ++g) {
                s[g] = 0.0f;
            }
            #pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                float dot[G];
                for (int g = 0; g < G; ++g) {
                    dot[g] = 0.0f;
                }
                #pragma unroll
                for (int c = 0; c < WG / 4; ++c) {
                    const uint4 u = kp[gi * (WG / 4) + c];
                    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        #pragma unroll
                        for (int b = 0; b < PER; b += 4) {
                            float x[4];
                            for (int j = 0; j < 4; ++j) {
                                const uint32_t code = (words[k] >> ((b + j) * BITS)) & MASK;
                                x[j] = __uint_as_float(0x4B000000u | code) - TWO23;
                            }
                            const int at = ((gi * WG + c * 4 + k) * PER + b) / 4;
                            #pragma unroll
                            for (int g = 0; g < G; ++g) {
                                const float4 qq = sq[g][at];
                                dot[g] += qq.x * x[0] + qq.y * x[1] + qq.z * x[2] + qq.w * x[3];
                            }
                        }
                    }
                }
                const float ka = vq_float(ks[pos * NG + gi]);
                const float kc = vq_float(kb[pos * NG + gi]);
                for (int g = 0; g < G; ++g) {
                    s[g] += ka * dot[g] + kc * sqs[g][gi];
                }
            }
"""
# ... or, with a residual window, from the ring where the position is one of the newest
_TILE_WINDOW_SCORE = (
    """            if (t >= len - RECENT) {
                const T* kr = rk + (((size_t)r * HKV + h) * RECENT + t % RECENT) * D;
                for (int g = 0; g < G; ++g) {
                    const float* qg = reinterpret_cast<const float*>(&sq[g][0]);
                    float dot = 0.0f;
                    for (int i = 0; i < D; ++i) {
                        dot += qg[i] * vq_float(kr[i]);
                    }
                    s[g] = dot;
                }
            } else {
"""
    + textwrap.indent(_TILE_CODES_SCORE, "    ")
    + "            }\n"
)
# The tile's weights (one max and one rescale a tile; a lane past the row weighs 0), then its
# V vectors one position after the other, each position's weights from the lane that scored it
_TILE_WEIGHTS = """        }
        float p[G];
        for (int g = 0; g < G; ++g) {
            float top = s[g];
            for (int o = 16; o > 0; o >>= 1) {
                top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
            }
            const float mn = fmaxf(m[g], top);
            const float c = expf(m[g] - mn);
            p[g] = expf(s[g] - mn);
            l[g] = l[g] * c + p[g];
            for (int e = 0; e < E; ++e) {
                acc[g][e] *= c;
            }
            m[g] = mn;
        }
        const int n = hi - t0 < 32 ? hi - t0 : 32;
        #pragma unroll 4
        for (int j = 0; j < n; ++j) {
            const size_t pos = base + t0 + j;
            float pj[G];
            for (int g = 0; g < G; ++g) {
                pj[g] = __shfl_sync(0xffffffff, p[g], j);
            }
            float vx[E];
"""
_TILE_CODES_VALUE = """            {
                const uint32_t* vp = vw + pos * WPOS;
                const float va = vq_float(vs[pos * NG + grp]);
                const float vc = vq_float(vb[pos * NG + grp]);
                for (int e = 0; e < E; ++e) {
                    const int i = i0 + e;
                    const uint32_t code = (vp[i / PER] >> ((i % PER) * BITS)) & MASK;
                    vx[e] = va * (__uint_as_float(0x4B000000u | code) - TWO23) + vc;
                }
            }
"""
_TILE_WINDOW_VALUE = (
    """            if (t0 + j >= len - RECENT) {
                const T* vr = rv + (((size_t)r * HKV + h) * RECENT + (t0 + j) % RECENT) * D;
                for (int e = 0; e < E; ++e) {
                    vx[e] = vq_float(vr[i0 + e]);
                }
            } else
"""
    + _TILE_CODES_VALUE
)
# After the tiles each lane's weight sum is its own positions': summed over the warp
_TILE_END = """            for (int g = 0; g < G; ++g) {
                for (int e = 0; e < E; ++e) {
                    acc[g][e] += pj[g] * vx[e];
                }
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        for (int o = 16; o > 0; o >>= 1) {
            l[g] += __shfl_xor_sync(0xffffffff, l[g], o);
        }
    }
"""


def _tile_source(score: str, value: str) -> str:
    return _HEAD + _TILE_STATE + score + _TILE_WEIGHTS + value + _TILE_END + _COMBINE


_TILE_SOURCE = _tile_source(_TILE_CODES_SCORE, _TILE_CODES_VALUE)
_TILE_WINDOW_SOURCE = _tile_source(_TILE_WINDOW_SCORE, _TILE_WINDOW_VALUE)

# Split over positions (flash-decoding): with few rows a block per (row, KV head) leaves most of
# the device idle over a long context, so ``SPLITS`` blocks share a row's positions, each writes
# its unnormalised partial (max score, sum of weights, weighted V) in float32, and
# ``combine_partials`` joins them in MLX ops.
_SPLIT_EDITS = (
    ("    const int r = blockIdx.z;\n",
     "    const int r = blockIdx.z / SPLITS;\n    const int part = blockIdx.z % SPLITS;\n"),
    ("    const int lo = 0;    // the positions this block reads\n    const int hi = len;\n",
     "    const int span = (len + SPLITS - 1) / SPLITS;\n"
     "    const int lo = part * span;\n"
     "    const int hi = lo + span < len ? lo + span : len;\n"),
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


STEPS = ("plain", "tile")
_WHOLE = {
    (False, "plain"): _SOURCE,
    (True, "plain"): _WINDOW_SOURCE,
    (False, "tile"): _TILE_SOURCE,
    (True, "tile"): _TILE_WINDOW_SOURCE,
}
# (window, split, step) -> the kernel's source
SOURCES = {
    (window, split, step): _split(source) if split else source
    for (window, step), source in _WHOLE.items()
    for split in (False, True)
}


def tile_runs(bits: int, group_size: int) -> bool:
    """Whether the ``tile`` kernels hold these codes: a quantization group's codes in whole
    16-byte words, four values a code word at least (else the ``plain`` step runs)."""
    return (group_size * bits) % 128 == 0 and (32 // bits) % 4 == 0 and 32 % bits == 0
