"""The CPU's draw (``BatchSampler.draw`` where the device is the CPU): each row's Gumbel-max
token picked on the host, top_p checked for the drawn token alone (engine thread).

A sort of every row made the top_p cut before (numpy's: 4.9 ms for 8 rows of 32,000 logits,
half of the sampling pass). The Gumbel-max token over the whole tempered row is the token over
the kept tokens whenever it is kept itself (the kept tokens are a subset, with the same noise),
and it is kept exactly when the probability mass of the tokens above its logit is short of
top_p of the total: one exp and one sum over the row. A row whose drawn token is cut, or whose
mass lies within float32's rounding of the cut (where the sort's float32 running sum could
decide either way), takes the sort's cut (``row_rank_cut``) and draws again with the same
noise; a top_k row always does. So the tokens are the sort's, for every seed; a sort is made
for about (1 - top_p) of the sampled rows.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.engine.request.logit_filters import min_p_floor, row_rank_cut


def host_draw(
    logits: mx.array,
    keys: mx.array,
    inv_temp: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    uses_min_p: bool,
) -> tuple[mx.array, mx.array]:
    """Each row's token (as ``sampling._draw`` draws it with the sort's cut) and each row's next
    key. Evaluates the logits and the step's noise."""
    scores, next_keys = _device_part(uses_min_p)(logits, keys, inv_temp, min_p)
    mx.eval(logits, scores)
    values = np.array(logits.astype(mx.float32))  # exact for every float type MLX has
    scores = np.array(scores)
    p, k = np.array(top_p)[:, 0], np.array(top_k)[:, 0]
    sampled = np.array(inv_temp)[:, 0] > 0
    tokens = np.where(sampled, scores.argmax(axis=-1), values.argmax(axis=-1))
    checked = np.flatnonzero(sampled & ((p < 1.0) | (k > 0)))
    if not checked.size:
        return mx.array(tokens.astype(np.uint32)), next_keys
    rows = values[checked]
    kept = _surely_kept(rows, rows[np.arange(checked.size), tokens[checked]], p[checked])
    vocab = values.shape[-1]
    for i in checked[~kept | (k[checked] > 0)]:
        cut = row_rank_cut(values[i], p[i], k[i], vocab)
        tokens[i] = np.where(values[i] >= cut, scores[i], -np.inf).argmax()  # min_p: in scores
    return mx.array(tokens.astype(np.uint32)), next_keys


def _surely_kept(rows: np.ndarray, drawn: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Whether the sort's top_p cut keeps each row's drawn token (logit ``drawn``): the mass
    above it short of ``top_p`` of the total by more than the sort's float32 running sum and its
    exps can be off from these (each at most ``vocab`` float32 roundings of the total; summed
    here pairwise, off by far less). Rows with top_p 1.0 are kept."""
    probs = np.exp(rows - rows.max(axis=-1, keepdims=True))
    total = probs.sum(axis=-1)
    above = (probs * (rows > drawn[:, None])).sum(axis=-1)
    slack = (rows.shape[-1] + 8) * 2.0**-23 * total
    return (top_p >= 1.0) | (above < top_p * total - slack)


def tempered_with_noise(
    logits: mx.array, keys: mx.array, inv_temp: mx.array
) -> tuple[mx.array, mx.array]:
    """Each row's (kept) logits over its temperature plus Gumbel noise from its own key, and
    its next key: what both draws (this one and ``sampling._draw``) take the argmax of, one
    computation so that they draw the same tokens."""
    pairs = mx.vmap(mx.random.split)(keys)  # [rows, 2, 2]
    vocab = logits.shape[-1]
    noise = mx.vmap(lambda k: mx.random.gumbel(shape=(vocab,), key=k))(pairs[:, 1])
    return logits * inv_temp.astype(logits.dtype) + noise, pairs[:, 0]


@functools.cache
def _device_part(uses_min_p: bool) -> Any:
    """What the device computes for the host's draw, compiled: each row's tempered logits plus
    Gumbel noise from its own key (-inf below its min_p cut), and its next key."""

    def part(
        logits: mx.array, keys: mx.array, inv_temp: mx.array, min_p: mx.array
    ) -> tuple[mx.array, ...]:
        scores, next_keys = tempered_with_noise(logits, keys, inv_temp)
        if uses_min_p:
            scores = mx.where(logits >= min_p_floor(logits, min_p), scores, -mx.inf)
        return scores.astype(mx.float32), next_keys

    return mx.compile(part)
