"""Prompt logprobs (``echo`` with ``logprobs``): a prompt's forward pass, in chunks (engine
thread).

A ``ScoringJob`` runs one chunk of at most the step's prefill budget per engine turn, beside
the decode steps, with a KV cache across its chunks, so a long prompt to score is interleaved
with everyone else's tokens like a prefill, and a job whose caller gave up (its future
cancelled: the client left) stops at the next chunk. Its KV and activations are not
pool-accounted (transient, bounded by the context window).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.kv.room import make_room

TokenScore = tuple[float | None, tuple[tuple[int, float], ...]]


def _scores(rows: mx.array, targets: list[int], top: int) -> list[TokenScore]:
    """Each target token's logprob under its row of ``rows`` ([n, vocab] logprobs), and the
    ``top`` most likely tokens of each row."""
    chosen = mx.take_along_axis(rows, mx.array(targets)[:, None], axis=-1)[:, 0]
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top:
        idx = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(rows, idx, axis=-1)
        order = mx.argsort(-values, axis=-1)
        idx, values = (
            mx.take_along_axis(idx, order, axis=-1),
            mx.take_along_axis(values, order, axis=-1),
        )
        ids: list[list[int]] = idx.tolist()  # type: ignore[assignment]
        lps: list[list[float]] = values.tolist()  # type: ignore[assignment]
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids, lps, strict=True)]
    values_list: list[float] = chosen.tolist()  # type: ignore[assignment]
    return list(zip(values_list, tops, strict=True))


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prompt_logprobs(model: Any, prompt: tuple[int, ...], top: int) -> list[TokenScore]:
    """Each prompt token's logprob given the tokens before it (None for the first), and the
    ``top`` most likely tokens at each position: one forward pass (a group's ranks, which step
    together, score this way)."""
    logprobs = _logprobs(model(mx.array([list(prompt)]))[0])
    scores: list[TokenScore] = [(None, ())]
    if len(prompt) < 2:
        return scores
    return scores + _scores(logprobs[:-1], list(prompt[1:]), top)


class ScoringJob:
    """One prompt being scored a chunk at a time. The core owns it; ``future`` is its caller's
    (set by the turn that took the command)."""

    def __init__(self, prompt: tuple[int, ...], top: int) -> None:
        self.prompt = prompt
        self.top = top
        self.future: Future[Any] | None = None
        self.pos = 0  # tokens scored
        self.scores: list[TokenScore] = []
        self._caches: list[Any] | None = None
        self._last: mx.array | None = None  # the logprobs row predicting token ``pos``

    @property
    def abandoned(self) -> bool:
        return self.future is not None and self.future.cancelled()

    def step(self, model: Any, budget: int) -> bool:
        """Score the next ``budget`` tokens; True when the prompt is done (``scores`` full)."""
        if self._caches is None:
            self._caches = make_prompt_cache(model)
        a, b = self.pos, min(len(self.prompt), self.pos + max(1, budget))
        logprobs = _logprobs(model(mx.array([list(self.prompt[a:b])]), cache=self._caches)[0])
        rows = logprobs[:-1] if self._last is None else mx.concatenate([self._last, logprobs[:-1]])
        if self._last is None:
            self.scores.append((None, ()))
            targets = list(self.prompt[a + 1 : b])
        else:
            targets = list(self.prompt[a:b])
        if targets:
            self.scores += _scores(rows, targets, self.top)
        self._last = logprobs[-1:]
        if not a:  # room for the whole prompt: its later chunks write in place (kv.room)
            make_room(self._caches, len(self.prompt))
        self.pos = b
        if b == len(self.prompt):
            self._caches = None
            return True
        mx.eval(self._last, [c.state for c in self._caches])
        return False
