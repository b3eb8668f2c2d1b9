"""What a request must satisfy that needs only the model's static facts (its vocabulary and
context window): checked on the caller's thread, in the server's process, before the request
reaches the engine. Plain Python, no MLX."""

from __future__ import annotations

from veloxquant_mlx.engine.types import (
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    RequestTooLargeError,
)


def static_problem(
    request: GenerationRequest, vocab_size: int, context_window: int | None
) -> EngineError | None:
    """The error ``request`` must be refused with, or None: a token id, ``top_k`` or
    ``logit_bias`` key outside the vocabulary, or prompt + ``max_tokens`` over the window."""
    vocab = vocab_size
    sampling = request.sampling
    if not tokens_in_vocabulary(request.prompt_tokens, vocab):
        return InvalidRequestError(f"token ids must be in [0, {vocab})", "prompt")
    if sampling.top_k >= vocab:
        return InvalidRequestError(
            f"top_k must be below the vocabulary size {vocab} (0 or -1: off)", "top_k"
        )
    if any(not 0 <= t < vocab for t, _ in sampling.logit_bias):
        return InvalidRequestError(
            f"logit_bias keys must be token ids in [0, {vocab})", "logit_bias"
        )
    n_prompt = len(request.prompt_tokens)
    end = n_prompt + request.max_tokens
    if context_window is not None and end > context_window:
        return RequestTooLargeError(  # OpenAI's wording: clients match it
            f"This model's maximum context length is {context_window} tokens. However, you "
            f"requested {end} tokens ({n_prompt} in the prompt, {request.max_tokens} in the "
            "completion). Please reduce the length of the prompt or messages, or max_tokens.",
            (n_prompt, request.max_tokens, context_window),
        )
    return None


# The float formats' short names (--kv-format's) and the names they stand for (kv.codec).
FLOAT_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def resolve_kv_format(requested: str, allowed: tuple[str, ...]) -> str:
    """A request's ``kv_format`` as the engine keys it: "" for the server's own format
    (``allowed[0]``; also what "auto" and an empty value ask for), else the canonical name of
    another format in ``allowed``.

    Raises:
        InvalidRequestError: A format this server does not allow (param ``kv_format``).
    """
    if requested in ("", "auto"):
        return ""
    name = FLOAT_NAMES.get(requested, requested)
    if allowed and name == allowed[0]:
        return ""
    if name not in allowed:
        short = {v: k for k, v in FLOAT_NAMES.items()}
        names = ", ".join(["auto", *(short.get(a, a) for a in allowed)])
        raise InvalidRequestError(
            f"kv_format {requested!r} is not served here; this server allows: {names} "
            "(--kv-formats)",
            "kv_format",
        )
    return name


def tokens_in_vocabulary(tokens: tuple[int, ...], vocab_size: int) -> bool:
    return all(0 <= t < vocab_size for t in tokens)


def score_problem(
    prompt: tuple[int, ...], vocab_size: int, context_window: int | None
) -> EngineError | None:
    """The error a prompt to score must be refused with, or None."""
    if not tokens_in_vocabulary(prompt, vocab_size):
        return InvalidRequestError(f"token ids must be in [0, {vocab_size})", "prompt")
    if context_window is not None and len(prompt) > context_window:
        return InvalidRequestError(
            f"This model's maximum context length is {context_window} tokens. However, the "
            f"prompt is {len(prompt)} tokens.",
            "prompt",
        )
    return None
