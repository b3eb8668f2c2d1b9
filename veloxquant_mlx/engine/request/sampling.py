"""Sampling for a batch of rows in one vectorized pass (engine thread).

Each request's settings become one row of per-row arrays (``RowSampling`` holds them while the
row is out of a batch); ``BatchSampler`` samples every row of a step at once: logit bias as one
sparse add, penalties from a table of each row's recent tokens, grammar masks as one bitmask,
min_p / top_p / top_k as one threshold per row (one sort a step, only when some row needs
it), temperature, and a Gumbel-max draw from each row's own random key (``mx.vmap`` over the
keys), so a seeded request gives the same tokens alone or in any batch. On a CPU every sampled
row is drawn on the host instead (``host_draw``: numpy's noise from the same keys, a sort only
for rows whose drawn token top_p may cut). Greedy rows take the argmax; a batch of greedy
rows without processors costs one argmax.

The filters, penalties and bias follow mlx_lm's ``make_sampler`` and ``make_logits_processors``
(order: bias, repetition, presence, frequency, grammar; then top_p, min_p, top_k on the
log-probabilities, then temperature), with one difference: ``top_k`` keeps every token tied
with the k-th.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.request.host_draw import host_draw
from veloxquant_mlx.engine.request.logit_filters import HALF, filter_logits
from veloxquant_mlx.engine.types import SamplingParams

WINDOW = 20  # the tokens the penalties look back over (mlx_lm's default context size)


class RowSampling:
    """One request's sampling as per-row values, and its state while out of a batch: its
    random key and its last ``WINDOW`` tokens (for penalties; ``vocab_size`` pads).

    Raises ValueError for settings the vocabulary cannot take (``top_k`` at or past it).
    """

    __slots__ = (
        "bias",
        "frequency",
        "inv_temp",
        "key",
        "min_p",
        "presence",
        "repetition",
        "top_k",
        "top_p",
        "window",
    )

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        if params.top_k and not 0 < params.top_k < vocab_size:
            raise ValueError(f"top_k must be in (0, {vocab_size}), got {params.top_k}")
        self.inv_temp = 0.0 if params.greedy else 1.0 / params.temperature
        self.top_p = params.top_p
        self.min_p = params.min_p
        self.top_k = params.top_k
        self.repetition = params.repetition_penalty
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.bias = params.logit_bias
        seed = params.key_seed if params.key_seed is not None else secrets.randbits(63)
        self.key: mx.array | None = None if params.greedy else mx.random.key(seed)
        self.window: mx.array | None = None

    @property
    def penalized(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    def start_window(self, prompt: Sequence[int], vocab_size: int) -> None:
        """The window a row starts decoding with: its prompt's last tokens."""
        if self.penalized:
            tail = list(prompt[-WINDOW:])
            self.window = mx.array([vocab_size] * (WINDOW - len(tail)) + tail, dtype=mx.int32)


_NEUTRAL = RowSampling(SamplingParams(temperature=0.0), 1)  # a hole's row


@dataclass(slots=True)
class Drawn:
    """One pass's results (lazy): the tokens, and for rows that asked, logprobs."""

    tokens: mx.array  # [rows] uint32
    token_logprobs: mx.array | None  # [rows] the drawn tokens' log-probabilities
    top_ids: mx.array | None  # [rows, k] the k most likely tokens, most likely first
    top_logprobs: mx.array | None  # [rows, k]
    state: list[mx.array]  # what the sampler carries to the next step (evaluate with tokens)


