"""Attention of a prefill chunk (several queries per row) over the engine's own caches, routed
here by ``kv.attention`` (``--attention-softmax``, ``--prefill-attention``).

``grouped_attention``: plain products, a KV head's query heads as the rows of one product (K and
V read in place, no broadcast over heads), for any number of queries; with the CPU's exp2
softmax (MLX's CPU ``exp`` is slow), optionally taken by numpy on the host for a prefill
chunk (``host``: numpy's ``exp2`` is ~20x MLX's ``power`` on a CPU), or MLX's softmax in one
fused pass (CUDA, where MLX's own attention hands a chunk to cuDNN, which builds a graph for
every new shape).
``bucketed_attention``: MLX's own attention (cuDNN's flash attention on CUDA) with the queries
and keys padded to buckets, so cuDNN's graphs repeat; ``warm_buckets`` builds them all before
a server is ready. DESIGN-NOTES.md has the measurements.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np

# ``grouped_attention`` takes at most this many scores ([queries, keys] per head, float32) at
# once: a longer chunk over a long context goes in pieces of queries
SCORES_AT_ONCE = 2**26
# ``bucketed_attention``: a chunk's keys padded to a multiple of this at the least, and of an
# eighth of the length's power of two above it (4 lengths an octave, at most a quarter more)
KEY_BUCKET_MIN = 256
LOG2E = 1.4426950408889634
# ``host``: a chunk's softmax goes to numpy from this many scores (fewer: the wait for them and
# the copies cost more than MLX's powers)
HOST_MIN_SCORES = 2**15


def key_bucket(length: int) -> int:
    """``length`` keys rounded up to their bucket (``KEY_BUCKET_MIN``; 4 buckets an octave):
    a server meets about 4 key lengths per doubling of its contexts."""
    step = max(KEY_BUCKET_MIN, 1 << max(0, length.bit_length() - 3))
    return -(-length // step) * step


def query_bucket(n: int) -> int:
    """A chunk's queries rounded up to a power of two (at least ``KEY_BUCKET_MIN`` / 4)."""
    return max(KEY_BUCKET_MIN // 4, 1 << (n - 1).bit_length())


def bucketed_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """A causal prefill chunk (``queries [1, H, N, D]``, the last ``N`` of ``keys``' ``L``
    positions) by MLX's attention with the queries padded to ``query_bucket(N)`` and the keys
    to ``key_bucket(L)`` (zeros, hidden by an additive mask; the padded queries' outputs are
    dropped), every input in a fresh row-major layout: on CUDA cuDNN builds a graph per
    (queries, keys, mask) shape and strides, 20-70 ms the first time, so a server meets a
    bounded number of them (``warm_buckets`` builds them before it is ready) where every
    agent turn was a new one. Other masks, several rows and single queries go to
    ``grouped_attention``.

    Cost: the padded Q, K and V copied once a layer (K and V of a 32,000-token context at 8B:
    ~40 MB a layer), then MLX's flash attention. Lazy, like any MLX op."""
    n_q, length = queries.shape[2], keys.shape[2]
    if queries.shape[0] != 1 or n_q == 1 or not (isinstance(mask, str) and mask == "causal"):
        return grouped_attention(queries, keys, values, scale, mask, exp2=False)
    width, padded = query_bucket(n_q), key_bucket(length)
    # query i sits at position length - n_q + i; the padding queries see every key
    seen = (mx.arange(width) + (length - n_q))[:, None] >= mx.arange(padded)[None]
    seen = seen & (mx.arange(padded)[None] < length)
    bias = mx.where(seen, mx.array(0, queries.dtype), mx.array(-float("inf"), queries.dtype))
    q, k, v = (_row_major(a, n) for a, n in ((queries, width), (keys, padded), (values, padded)))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias)
    return out[:, :, :n_q]


def _row_major(x: mx.array, n: int) -> mx.array:
    """``x [B, H, L, D]`` padded with zeros to ``n`` positions, or copied: row-major either way
    (a slice of a cache's buffer has the buffer's strides)."""
    if n == x.shape[2]:
        return mx.contiguous(x)
    return mx.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])


def bucket_shapes(widest: int, longest: int) -> list[tuple[int, int]]:
    """Every (queries, keys) bucket of chunks of up to ``widest`` tokens over up to
    ``longest`` keys, shortest keys first."""
    shapes = []
    keys = key_bucket(query_bucket(2))
    while keys <= key_bucket(longest):
        width = query_bucket(2)
        while width <= min(query_bucket(widest), keys):
            shapes.append((width, keys))
            width *= 2
        keys = key_bucket(keys + 1)
    return shapes


