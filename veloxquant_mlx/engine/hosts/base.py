"""What every host of the engine shares: the load handshake, the ``EngineInfo`` it ends with, the
caller-side tools made from the tokenizer, the checks made at submit, and the stats assembled
from the engine's snapshot. A host differs from another only in how it reaches the engine loop
(a thread's inbox, a child process's pipe)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veloxquant_mlx.engine.model.tokenizer import load_tokenizer
from veloxquant_mlx.engine.request.checks import resolve_kv_format, static_problem
from veloxquant_mlx.engine.request.detokenize import token_bytes_table
from veloxquant_mlx.engine.request.grammar import GrammarCompiler, grammar_tokenizer
from veloxquant_mlx.engine.types import (
    EngineError,
    EngineInfo,
    EngineNotReadyError,
    GenerationRequest,
    GroupInfo,
    InvalidRequestError,
)

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.parts import Parts


def wait_cancellable(
    future: Future[Any],
    timeout: float,
    cancelled: threading.Event | None,
    on_cancel: Callable[[], object],
) -> Any:
    """``future``'s result within ``timeout`` seconds; when ``cancelled`` is set meanwhile,
    ``on_cancel()`` (tell the engine to stop) and CancelledError. Polled every 50 ms."""
    if cancelled is None:
        return future.result(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(min(0.05, max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            if cancelled.is_set():
                on_cancel()
                raise CancelledError from None
            if time.monotonic() >= deadline:
                raise


class HostBase:
    """The host's side of the engine's identity and readiness.

    Owns ``info`` (set once, when the engine is ready; read-only afterwards), the tokenizer the
    routes template and tokenize with, its byte table and the ``GrammarCompiler`` (None when
    the tokenizer cannot be constrained), and ``_refused`` (refusals decided here, by reason;
    guarded by ``_refused_lock``). Subclasses say whether the engine is ``alive`` and
    ``draining``.
    """

    def __init__(self) -> None:
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        self.token_bytes: list[bytes] | None = None
        self.grammars: GrammarCompiler | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._refused: collections.Counter[str] = collections.Counter()
        self._refused_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def draining(self) -> bool:
        raise NotImplementedError

    def stalled_for(self) -> float:
        """Seconds the engine has had work and shown no progress (0: idle or progressing).
        Measured where a host can see it without the engine's help (an engine process's pipe);
        0 for the thread, whose death is seen directly."""
        return 0.0

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None and self.alive

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine has loaded. Raises its load error, or TimeoutError."""
        if not self._ready.wait(timeout):
            if self._load_error is not None:
                raise self._load_error
            raise TimeoutError("engine not ready in time")
        if self._load_error is not None:
            raise self._load_error

    def _loaded(self, info: EngineInfo, parts: Parts | None = None) -> None:
        """The engine is ready: keep its ``info`` and the tokenizer-side tools, taken from the
        loop's ``parts`` when the loop is in this process, else made from the tokenizer at
        ``info.model_path``. Raises what loading the tokenizer raises; ``wait_ready`` stays
        blocked until ``_ready`` is set."""
        if parts is not None:
            self.tokenizer, self.token_bytes, self.grammars = (
                parts.tokenizer,
                parts.token_bytes,
                parts.grammars,
            )
        else:
            tokenizer = load_tokenizer(Path(info.model_path), info.chat_template)
            self.token_bytes = token_bytes_table(tokenizer)
            ll_tokenizer = grammar_tokenizer(tokenizer, info.vocab_size)
            self.grammars = None if ll_tokenizer is None else GrammarCompiler(ll_tokenizer)
            self.tokenizer = tokenizer
        self.info = info

    def _stop_tools(self) -> None:
        if self.grammars is not None:
            self.grammars.shutdown()

    # ------------------------------------------------------------------ what info says

    @property
    def model_name(self) -> str:
        return self.info.model_name if self.info else ""

    @property
    def model_path(self) -> str:
        return self.info.model_path if self.info else ""

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size if self.info else 0

    @property
    def context_window(self) -> int | None:
        return self.info.context_window if self.info else None

    @property
    def kv_bytes_per_block(self) -> int:
        return self.info.kv_bytes_per_block if self.info else 0

    @property
    def kv_layers(self) -> int:
        """Layers whose K and V take pool blocks: a token block is ``2 * kv_layers`` blocks."""
        return self.info.kv_layers if self.info else 0

    @property
    def blas(self) -> str:
        return self.info.blas if self.info else "unknown"

    @property
    def device(self) -> str:
        return self.info.device if self.info else "unknown"

    @property
    def group_info(self) -> GroupInfo:
        return self.info.group if self.info else GroupInfo()

    # ------------------------------------------------------------------ submit's checks

    def _refuse(self, error: EngineError) -> EngineError:
        """Count ``error`` as a refusal (``rejections_total``) and return it to raise."""
        with self._refused_lock:
            self._refused[error.reason] += 1
        return error

    def _refusals(self) -> dict[str, int]:
        with self._refused_lock:
            return dict(self._refused)

    def _check(self, request: GenerationRequest) -> GenerationRequest:
        """What the engine relies on and the model's static facts decide, on the caller's
        thread: running, not draining, the vocabulary and context window, a compiled grammar,
        a KV format this server allows. Returns the request with its format resolved
        (``checks.resolve_kv_format``).

        Raises:
            EngineNotReadyError, InvalidRequestError, RequestTooLargeError.
        """
        if not self.ready or self.draining:
            why = "the engine is draining" if self.draining else "the engine is not running"
            raise self._refuse(EngineNotReadyError(why))
        problem = static_problem(request, self.vocab_size, self.context_window)
        if problem is not None:
            raise self._refuse(problem)
        if request.grammar is not None and self.grammars is None:
            raise self._refuse(InvalidRequestError("this model's output cannot be constrained"))
        if request.kv_format:
            allowed = self.info.kv_formats if self.info else ()
            try:
                fmt = resolve_kv_format(request.kv_format, allowed)
            except InvalidRequestError as exc:
                raise self._refuse(exc) from None
            request = dataclasses.replace(request, kv_format=fmt)
        return request
