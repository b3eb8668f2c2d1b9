"""The engine: one thread that owns the model, the pool-backed batch and every MLX call."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.handle import RequestHandle
from veloxquant_mlx.engine.loop import Counters, EngineLoop
from veloxquant_mlx.engine.scoring import prompt_logprobs
from veloxquant_mlx.engine.types import (
    CapacityReducedError,
    EngineNotReadyError,
    EngineStats,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
)

__all__ = ["Engine", "EngineConfig"]


class Engine(EngineLoop):
    """Runs every request on one thread with mlx_lm's BatchGenerator over pool-backed caches.

    Owns: the engine thread, the model and tokenizer (loaded on that thread), the
    ``BlockPoolAllocator`` (sized from the model's KV geometry), the BatchGenerator, the waiting
    FIFO and the running set. ``_lock`` (a Condition) guards the waiting queue, pending cancels,
    commands and counters; it is never held across an MLX call. Other threads call ``submit``,
    ``cancel``, ``stats``, ``shrink`` and ``shutdown``; they read the pool only through its own
    thread-safe methods.

    A request is admitted only when the pool can hold it to its end alongside every running
    request (see ``Admission``); until then it waits in FIFO order. Whatever ends a request
    (finish, stop string, cancel, error, shutdown), its blocks are released in a ``finally``
    with ``pool.free_all(request_id)``.

    Args:
        config: What to load and how to size and batch.
        step_hook: Called on the engine thread before every step (tests inject faults here).
    """

    def __init__(self, config: EngineConfig, *, step_hook: Callable[[], None] | None = None):
        self.config = config
        self._step_hook = step_hook
        self._lock = threading.Condition()
        self._waiting = collections.deque()
        self._cancels = set()
        self._commands = collections.deque()
        self._counters = Counters()
        self._next_request_id = 0
        self._ready = threading.Event()
        self._draining = False
        self._drain_deadline = None
        self._alive = False
        self._load_error = None
        self._running = {}  # engine thread only
        self._faulted = []  # engine thread only
        self._thread = threading.Thread(target=self._run, name="veloxquant-engine", daemon=True)
        # Set on the engine thread during load, read-only afterwards (types: EngineLoop).
        self.pool = None
        self.tokenizer = None
        self.model_name = ""
        self.geometry = None
        self.kv_bytes_per_block = 0
        self.blas = "unknown"
        self.device = "unknown"
        self.vocab_size = 0
        self.token_bytes = None
        self.ll_tokenizer = None
        self._model = None
        self._new_detokenizer = None
        self._generator = None
        self._admission = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        self._alive = True
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded. Raises the load error, or TimeoutError."""
        if not self._ready.wait(timeout):
            if self._load_error is not None:
                raise self._load_error
            raise TimeoutError("engine not ready in time")
        if self._load_error is not None:
            raise self._load_error

    @property
    def alive(self) -> bool:
        return self._alive and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None and self.alive

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def context_window(self) -> int | None:
        return self.geometry.context_window if self.geometry else None

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting; let running requests finish until the deadline; cancel the rest.

        Waiting requests are cancelled at once. Returns when the engine thread has exited and
        released every block. Idempotent.
        """
        with self._lock:
            if not self._draining:
                self._draining = True
                self._drain_deadline = time.monotonic() + max(0.0, drain_timeout)
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(max(0.0, drain_timeout) + 30.0)

    # ------------------------------------------------------------------ callers' API

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; returns its handle at once (events arrive as it runs).

        Raises:
            EngineNotReadyError: Still loading, draining, or the engine thread is dead.
            RequestTooLargeError: Over the context window, or more than the whole pool at its
                maximum size could ever hold.
            InvalidRequestError: A token id or ``top_k`` outside the model's vocabulary.
            QueueFullError: The waiting queue is at ``max_queue``.
        """
        end = len(request.prompt_tokens) + request.max_tokens
        if self.ready:
            self._validate(request)
        with self._lock:
            if not self.ready or self._draining:
                self._counters.rejected[EngineNotReadyError.reason] += 1
                raise EngineNotReadyError(
                    "the engine is draining" if self._draining else "the engine is not running"
                )
            assert self._admission is not None
            window = self.context_window
            if window is not None and end > window:
                self._counters.rejected[RequestTooLargeError.reason] += 1
                raise RequestTooLargeError(  # OpenAI's wording: clients match it
                    f"This model's maximum context length is {window} tokens. However, you "
                    f"requested {end} tokens ({len(request.prompt_tokens)} in the prompt, "
                    f"{request.max_tokens} in the completion). Please reduce the length of the "
                    "prompt or messages, or max_tokens."
                )
            if not self._admission.could_ever_fit(end):
                if self._admission.fits_configured(end):
                    self._counters.rejected[CapacityReducedError.reason] += 1
                    raise CapacityReducedError(
                        "the KV pool has been shrunk below what this request needs; "
                        "try again later or with a smaller max_tokens"
                    )
                self._counters.rejected[RequestTooLargeError.reason] += 1
                raise RequestTooLargeError(
                    f"prompt plus max_tokens ({end} tokens) needs more KV blocks than the "
                    "whole pool holds"
                )
            if len(self._waiting) >= self.config.max_queue:
                self._counters.rejected[QueueFullError.reason] += 1
                raise QueueFullError(f"{len(self._waiting)} requests waiting; try again later")
            self._next_request_id += 1
            handle = RequestHandle(self._next_request_id, request)
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    def _validate(self, request: GenerationRequest) -> None:
        """What would fail on the engine thread, checked on the caller's: ids and top_k."""
        vocab = self.vocab_size
        problem: tuple[str, str] | None = None
        sampling = request.sampling
        if any(not 0 <= t < vocab for t in request.prompt_tokens):
            problem = f"token ids must be in [0, {vocab})", "prompt"
        elif sampling.top_k >= vocab:
            problem = f"top_k must be below the vocabulary size {vocab} (0 or -1: off)", "top_k"
        elif any(not 0 <= t < vocab for t, _ in sampling.logit_bias):
            problem = f"logit_bias keys must be token ids in [0, {vocab})", "logit_bias"
        if problem is not None:
            with self._lock:
                self._counters.rejected[InvalidRequestError.reason] += 1
            raise InvalidRequestError(*problem)

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a queued or running request; its blocks are freed within one step."""
        with self._lock:
            if not handle.done:
                self._cancels.add(handle.request_id)
                self._lock.notify_all()

    def shrink(self, stream: str, target_free: int, timeout: float = 30.0) -> int:
        """Retire free blocks down to ``target_free`` on the engine thread, never below what
        running requests have been promised. ``stream`` "kv" on a separate pool means both.

        Raises:
            ValueError: On a bad stream or target; EngineNotReadyError if the engine is down.
        """
        if stream not in ("k", "v", "kv"):
            raise ValueError(f"stream must be 'k', 'v' or 'kv', got {stream!r}")
        if isinstance(target_free, bool) or not isinstance(target_free, int) or target_free < 0:
            raise ValueError(f"target_free must be an int >= 0, got {target_free!r}")
        return int(self._call(lambda: self._shrink(stream, target_free), timeout))

    def score(self, prompt: tuple[int, ...], top: int, timeout: float = 300.0) -> list[Any]:
        """Prompt logprobs (``scoring.prompt_logprobs``), computed on the engine thread between
        steps. Blocks the caller (use a worker thread from async code).

        Raises:
            InvalidRequestError: Token ids outside the vocabulary, or over the context window.
            EngineNotReadyError: If the engine is down.
        """
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", "prompt")
        window = self.context_window
        if window is not None and len(prompt) > window:
            raise InvalidRequestError(
                f"This model's maximum context length is {window} tokens. However, the prompt "
                f"is {len(prompt)} tokens.",
                "prompt",
            )
        return list(self._call(lambda: prompt_logprobs(self._model, prompt, top), timeout))

    def stats(self) -> EngineStats:
        """A frozen snapshot of the counters. Thread-safe."""
        with self._lock:
            c = self._counters
            return EngineStats(
                alive=self.alive,
                ready=self.ready,
                draining=self._draining,
                running=self._n_running,
                waiting=len(self._waiting),
                prompt_tokens_total=c.prompt_tokens,
                generated_tokens_total=c.generated_tokens,
                requests_finished_total=dict(c.finished),
                rejections_total=dict(c.rejected),
                failures_total=dict(c.failed),
                blocks_promised=self._promised,
                kv_bytes_per_block=self.kv_bytes_per_block,
            )

    def _call(self, fn: Callable[[], Any], timeout: float) -> Any:
        future: Future[Any] = Future()
        with self._lock:
            if not self.alive:
                raise EngineNotReadyError("the engine is not running")
            self._commands.append((fn, future))
            self._lock.notify_all()
        return future.result(timeout)