class BatchSampler:
    """Samples a fixed list of rows (a batch's, or the prompts a prefill completes), step after
    step. Owns its rows' keys and windows while it lives: ``release_row`` hands one back to
    its ``RowSampling`` (a row leaving), ``release`` every row's. Engine thread only.

    Args:
        rows: Each row's sampling; None for a hole (greedy, unprocessed, never read).
        vocab_size: The logits' width.
        top_logprobs: The most top log-probabilities a row asked for; None: no row asked for
            log-probabilities.
        previous: The sampler of the batch's previous row set: the rows still in the same slot
            keep their keys and windows from it (no per-row copy when one row joins or leaves).
    """

    def __init__(
        self,
        rows: Sequence[RowSampling | None],
        vocab_size: int,
        top_logprobs: int | None = None,
        previous: BatchSampler | None = None,
        cut: str = "sort",
    ) -> None:
        self.rows = list(rows)
        self.cut = cut
        self.vocab_size = vocab_size
        self.top_logprobs = top_logprobs
        real = [_NEUTRAL if r is None else r for r in self.rows]
        self._real = real

        def column(values: list[float], dtype: mx.Dtype = mx.float32) -> mx.array:
            return mx.array(values, dtype=dtype)[:, None]

        self.sampled = any(r.inv_temp > 0.0 for r in real)
        self.keys: mx.array | None = None
        if self.sampled:
            dummy = mx.random.key(0)
            self.keys = self._carried(
                None if previous is None else previous.keys,
                previous,
                lambda r: dummy if r.key is None else r.key,
            )
            self.inv_temp = column([r.inv_temp for r in real])
            self.top_p = column([r.top_p if r.inv_temp > 0 else 1.0 for r in real])
            self.min_p = column([r.min_p if r.inv_temp > 0 else 0.0 for r in real])
            self.top_k = column([r.top_k if r.inv_temp > 0 else 0 for r in real], mx.int32)
            sampled = [r for r in real if r.inv_temp > 0]
            self.uses_min_p = any(r.min_p > 0.0 for r in sampled)
            self.uses_sort = any(r.top_p < 1.0 or r.top_k > 0 for r in sampled)
            self.uses_top_k = any(r.top_k > 0 for r in sampled)
        self.penalized = any(r.penalized for r in real)
        self.window: mx.array | None = None
        if self.penalized:
            pad = mx.full((WINDOW,), vocab_size, dtype=mx.int32)
            self.window = self._carried(
                None if previous is None else previous.window,
                previous,
                lambda r: r.window if r.penalized and r.window is not None else pad,
            )
            self.repetition = column([r.repetition for r in real])
            self.presence = column([r.presence for r in real])
            self.frequency = column([r.frequency for r in real])
        biased = [(i, t, v) for i, r in enumerate(real) for t, v in r.bias]
        self.bias: tuple[mx.array, mx.array, mx.array] | None = None
        if biased:
            rows_, tokens, values = zip(*biased, strict=True)
            self.bias = (mx.array(rows_), mx.array(tokens), mx.array(values, dtype=mx.float32))

    def _carried(
        self,
        old: mx.array | None,
        previous: BatchSampler | None,
        fresh: Callable[[RowSampling], mx.array],
    ) -> mx.array:
        """Per-row state [rows, ...]: ``old``'s rows for the rows in the same slot of
        ``previous``, ``fresh`` (from the ``RowSampling``) for the others."""
        real, n = self._real, len(self.rows)
        if old is None or previous is None:
            return mx.stack([fresh(r) for r in real])
        before = previous.rows
        changed = [
            i
            for i in range(n)
            if self.rows[i] is not None and (i >= len(before) or before[i] is not self.rows[i])
        ]
        kept = old[: min(n, old.shape[0])]
        if kept.shape[0] < n:  # new slots at the end: filled below (holes stay as they are)
            kept = mx.concatenate(
                [kept, mx.broadcast_to(old[:1], (n - kept.shape[0], *old.shape[1:]))]
            )
        if changed:
            kept[mx.array(changed)] = mx.stack([fresh(real[i]) for i in changed])
        return kept

    def release_row(self, i: int, row: RowSampling | None = None) -> None:
        """Hand row ``i``'s key and window back to its ``RowSampling`` (it leaves the batch);
        with ``row``, only if that is the row this sampler has in slot ``i``."""
        held = self.rows[i] if i < len(self.rows) else None
        if held is None or (row is not None and held is not row):
            return
        row = held
        if self.keys is not None and row.key is not None:
            row.key = self.keys[i]
        if self.window is not None and row.penalized:
            row.window = self.window[i]

    def release(self) -> None:
        """Hand every row's key and window back to it."""
        for i in range(len(self.rows)):
            self.release_row(i)

    def draw(
        self, logits: mx.array, inputs: mx.array | None = None, allowed: mx.array | None = None
    ) -> Drawn:
        """Sample one token per row from ``logits`` [rows, vocab]. ``inputs`` [rows]: the
        tokens this step fed (they join the penalty windows first); ``allowed`` [rows, vocab]:
        the grammar masks (None: no row is constrained)."""
        if self.bias is not None:
            rows, tokens, values = self.bias
            logits = logits.at[rows, tokens].add(values.astype(logits.dtype))
        if self.penalized:
            logits = self._penalize(logits, inputs)
        if allowed is not None:
            logits = mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
        # Drawing needs no normalising (argmax, the filters and the Gumbel draw are the same
        # for logits shifted per row): the log-softmax is made only for rows' logprobs.
        tokens = mx.argmax(logits, axis=-1)
        state: list[mx.array] = [] if self.window is None else [self.window]
        if self.sampled:
            assert self.keys is not None
            ranks = "sort" if self.uses_sort else ""
            if HOST_DRAW and mx.default_device() == mx.cpu:  # every sampled row: one noise
                ranks = "host"
            elif ranks and self.cut == "histogram" and logits.dtype in HALF:
                ranks = "histogram"
            args = (logits, self.keys, self.inv_temp, self.top_p, self.top_k, self.min_p)
            if ranks == "host":
                tokens, self.keys = host_draw(*args, self.uses_min_p)
            else:
                tokens, self.keys = _compiled_draw(self.uses_min_p, ranks, self.uses_top_k)(*args)
            state.append(self.keys)
        tokens = tokens.astype(mx.uint32)
        if self.top_logprobs is None:
            return Drawn(tokens, None, None, None, state)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        top_ids = top_values = None
        if self.top_logprobs:
            k = self.top_logprobs
            top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
            order = mx.argsort(-top_values, axis=-1)
            top_ids = mx.take_along_axis(top_ids, order, axis=-1)
            top_values = mx.take_along_axis(top_values, order, axis=-1).astype(mx.float32)
        return Drawn(tokens, chosen.astype(mx.float32), top_ids, top_values, state)

    def _penalize(self, logits: mx.array, inputs: mx.array | None) -> mx.array:
        assert self.window is not None
        if inputs is not None:
            self.window = mx.concatenate(
                [self.window[:, 1:], inputs.astype(mx.int32)[:, None]], axis=1
            )
        n = self.window.shape[0]
        counts = mx.zeros((n, self.vocab_size + 1), dtype=mx.float32)
        counts = counts.at[mx.arange(n)[:, None], self.window].add(1.0)[:, : self.vocab_size]
        seen = counts > 0
        dtype = logits.dtype
        rep = self.repetition.astype(dtype)
        logits = mx.where(seen, mx.where(logits < 0, logits * rep, logits / rep), logits)
        logits = logits - self.presence.astype(dtype) * seen.astype(dtype)
        return logits - (self.frequency * counts).astype(dtype)


