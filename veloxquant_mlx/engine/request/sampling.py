"""Per-request samplers with their own random keys, and logits processors (engine thread)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from veloxquant_mlx.engine.request.grammar import Grammar, GrammarProcessor
from veloxquant_mlx.engine.types import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def make_sampler(params: SamplingParams) -> Sampler | None:
    """A sampler for one request, or None for greedy (BatchGenerator's shared argmax path).

    Each sampled request draws from its own key (``seed``, or a random one), split once per
    token, so its tokens do not depend on which other requests share the batch.
    """
    if params.greedy:
        return None
    seed = params.key_seed
    state = {"key": mx.random.key(seed if seed is not None else secrets.randbits(63))}
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        if 0.0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        key, sub = mx.random.split(state["key"])
        state["key"] = key
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def make_processors(
    params: SamplingParams,
    grammar: Grammar | None = None,
    vocab_size: int = 0,
) -> list[Callable[[mx.array, mx.array], mx.array]]:
    """mlx_lm's logits processors for the penalties and logit bias this request sets (or none),
    then its ``grammar``'s (compiled; last: it sees the penalties' and biases' result)."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
    if grammar is not None:
        processors.append(GrammarProcessor(grammar, vocab_size))
    return processors
