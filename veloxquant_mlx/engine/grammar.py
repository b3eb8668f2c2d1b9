"""Grammar-constrained decoding with llguidance: one matcher per request, applied as that
request's logits processor, so constrained requests stay batched with everyone else.

Why llguidance: vLLM, SGLang and llama.cpp use it; it compiles JSON schemas and Lark grammars
lazily (no per-schema precompute over the vocabulary, so a new schema costs milliseconds, not
seconds), reports unsupported schema keywords by name, and ships as a prebuilt wheel (no code is
compiled at run time). xgrammar precompiles per schema; outlines-core builds an index per regex.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger("veloxquant.engine")


def grammar_tokenizer(tokenizer: Any, n_vocab: int) -> Any | None:
    """llguidance's view of an mlx_lm tokenizer (O(vocabulary), once at load), or None when
    the tokenizer is not a Hugging Face fast tokenizer (then constraints are refused with 400).
    Every id mlx_lm treats as end of sequence ends the grammar too."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # pragma: no cover - a dependency; kept optional for odd platforms
        return None
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
    except Exception as exc:  # not a fast tokenizer, or one llguidance cannot read
        log.warning("structured outputs are off for this tokenizer: %s", exc)
        return None


def check_grammar(grammar: str, ll_tokenizer: Any) -> str | None:
    """None if ``grammar`` compiles for this tokenizer, else the reason (for a 400). Pure CPU,
    no MLX: callable from any thread."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    return messages[0] if is_error else None


class GrammarProcessor:
    """A logits processor that allows only tokens the request's grammar accepts next.

    Owns one ``LLMatcher``. Called by BatchGenerator once per generated token with the row's
    token context (prompt + generated so far): the tokens that arrived since the last call are
    fed to the matcher, then every token the grammar rejects gets -inf. Once the grammar is
    complete only end-of-sequence is allowed. Reading the sampled token is a synchronisation
    point for the batch (the mask depends on it); only constrained requests pay it.
    Engine thread only.
    """

    def __init__(self, grammar: str, ll_tokenizer: Any, vocab_size: int) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar rejected: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self._seen: int | None = None  # context length at the last call

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = int(tokens.shape[-1])
        if self._seen is not None and n > self._seen and not self.matcher.is_stopped():
            # Once complete (end of sequence sampled), the batch may still run this row one
            # more step before it leaves: nothing more is fed to the matcher then.
            new: list[int] = tokens[..., self._seen :].reshape(-1).tolist()  # type: ignore[assignment]
            for token in new:
                if self.matcher.is_stopped():
                    break
                if not self.matcher.consume_token(token):
                    raise ValueError(f"a token broke the grammar: {self.matcher.get_error()}")
        self._seen = n
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: self.vocab_size].astype(bool)
        if allowed.shape[0] < self.vocab_size:  # ids llguidance does not know are never allowed
            allowed = np.pad(allowed, (0, self.vocab_size - allowed.shape[0]))
        mask = mx.array(allowed)
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))
