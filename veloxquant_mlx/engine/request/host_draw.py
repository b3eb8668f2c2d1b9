"""The CPU's draw (``BatchSampler.draw`` where the device is the CPU): each sampled row's
Gumbel-max token picked on the host, with noise made by numpy, and top_p checked for the drawn
token alone (engine thread).

The noise: each row's Gumbel noise over the vocabulary from its own key (split on the device
each step, as on a GPU), by numpy's PCG64 seeded with the key and its logarithms: 0.8 ms for 8
rows of 32,000 against 3.5 for MLX's ``gumbel`` on this CPU (its threefry bits and two
logarithms at MLX's CPU speed), the largest part of the sampling pass. So a seed's tokens on a
CPU are not those of a GPU for the same seed (they were not, either, wherever the two
backends' logits differ), and every sampled row on a CPU is drawn here, so that a seed gives
the same tokens alone or in any batch.

The cut: a sort of every row made the top_p cut before (numpy's: 4.9 ms for 8 rows of 32,000
logits). The Gumbel-max token over the whole tempered row is the token over the kept tokens
whenever it is kept itself (the kept tokens are a subset, with the same noise), and it is kept
exactly when the probability mass of the tokens above its logit is short of top_p of the
total: one exp and one sum over the row. A row whose drawn token is cut, or whose mass lies
within float32's rounding of the cut (where the sort's float32 running sum could decide either
way), takes the sort's cut (``row_rank_cut``) and draws again with the same noise; a top_k row
always does. So the tokens are those of the sort's cut with the same noise; a sort is made for
about (1 - top_p) of the sampled rows.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.engine.request.logit_filters import min_p_floor, row_rank_cut

_TINY = np.float32(2**-25)  # below the least non-zero uniform (2^-24): log's argument > 0


def gumbel_noise(key: np.ndarray, vocab: int) -> np.ndarray:
    """Gumbel noise [vocab] float32 from one row's key (two uint32): numpy's PCG64 seeded with
    the key, ``-log(-log(u))`` of its float32 uniforms (0 moved up to ``_TINY``; the largest,
    1 - 2^-24, stays below 1, so every value is finite)."""
    seed = (int(key[0]) << 32) | int(key[1])
    g = np.random.Generator(np.random.PCG64(seed)).random(vocab, dtype=np.float32)
    np.maximum(g, _TINY, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    np.log(g, out=g)
    return np.negative(g, out=g)


def host_draw(
    logits: mx.array,
    keys: mx.array,
    inv_temp: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    uses_min_p: bool,
) -> tuple[mx.array, mx.array]:
    """Each row's token (a Gumbel-max draw over its tempered logits plus ``gumbel_noise`` of
    its step key, cut by min_p and by the sort's top_p / top_k; the argmax for greedy rows) and
    each row's next key. Evaluates the logits. Row by row, so that a row's passes stay in the
    cache (8 rows of 32,000 float32 are 1 MiB)."""
    next_keys, noise_keys, floor = _device_part(uses_min_p)(logits, keys, min_p)
    mx.eval(logits, noise_keys, floor)
    # exact for every float type MLX has; float32 logits are read in place (not written)
    values = np.asarray(logits if logits.dtype == mx.float32 else logits.astype(mx.float32))
    t = np.array(inv_temp)[:, 0]
    p, k = np.array(top_p)[:, 0], np.array(top_k)[:, 0]
    tokens = np.zeros(len(t), dtype=np.int64)
    for i in np.flatnonzero(t <= 0):  # greedy rows: the argmax (a sampled row's is not needed)
        tokens[i] = values[i].argmax()
    vocab = values.shape[-1]
    nk, lows = np.array(noise_keys), np.array(floor)[:, 0]
    work = np.empty((2, vocab), dtype=np.float32)
    for i in np.flatnonzero(t > 0):
        row = values[i]
        scores = gumbel_noise(nk[i], vocab)
        scores += np.multiply(row, t[i], out=work[0])
        if uses_min_p:
            scores[row < lows[i]] = -np.inf  # (a -inf floor keeps all)
        token = int(scores.argmax())
        if k[i] > 0 or (p[i] < 1.0 and not _surely_kept(row, row[token], p[i], work)):
            scores[row < row_rank_cut(row, p[i], k[i], vocab)] = -np.inf
            token = int(scores.argmax())
        tokens[i] = token
    return mx.array(tokens.astype(np.uint32)), next_keys


def _surely_kept(row: np.ndarray, drawn: np.float32, top_p: np.float32, work: np.ndarray) -> bool:
    """Whether the sort's top_p cut keeps the drawn token (logit ``drawn``) of ``row``: the mass
    above it short of ``top_p`` of the total by more than the sort's float32 running sum and its
    exps can be off from these (each at most ``vocab`` float32 roundings of the total; summed
    here pairwise, off by far less). ``work``: two rows of scratch."""
    probs, masked = work
    np.subtract(row, row.max(), out=probs)
    np.exp(probs, out=probs)
    total = probs.sum()
    above = np.multiply(probs, row > drawn, out=masked).sum()
    slack = (row.shape[-1] + 8) * 2.0**-23 * total
    return bool(above < top_p * total - slack)


@functools.cache
def _device_part(uses_min_p: bool) -> Any:
    """What the device computes for the host's draw, compiled: each row's next key and this
    step's noise key (its key split, as the device's draw splits it), and each row's min_p
    floor in the logits' type (-inf without min_p)."""

    def part(logits: mx.array, keys: mx.array, min_p: mx.array) -> tuple[mx.array, ...]:
        pairs = mx.vmap(mx.random.split)(keys)  # [rows, 2, 2]
        if uses_min_p:
            floor = min_p_floor(logits, min_p).astype(mx.float32)
        else:
            floor = mx.full((logits.shape[0], 1), -mx.inf, dtype=mx.float32)
        return pairs[:, 0], pairs[:, 1], floor

    return mx.compile(part)