def tempered_with_noise(
    logits: mx.array, keys: mx.array, inv_temp: mx.array
) -> tuple[mx.array, mx.array]:
    """Each row's (kept) logits over its temperature plus Gumbel noise from its own key (MLX's,
    on the device), and its next key: what the device's draw takes the argmax of."""
    pairs = mx.vmap(mx.random.split)(keys)  # [rows, 2, 2]
    vocab = logits.shape[-1]
    noise = mx.vmap(lambda k: mx.random.gumbel(shape=(vocab,), key=k))(pairs[:, 1])
    return logits * inv_temp.astype(logits.dtype) + noise, pairs[:, 0]


def _draw(
    logits: mx.array,
    keys: mx.array,
    inv_temp: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    *,
    uses_min_p: bool,
    ranks: str,
    uses_top_k: bool,
) -> tuple[mx.array, mx.array]:
    """Each row's token (a Gumbel-max draw from its filtered, tempered logits with its own
    key; the argmax for greedy rows) and each row's next key."""
    kept = filter_logits(logits, top_p, top_k, min_p, uses_min_p, ranks, uses_top_k)
    scores, next_keys = tempered_with_noise(kept, keys, inv_temp)
    drawn = mx.argmax(scores, axis=-1)
    return mx.where(inv_temp[:, 0] > 0, drawn, mx.argmax(logits, axis=-1)), next_keys


@functools.cache
def _compiled_draw(uses_min_p: bool, ranks: str, uses_top_k: bool) -> Any:
    """``_draw`` compiled once per filter combination (MLX traces it again per batch size).
    ``ranks``: how the top_p / top_k cut is made ("sort", "histogram"; "": no row cuts by
    rank or mass)."""
    return mx.compile(
        functools.partial(_draw, uses_min_p=uses_min_p, ranks=ranks, uses_top_k=uses_top_k)
    )


# On a CPU, MLX's sort of a [rows, vocab] array costs more than the rest of sampling (26 ms
# for 8 rows of 32,000 here, numpy's 2.4 ms) and its Gumbel noise 3.5 ms (numpy's 0.8): there
# every sampled row is drawn on the host (``host_draw``: numpy's noise, a sort only for rows
# whose drawn token top_p may cut), so a seed's noise is the same alone or in any batch.
HOST_DRAW = True
