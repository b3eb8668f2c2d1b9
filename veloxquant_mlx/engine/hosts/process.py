"""EngineProcess: the server's facade over an engine running in a process of its own.

The same calls as ``engine.Engine`` (submit, cancel, shrink, reset_prefix_cache, score, view,
stats, shutdown), so the server uses either. The child (``process.serve``) owns the model, the
scheduler, the pool and every MLX call; this side owns the pipe, the handles of unfinished
requests and a copy of the tokenizer (the routes tokenize and render chat templates here).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.model import loader
from veloxquant_mlx.engine.request.checks import static_problem
from veloxquant_mlx.engine.request.detokenize import token_bytes_table
from veloxquant_mlx.engine.request.grammar import GrammarCompiler, grammar_tokenizer
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import (
    ENGINE_FAILED,
    EngineError,
    EngineNotReadyError,
    EngineStats,
    EngineView,
    FinishEvent,
    GenerationRequest,
    GroupInfo,
    InvalidRequestError,
    TokenEvent,
    Usage,
)
from veloxquant_mlx.pool import BlockPoolAllocator

__all__ = ["EngineProcess"]

log = logging.getLogger("veloxquant.engine")


class EngineProcess:
    """Runs the engine in a child process (``python -m veloxquant_mlx.engine.hosts.child``; never
    a fork: MLX and threads do not survive one).

    Owns the child, the pipe's parent end and ``_handles`` (id -> handle of every request sent
    and not finished, guarded by ``_lock``). A reader thread takes the child's messages and hands
    events to the handles exactly as the engine thread does in process: one
    ``call_soon_threadsafe`` per event loop per step. If the child dies, every unfinished
    request ends with ``ENGINE_FAILED`` and ``alive`` turns false (the app then exits non-zero).

    Args:
        config: What the child loads and how it batches.
        log_format, log_level: The child's log lines (its stderr is this process's).
        switch_interval: ``sys.setswitchinterval`` for the child (seconds), or None.
    """

    pool: BlockPoolAllocator | None = None  # in the child: read it through view()

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_format: str = "text",
        log_level: str = "info",
        switch_interval: float | None = None,
    ) -> None:
        self.config = config
        self._child_args = (log_format, log_level, switch_interval)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._rejected: Counter[str] = Counter()  # refused here, before the child saw them
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._alive = False
        self._draining = False
        self._exited = threading.Event()
        self._last_view: EngineView | None = None
        self._process: Any = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None
        # Filled when the child is ready (read-only afterwards).
        self.tokenizer: Any = None
        self.model_name = ""
        self.model_path = ""
        self.kv_bytes_per_block = 0
        self.blas = "unknown"
        self.device = "unknown"
        self.vocab_size = 0
        self.group_info = GroupInfo()  # an engine process is never part of a group
        self.kv_layers = 0
        self.token_bytes: list[bytes] | None = None
        self.grammars: GrammarCompiler | None = None  # this side's, for the routes' checks
        self._context_window: int | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EngineProcess:
        # A plain child process (not multiprocessing's spawn, which re-runs the parent's main
        # script) with one end of a socket pair; the config travels as the first message.
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        fd = theirs.fileno()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "veloxquant_mlx.engine.hosts.child", str(fd)], pass_fds=[fd]
        )
        theirs.close()
        self._alive = True
        self._send(("config", self.config, *self._child_args))
        self._reader = threading.Thread(
            target=self._read, name="veloxquant-engine-pipe", daemon=True
        )
        self._reader.start()
        atexit.register(self._kill)
        return self

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None before start)."""
        return None if self._process is None else self._process.pid

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the child has loaded the model. Raises its load error, or TimeoutError."""
        if not self._ready.wait(timeout):
            raise TimeoutError("engine not ready in time")
        if self._load_error is not None:
            raise self._load_error

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None and self._alive

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def context_window(self) -> int | None:
        return self._context_window

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting; the child lets running requests finish until the deadline and fails
        the rest, then exits. Returns when it has (killed if it overstays by 30 s). Idempotent."""
        self._draining = True
        if self.grammars is not None:
            self.grammars.shutdown()
        if self._process is None:
            return
        if self._alive:
            with contextlib.suppress(EngineNotReadyError):  # gone already: nothing to drain
                self._send(("shutdown", max(0.0, drain_timeout)))
            self._exited.wait(max(0.0, drain_timeout) + 30.0)
        self._close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(10.0)
        self._kill()

    def _close(self) -> None:
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()

    def _kill(self) -> None:
        """Last resort (and at interpreter exit): the child must not outlive this process."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        self._close()  # the child sees the pipe close and stops
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5.0)

    # ------------------------------------------------------------------ the pipe

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, EOFError, ValueError) as exc:  # ValueError: closed on our side
                raise EngineNotReadyError("the engine is not running") from exc

    def _read(self) -> None:
        conn = self._conn
        try:
            while True:
                message = conn.recv()
                kind = message[0]
                if kind == "ev":
                    self._dispatch(message[1])
                elif kind == "ret":
                    with self._lock:
                        future = self._calls.pop(message[1], None)
                    if future is not None:
                        if message[2]:
                            future.set_result(message[3])
                        else:
                            future.set_exception(message[3])
                elif kind == "ready":
                    self._on_ready(message[1])
                elif kind == "load_error":
                    error = getattr(builtins, message[1], None)
                    if not (isinstance(error, type) and issubclass(error, Exception)):
                        error = RuntimeError
                    self._load_error = error(message[2])
                    self._ready.set()
                elif kind == "dead":
                    log.critical("the engine process reports: %s", message[1])
                    self._alive = False
                elif kind == "exit":
                    self._exited.set()
                    break
        except (EOFError, OSError):
            pass
        finally:
            self._gone()

    def _on_ready(self, info: dict[str, Any]) -> None:
        try:
            tokenizer = loader.load_tokenizer(Path(info["model_path"]))
            self.token_bytes = token_bytes_table(tokenizer)
            ll_tokenizer = grammar_tokenizer(tokenizer, info["vocab_size"])
            self.grammars = None if ll_tokenizer is None else GrammarCompiler(ll_tokenizer)
        except Exception as exc:
            log.exception("could not load the tokenizer the engine process serves")
            self._load_error = exc
            self._ready.set()
            return
        self.tokenizer = tokenizer
        self.model_name = info["model_name"]
        self.model_path = info["model_path"]
        self.kv_bytes_per_block = info["kv_bytes_per_block"]
        self.blas = info["blas"]
        self.device = info["device"]
        self.vocab_size = info["vocab_size"]
        self._context_window = info["context_window"]
        self.kv_layers = info["kv_layers"]
        self._ready.set()

    def _dispatch(self, items: list[tuple[int, list[TokenEvent | FinishEvent]]]) -> None:
        tokens: list[tuple[RequestHandle, list[TokenEvent]]] = []
        finishes: list[tuple[RequestHandle, FinishEvent]] = []
        with self._lock:
            for request_id, events in items:
                handle = self._handles.get(request_id)
                if handle is None:
                    continue
                last = events[-1]
                if isinstance(last, FinishEvent):
                    del self._handles[request_id]
                    finishes.append((handle, last))
                    events = events[:-1]
                if events:
                    tokens.append((handle, events))  # type: ignore[arg-type]
        RequestHandle.push_tokens(tokens)
        for handle, finish in finishes:
            handle._push(finish)

    def _gone(self) -> None:
        """The pipe closed: after a shutdown, or because the child died."""
        if not self._exited.is_set() and not self._draining and self._load_error is None:
            log.critical("the engine process exited unexpectedly")
        self._alive = False
        self._exited.set()
        if not self._ready.is_set():
            self._load_error = RuntimeError("the engine process exited while loading")
            self._ready.set()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        message = "the engine failed; the server is restarting"
        for handle in handles:
            usage = Usage(len(handle.request.prompt_tokens), 0, 0, 0)
            handle._push(
                FinishEvent(
                    "error", usage, time.monotonic(), error=message, error_code=ENGINE_FAILED
                )
            )
        for future in calls:
            future.set_exception(EngineNotReadyError("the engine is not running"))

    # ------------------------------------------------------------------ callers' API

    def _refuse(self, error: EngineError) -> EngineError:
        with self._lock:
            self._rejected[error.reason] += 1
        return error

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Send ``request`` to the engine; returns its handle at once. What the model's static
        facts decide raises here (as ``Engine.submit``); a refusal that needs the engine's state
        (queue full, a shrunk pool, draining) is the handle's FinishEvent, with the code
        ``types.REJECTED`` + reason (``types.rejection_of`` turns it back into the error).

        Raises:
            EngineNotReadyError: Still loading, draining, or the engine process is gone.
            InvalidRequestError, RequestTooLargeError: See ``checks.static_problem``.
        """
        if not self.ready or self._draining:
            why = "the engine is draining" if self._draining else "the engine is not running"
            raise self._refuse(EngineNotReadyError(why))
        problem = static_problem(request, self.vocab_size, self._context_window)
        if problem is not None:
            raise self._refuse(problem)
        if request.grammar is not None and self.grammars is None:
            raise self._refuse(InvalidRequestError("this model's output cannot be constrained"))
        request_id = next(self._ids)
        handle = RequestHandle(request_id, request)
        with self._lock:
            self._handles[request_id] = handle
        try:
            self._send(("add", request_id, request))
        except EngineNotReadyError:
            with self._lock:
                self._handles.pop(request_id, None)
            raise
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a queued or running request; the child frees its blocks within one step."""
        if not handle.done and self._alive:
            with contextlib.suppress(EngineNotReadyError):  # gone: _gone() ends the handle
                self._send(("cancel", handle.request_id))

    def shrink(self, stream: str, target_free: int, timeout: float = 30.0) -> int:
        """As ``Engine.shrink``, in the child."""
        return int(self._call("shrink", (stream, target_free), timeout))

    def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """As ``Engine.reset_prefix_cache``, in the child."""
        return int(self._call("reset_prefix_cache", (), timeout))

    def score(self, prompt: tuple[int, ...], top: int, timeout: float = 300.0) -> list[Any]:
        """As ``Engine.score``, in the child (blocks the caller)."""
        return list(self._call("score", (prompt, top, timeout), timeout + 5.0))

    def view(self, timeout: float = 10.0) -> EngineView:
        """The child's counters and pool now (one round trip); the last one seen once the
        child is gone, with ``alive`` false."""
        try:
            view: EngineView = self._call("view", (), timeout)
            self._last_view = view
        except EngineNotReadyError:
            view = self._last_view or EngineView(_NO_STATS, None)
        with self._lock:
            rejected = Counter(view.stats.rejections_total) + self._rejected
        stats = dataclasses.replace(
            view.stats,
            alive=self.alive,
            ready=self.ready,
            draining=self._draining or view.stats.draining,
            rejections_total=dict(rejected),
        )
        return EngineView(stats, view.pool)

    def stats(self) -> EngineStats:
        return self.view().stats

    def _call(self, name: str, args: tuple[Any, ...], timeout: float) -> Any:
        if not self._alive:
            raise EngineNotReadyError("the engine is not running")
        future: Future[Any] = Future()
        call_id = next(self._ids)
        with self._lock:
            self._calls[call_id] = future
        try:
            self._send(("call", call_id, name, args))
        except EngineNotReadyError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)


_NO_STATS = EngineStats(
    alive=False,
    ready=False,
    draining=False,
    running=0,
    waiting=0,
    prompt_tokens_total=0,
    generated_tokens_total=0,
    requests_finished_total={},
    rejections_total={},
    failures_total={},
    blocks_in_use=0,
    kv_bytes_per_block=0,
)