def warm_buckets(
    n_heads: int,
    n_kv: int,
    head_dim: int,
    dtype: mx.Dtype,
    shapes: list[tuple[int, int]],
    seconds: float,
) -> int:
    """Run ``bucketed_attention`` once for each of ``shapes`` (``bucket_shapes``) in order,
    so cuDNN's graphs are built before a request needs them, for at most ``seconds``.
    Returns how many ran. Engine thread, before ready."""
    deadline = time.monotonic() + seconds
    n = 0
    for width, keys in shapes:
        if time.monotonic() > deadline:
            break
        q = mx.zeros((1, n_heads, width, head_dim), dtype)
        kv = mx.zeros((1, n_kv, keys, head_dim), dtype)
        mx.eval(bucketed_attention(q, kv, kv, 1.0, "causal"))
        n += 1
    return n


def grouped_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any,
    exp2: bool = True,
    host: bool = False,
) -> mx.array:
    """Attention of ``queries [B, H, N, D]`` over ``keys``/``values`` ``[B, H_kv, L, D]``
    (the last ``N`` of the ``L`` positions are the queries' own), in plain products: a KV
    head's query heads are the rows of one product (K and V read in place, no broadcast over
    heads). ``mask``: None, "causal", or a bool (True = attend) or additive array that
    broadcasts to ``[B, 1 or H, N, L]``. With ``exp2`` the softmax is taken as powers of two
    in float32 and the weights normalised after the product with V (five passes over
    ``[B, H, N, L]``); without, it is MLX's ``precise`` softmax over the scores in the
    queries' type (one fused pass). A query that sees no position gets 0 (MLX's gives V's
    mean there; such queries are padding). With ``host`` as well, a chunk of several queries
    and at least ``HOST_MIN_SCORES`` scores takes its softmax by numpy (``_grouped_host``:
    evaluates the scores; never inside ``mx.compile``, so never for decode steps). More than
    ``SCORES_AT_ONCE`` scores go in pieces of queries.

    Cost: two products of ``B * H * N * L * D`` each and the softmax's passes. Lazy: builds
    the graph only, like any MLX op."""
    b, n_heads, n_q, _ = queries.shape
    length = keys.shape[2]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = (
            (mx.arange(n_q) + (length - n_q))[:, None] >= mx.arange(length)[None]
            if n_q > 1
            else None
        )
    step = max(1, SCORES_AT_ONCE // max(1, b * n_heads * length))
    piece = _grouped_exp2 if exp2 else _grouped_softmax
    if exp2 and host and n_q > 1 and b * n_heads * n_q * length >= HOST_MIN_SCORES:
        piece = _grouped_host
    if n_q <= step:
        return piece(queries, keys, values, scale, mask)
    pieces = []
    for i in range(0, n_q, step):
        m = mask
        if m is not None and m.ndim >= 2 and m.shape[-2] == n_q:
            m = m[..., i : i + step, :]
        pieces.append(piece(queries[:, :, i : i + step], keys, values, scale, m))
    return mx.concatenate(pieces, axis=2)


def _grouped_mask(mask: mx.array, n_kv: int, rep: int) -> mx.array:
    """``mask`` (broadcasting to ``[B, 1 or H, N, L]``) in the grouped scores' layout
    ``[B, 1 or H_kv, 1 or rep, N, L]``."""
    m = mask
    while m.ndim < 4:
        m = m[None]
    return m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], n_kv, rep, *m.shape[2:])


def _exp2_scores(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """The float32 scores in powers of two (the query scaled by log2(e)), in the grouped
    layout ``[B, H_kv, rep, N, L]``."""
    b, n_heads, n_q, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    rep = n_heads // n_kv
    q = (queries * mx.array(scale * LOG2E, queries.dtype)).reshape(b, n_kv, rep * n_q, d)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, n_kv, rep, n_q, length)
    return scores if scores.dtype == mx.float32 else scores.astype(mx.float32)


def _exp2_mask(mask: Any, n_kv: int, rep: int) -> mx.array | None:
    """``mask`` in the grouped layout: bool (True = attend), or additive in powers of two."""
    if mask is None:
        return None
    m = _grouped_mask(mask, n_kv, rep)
    return m if m.dtype == mx.bool_ else (m * LOG2E).astype(mx.float32)


