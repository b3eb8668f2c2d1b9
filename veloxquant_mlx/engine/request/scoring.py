"""Prompt logprobs (``echo`` with ``logprobs``): one forward pass over a prompt (engine thread)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

TokenScore = tuple[float | None, tuple[tuple[int, float], ...]]


def prompt_logprobs(model: Any, prompt: tuple[int, ...], top: int) -> list[TokenScore]:
    """Each prompt token's logprob given the tokens before it (None for the first), and the
    ``top`` most likely tokens at each position.

    One forward pass without a KV cache: it holds activations for the prompt only while it runs
    (not pool-accounted; prompts are bounded by the context window). Engine thread only.
    """
    logits = model(mx.array([list(prompt)]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    scores: list[TokenScore] = [(None, ())]
    if len(prompt) < 2:
        return scores
    targets = mx.array(list(prompt[1:]))[:, None]
    chosen = mx.take_along_axis(logprobs[:-1], targets, axis=-1)[:, 0]
    tops: list[tuple[tuple[int, float], ...]] = [()] * (len(prompt) - 1)
    if top:
        idx = mx.argpartition(-logprobs[:-1], kth=top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(logprobs[:-1], idx, axis=-1)
        order = mx.argsort(-values, axis=-1)
        idx, values = (
            mx.take_along_axis(idx, order, axis=-1),
            mx.take_along_axis(values, order, axis=-1),
        )
        ids: list[list[int]] = idx.tolist()  # type: ignore[assignment]
        lps: list[list[float]] = values.tolist()  # type: ignore[assignment]
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids, lps, strict=True)]
    values_list: list[float] = chosen.tolist()  # type: ignore[assignment]
    scores += list(zip(values_list, tops, strict=True))
    return scores
