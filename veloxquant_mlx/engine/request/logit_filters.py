"""The per-row cuts of a batch's logits: min_p / top_p / top_k thresholds made on the device (one
sort of the rows, or a histogram of 16-bit logits) or on the host (numpy, on a CPU), and
llguidance's grammar bitmasks unpacked into one boolean mask. ``sampling.BatchSampler`` applies
them; engine thread.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def host_rank_cut(logits: mx.array, top_p: mx.array, top_k: mx.array) -> mx.array:
    """Each row's top_p / top_k threshold (the larger; -inf where neither is set), computed
    with numpy as ``filter_logits`` computes it on the device. Evaluates ``logits``."""
    values = np.array(logits.astype(mx.float32))
    p, k = np.array(top_p)[:, 0], np.array(top_k)[:, 0]
    cut = np.full((values.shape[0], 1), -np.inf, dtype=np.float32)
    for i in np.flatnonzero((p < 1.0) | (k > 0)):
        cut[i, 0] = row_rank_cut(values[i], p[i], k[i], values.shape[-1])
    return mx.array(cut).astype(logits.dtype)


def row_rank_cut(row: np.ndarray, top_p: np.float32, top_k: int, vocab: int) -> np.float32:
    """One row's top_p / top_k threshold (float32 logits; top_p 1.0 / top_k 0: not set): the
    least logit kept, by numpy's sort, as ``filter_logits``'s "sort" finds it."""
    ascending = np.sort(row)
    cut = np.float32(-np.inf)
    if top_p < 1.0:
        probs = np.exp(ascending - ascending[-1])
        mass_above = np.cumsum(probs[::-1])[::-1] - probs
        dropped = min(int((mass_above >= top_p * (mass_above[0] + probs[0])).sum()), vocab - 1)
        cut = ascending[dropped]
    if top_k > 0:
        cut = max(cut, ascending[vocab - top_k])
    return cut


def min_p_floor(logits: mx.array, min_p: mx.array) -> mx.array:
    """Each row's min_p threshold [rows, 1] (-inf for rows with min_p 0): the top logit plus
    log(min_p)."""
    top = mx.max(logits, axis=-1, keepdims=True)
    cut = top + mx.log(mx.maximum(min_p, 1e-30)).astype(logits.dtype)
    return mx.where(min_p > 0, cut, mx.array(-mx.inf, dtype=logits.dtype))


def filter_logits(
    logits: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    uses_min_p: bool,
    ranks: str,
    uses_top_k: bool = True,
    rank_cut: mx.array | None = None,
) -> mx.array:
    """``logits`` with every token below its row's min_p / top_p / top_k cut at -inf (rows
    set 1.0 / 0 / 0.0 to skip one). ``ranks``: how the top_p / top_k cut is made: "sort" (one
    sort of the rows), "histogram" (``histogram_keys``: 16-bit floats only), "host" (made
    already: ``rank_cut``), "" (no row cuts by rank or mass)."""
    if not (uses_min_p or ranks):
        return logits
    vocab = logits.shape[-1]
    floor = mx.array(-mx.inf, dtype=logits.dtype)
    threshold = mx.full(top_p.shape, -mx.inf, dtype=logits.dtype)
    if rank_cut is not None:
        threshold = rank_cut
    if uses_min_p:
        threshold = mx.maximum(threshold, min_p_floor(logits, min_p))
    if ranks == "histogram":
        key, least = histogram_keys(logits, top_p, top_k, uses_top_k)
        return mx.where((logits >= threshold) & (key >= least), logits, floor)
    if ranks == "sort":  # one sort for every row that filters by rank or mass
        ascending = mx.sort(logits, axis=-1)
        probs = mx.exp((ascending - ascending[:, -1:]).astype(mx.float32))
        mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
        total = mass_above[:, :1] + probs[:, :1]
        dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
        dropped = mx.minimum(dropped, vocab - 1).astype(mx.int32)
        cut = mx.take_along_axis(ascending, dropped, axis=-1)
        threshold = mx.maximum(threshold, mx.where(top_p < 1.0, cut, floor))
        kth = mx.take_along_axis(ascending, mx.maximum(vocab - top_k, 0), axis=-1)
        threshold = mx.maximum(threshold, mx.where(top_k > 0, kth, floor))
    return mx.where(logits >= threshold, logits, floor)


HALF = (mx.bfloat16, mx.float16)  # the logits ``histogram_keys`` takes: 65,536 values


def histogram_keys(
    logits: mx.array, top_p: mx.array, top_k: mx.array, uses_top_k: bool
) -> tuple[mx.array, mx.array]:
    """The top_p / top_k cut without a sort, for 16-bit float logits: each token's value as an
    order-preserving 16-bit key, and each row's least kept key. A histogram of the
    probability mass (and, for top_k, the count) at each of the 65,536 keys, summed from the
    top, gives the same cut as the sorted rows: top_p keeps every key whose mass above it is
    short of top_p of the total (the lowest such key and all above), top_k every key with at
    least k tokens at or above it; ties are kept together, as the sort's cut keeps them."""
    rows = logits.shape[0]
    # -0 and +0 are one value to the sort's comparisons but two bit patterns: one key for both
    zero = mx.zeros_like(logits)
    bits = mx.where(logits == zero, zero, logits).view(mx.uint16).astype(mx.int32)
    key = mx.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)  # negatives below positives
    row = mx.arange(rows)[:, None]
    probs = mx.exp((logits - mx.max(logits, axis=-1, keepdims=True)).astype(mx.float32))
    mass = mx.zeros((rows, 1 << 16), dtype=mx.float32).at[row, key].add(probs)
    above = mx.cumsum(mass, axis=-1, reverse=True, inclusive=False)
    total = above[:, :1] + mass[:, :1]
    least = mx.where(top_p < 1.0, (above >= top_p * total).sum(axis=-1, keepdims=True), 0)
    if uses_top_k:
        counts = mx.zeros((rows, 1 << 16), dtype=mx.int32).at[row, key].add(1)
        at_or_above = mx.cumsum(counts, axis=-1, reverse=True)
        kth = (at_or_above >= top_k).sum(axis=-1, keepdims=True) - 1
        least = mx.maximum(least, mx.where(top_k > 0, kth, 0))
    return key, least


def bitmask_to_allowed(bits: np.ndarray, vocab_size: int) -> mx.array:
    """llguidance's packed bitmask [rows, words] (int32, bit ``t % 32`` of word ``t // 32``
    for token ``t``) as a boolean mask [rows, vocab_size], unpacked on the device."""
    words = mx.array(bits.view(np.uint32))
    shifts = mx.arange(32, dtype=mx.uint32)
    unpacked = (words[:, :, None] >> shifts) & 1
    return unpacked.reshape(bits.shape[0], -1)[:, :vocab_size] != 0