def _exp2_output(weights: mx.array, total: mx.array, values: mx.array) -> mx.array:
    """The unnormalised ``weights [B, H_kv, rep, N, L]`` times V, over their ``total``
    (``[..., 1]``, at least 1), as ``[B, H, N, D]`` in V's type."""
    b, n_kv, rep, n_q, length = weights.shape
    total = total.reshape(b, n_kv, rep * n_q, 1)
    weights = weights.reshape(b, n_kv, rep * n_q, length).astype(values.dtype)
    out = ((weights @ values) / total).astype(values.dtype)
    return out.reshape(b, n_kv * rep, n_q, values.shape[-1])


def _grouped_exp2(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """``grouped_attention`` with the softmax as powers of two over float32 scores (the query
    scaled by log2(e)), normalised after the product with V."""
    n_kv = keys.shape[1]
    scores = _exp2_scores(queries, keys, scale)
    m = _exp2_mask(mask, n_kv, queries.shape[1] // n_kv)
    if m is not None and m.dtype == mx.bool_:
        scores = mx.where(m, scores, mx.array(-float("inf"), scores.dtype))
    elif m is not None:
        scores = scores + m
    # A row of padding that sees nothing (several prompts in one left-padded forward): its max
    # is -inf; clamped, its weights are all 0 and its output 0, not NaN (which would reach V's
    # padding). -inf, not the lowest finite value, masks: MLX's CPU power is 3x slower there.
    top = mx.maximum(scores.max(axis=-1, keepdims=True), mx.finfo(mx.float32).min)
    weights = mx.power(mx.array(2.0, mx.float32), scores - top)
    total = mx.maximum(weights.sum(axis=-1, keepdims=True), 1.0)  # >= 1: the top one's 2^0
    return _exp2_output(weights, total, values)


def _grouped_host(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """``_grouped_exp2`` with the softmax's passes by numpy: the float32 scores are made and
    read back, masked, shifted by their max, raised as powers of two and summed on the host
    (numpy releases the GIL for them), then multiplied by V in MLX. The same arithmetic in the
    same order as ``_grouped_exp2`` (numpy's ``exp2`` within an ulp of MLX's ``power``).

    Cost: one wait for the scores, two host copies of ``[B, H, N, L]`` float32 and five
    numpy passes over it; on this repository's CPU 4x less than MLX's passes (134 queries
    over 1,590 keys, 8 heads: 2.4 against 10.9 ms)."""
    n_kv = keys.shape[1]
    scores = _exp2_scores(queries, keys, scale)
    m = _exp2_mask(mask, n_kv, queries.shape[1] // n_kv)
    mx.eval([scores] if m is None else [scores, m])
    a = np.array(scores)  # a copy: numpy's to write
    if m is not None and m.dtype == mx.bool_:
        np.copyto(a, -np.inf, where=~np.array(m, copy=False))
    elif m is not None:
        a += np.array(m, copy=False)
    # as _grouped_exp2: a row that sees nothing gets weights 0 and output 0, not NaN
    top = np.maximum(a.max(axis=-1, keepdims=True), np.finfo(np.float32).min)
    np.subtract(a, top, out=a)
    np.exp2(a, out=a)
    total = np.maximum(a.sum(axis=-1, keepdims=True), np.float32(1.0))
    return _exp2_output(mx.array(a), mx.array(total), values)


def _grouped_softmax(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """``grouped_attention`` with MLX's softmax: the scores in the queries' type, masked, then
    one fused pass (``precise``: float32 inside) where the powers-of-two form takes five over
    float32 scores; on CUDA a chunk over a long context is mostly those passes."""
    b, n_heads, n_q, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    rep = n_heads // n_kv
    q = (queries * mx.array(scale, queries.dtype)).reshape(b, n_kv, rep * n_q, d)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, n_kv, rep, n_q, length)
    seen = None
    if mask is not None:
        m = _grouped_mask(mask, n_kv, rep)
        if m.dtype == mx.bool_:
            # the lowest finite score, not -inf: a query that sees nothing gets finite weights
            # (then its output is zeroed), never NaN
            scores = mx.where(m, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
            seen = m.any(axis=-1, keepdims=True)
        else:
            scores = scores + m.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights.reshape(b, n_kv, rep * n_q, length) @ values
    out = out.reshape(b, n_kv, rep, n_q, values.shape[-1])
    if seen is not None:
        out = mx.where(seen, out, mx.array(0, out.dtype))
    return out.reshape(b, n_heads, n_q, values.shape[-1])
