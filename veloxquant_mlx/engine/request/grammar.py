"""Grammar-constrained decoding with llguidance: grammars compiled off the engine thread, one
matcher per request, its allowed tokens filled into the batch's one bitmask each step
(``fill_masks``), so constrained requests stay batched with everyone else.

Why llguidance: vLLM, SGLang and llama.cpp use it; it reports unsupported schema keywords by
name, bounds its own work (``LLParserLimits``) and ships as a prebuilt wheel (no code is compiled
at run time). A grammar's compile grows with its size (a 1,000-property schema takes ~0.1 s here,
a 10,000-property one 9-14 s), so it never runs on the engine thread or the event loop: the
``GrammarCompiler`` builds it on a small pool of its own, under a time budget, and the engine is
handed a ready matcher.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("veloxquant.engine")

# llguidance's own budgets, tighter than its defaults where a hostile grammar could make one
# decode step slow: the per-token mask work (step fuel, Earley items) runs on the engine thread.
LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,  # ~20 ms of regex analysis at compile
    "step_lexer_fuel": 200_000,  # ~14 ms a token at most
    "step_max_items": 50_000,
    "max_lexer_states": 100_000,
    "max_grammar_size": 300_000,
}


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
        try:
            return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
        except TypeError:  # some llguidance builds take one end-of-sequence id
            return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos[0])
    except Exception as exc:  # not a fast tokenizer, or one llguidance cannot read
        log.warning("structured outputs are off for this tokenizer: %s", exc)
        return None


class GrammarError(ValueError):
    """A grammar that cannot be used: the reason is safe to show its client."""


class GrammarBusyError(RuntimeError):
    """Too many grammars are compiling at once; the client may retry."""


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """An llguidance grammar and, once compiled in this process, its pristine matcher.

    The compiled matcher never crosses a pipe or a group (pickling keeps only the text); the
    receiving side compiles it again with its own ``GrammarCompiler``. Each request decodes
    with its own ``deep_copy`` (microseconds: the compiled lexer and grammar are shared).
    """

    text: str
    compiled: Any = field(default=None, repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Grammar, (self.text,))

    def matcher(self) -> Any:
        assert self.compiled is not None, "a grammar reaches the engine compiled"
        return self.compiled.deep_copy()


class GrammarCompiler:
    """Compiles grammars on a bounded pool of worker threads (llguidance drops the GIL while it
    builds), caching the result by the grammar's hash.

    Owns the pool, ``_cache`` (hash -> pristine matcher or the error text, least recently used
    first, at most ``cache_size``) and ``_pending`` (hash -> the future of a compile under way,
    shared by every caller of the same grammar); ``_lock`` guards both. A compile whose caller
    stopped waiting (its time budget) still finishes on its worker and is cached: the same
    grammar then answers at once, and a slow one keeps at most ``workers`` threads busy.
    Thread-safe.

    Args:
        ll_tokenizer: llguidance's tokenizer (``grammar_tokenizer``).
        workers: Compiles run at once.
        max_pending: Compiles queued or running at most (then ``GrammarBusyError``).
        cache_size: Compiled grammars (and refusals) kept.
    """

    def __init__(
        self, ll_tokenizer: Any, *, workers: int = 2, max_pending: int = 16, cache_size: int = 64
    ) -> None:
        import llguidance

        self.ll_tokenizer = ll_tokenizer
        self._eos = tuple(getattr(ll_tokenizer, "eos_tokens", None) or [ll_tokenizer.eos_token])
        self.max_pending = max_pending
        self.cache_size = cache_size
        self._limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="veloxquant-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, Future[Grammar]] = {}

    def submit(self, text: str) -> Future[Grammar]:
        """The compiled ``Grammar`` for ``text``, as a future: done at once on a cache hit.
        Its exception is ``GrammarError`` for a grammar llguidance refuses (or a limit it hits).

        Raises:
            GrammarBusyError: ``max_pending`` compiles are under way already.
        """
        key = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return _done(text, cached)
            pending = self._pending.get(key)
            if pending is not None:
                return pending
            if len(self._pending) >= self.max_pending:
                raise GrammarBusyError(f"{len(self._pending)} grammars are compiling")
            future = self._pool.submit(self._compile, key, text)
            self._pending[key] = future
            return future

    def compile(self, text: str) -> Grammar:
        """``submit`` and wait (for callers that are off the engine thread already)."""
        return self.submit(text).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: str, text: str) -> Grammar:
        import llguidance

        outcome: Any
        try:
            matcher = llguidance.LLMatcher(
                self.ll_tokenizer, text, log_level=0, limits=self._limits
            )
            outcome = matcher.get_error() if matcher.is_error() else matcher
            if not matcher.is_error():
                # The first mask builds the lexer states every copy starts from (a wide anyOf:
                # ~120 ms here, then under 1 ms a copy): paid here, not on the engine's first
                # step. If only end-of-sequence may come first, the grammar admits nothing (a
                # schema that refers only to itself, ``{"$ref": "#"}``).
                first = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
                allowed = set(np.flatnonzero(np.unpackbits(first, bitorder="little")).tolist())
                stuck = matcher.is_error() and "NoExtension" in matcher.get_error()
                if stuck or not (matcher.is_error() or allowed - set(self._eos)):
                    outcome = "the grammar admits no output (the schema has no value)"
                elif matcher.is_error():
                    outcome = matcher.get_error()
        except Exception as exc:  # API misuse only (llguidance reports grammar errors itself)
            outcome = f"the grammar could not be compiled ({type(exc).__name__})"
        return self._store(key, text, outcome)

    def _store(self, key: str, text: str, outcome: Any) -> Grammar:
        """Cache the outcome of a compile (a matcher, or a refusal's text) and return it (or
        raise the refusal as ``GrammarError``)."""
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = outcome
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return _done(text, outcome).result()


def _done(text: str, outcome: Any) -> Future[Grammar]:
    future: Future[Grammar] = Future()
    if isinstance(outcome, str):  # llguidance's message; its first line is the reason
        future.set_exception(GrammarError(outcome.strip().splitlines()[0] if outcome else ""))
    else:
        future.set_result(Grammar(text, outcome))
    return future


class GrammarRow:
    """One constrained request's matcher (a copy of the compiled grammar's). ``advance`` feeds
    it each token the row generates; ``fill_masks`` computes every constrained row's next
    allowed tokens into one bitmask for the batch. Once the grammar is complete only
    end-of-sequence is allowed. Reading the sampled token is a synchronisation point for the
    batch (the mask depends on it); only batches with a constrained row pay it. Engine thread
    only.
    """

    __slots__ = ("matcher",)

    def __init__(self, grammar: Grammar) -> None:
        self.matcher = grammar.matcher()

    def advance(self, token: int) -> None:
        """Feed the row's latest token; ValueError if the grammar rejects it. Once complete (end
        of sequence sampled), the batch may still run the row one more step before it leaves:
        nothing more is fed then."""
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            raise ValueError(f"a token broke the grammar: {self.matcher.get_error()}")


_executor: Any = None


def fill_masks(rows: list[tuple[int, GrammarRow]], n_rows: int, vocab_size: int) -> np.ndarray:
    """The batch's packed bitmask [n_rows, words] (llguidance's layout, int32): every bit set
    for unconstrained rows, each listed row's allowed tokens for its index (llguidance fills
    them in parallel, off the GIL)."""
    global _executor
    import llguidance
    import llguidance.numpy

    if _executor is None:
        _executor = llguidance.LLExecutor()
    bits = llguidance.numpy.allocate_token_bitmask(n_rows, vocab_size)
    for i, _row in rows:
        bits[i] = 0  # ids the tokenizer does not know are never allowed
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor, [(row.matcher, i) for i, row in rows], bits
    )
    return bits
