"""EngineProcess: the server's host for an engine running in a process of its own.

The same calls as ``hosts.thread.Engine`` (``client.EngineClient``), so the server uses either.
The child (``hosts.child``) owns the model, the scheduler, the pool and every MLX call; this side
owns the pipe, the handles of unfinished requests and a copy of the tokenizer (the routes
tokenize and render chat templates here).
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
from typing import Any

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.hosts.base import HostBase, wait_cancellable
from veloxquant_mlx.engine.hosts.messages import (
    Add,
    Call,
    Cancel,
    Config,
    Dead,
    Events,
    Exit,
    LoadError,
    Ready,
    Return,
    Shutdown,
)
from veloxquant_mlx.engine.hosts.outbox import Outbox
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import (
    ENGINE_FAILED,
    EngineInfo,
    EngineNotReadyError,
    EngineStats,
    EngineView,
    FinishEvent,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from veloxquant_mlx.pool import BlockPoolAllocator

__all__ = ["EngineProcess"]

log = logging.getLogger("veloxquant.engine")


class EngineProcess(HostBase):
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
        super().__init__()
        self.config = config
        self._child_args = (log_format, log_level, switch_interval)
        self._lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._alive = False
        self._draining = False
        self._exited = threading.Event()
        self._last_view: EngineView | None = None
        self._last_view_at = 0.0  # monotonic time of _last_view
        self._outbox: Outbox | None = None  # the messages to the child, once started
        # When the child was last heard from; reset when work starts after an idle spell.
        self._last_heard = time.monotonic()
        self._process: Any = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None

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
        self._outbox = Outbox(self._conn)
        self._send(Config(self.config, *self._child_args))
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

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def draining(self) -> bool:
        return self._draining

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting; the child lets running requests finish until the deadline and fails
        the rest, then exits. Returns when it has (killed if it overstays by 30 s). Idempotent."""
        self._draining = True
        self._stop_tools()
        if self._process is None:
            return
        if self._alive:
            with contextlib.suppress(EngineNotReadyError):  # gone already: nothing to drain
                self._send(Shutdown(max(0.0, drain_timeout)))
            self._exited.wait(max(0.0, drain_timeout) + 30.0)
        self._close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(10.0)
        self._kill()

    def _close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()
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

    def _send(self, message: object) -> None:
        """Queue ``message`` for the child (``Outbox.put``); never blocks.

        Raises:
            EngineNotReadyError: The child is gone, or is not keeping up (``Outbox.put``).
        """
        if not self._alive or self._outbox is None:
            raise EngineNotReadyError("the engine is not running")
        self._outbox.put(message)

    def stalled_for(self) -> float:
        """Seconds the child has had work (requests or calls) and sent nothing; 0 when idle."""
        with self._lock:
            busy = bool(self._handles or self._calls)
        return time.monotonic() - self._last_heard if busy and self._alive else 0.0

    def _work_starts(self) -> None:
        """Called with ``_lock`` held before work is added: an idle spell is not a stall."""
        if not self._handles and not self._calls:
            self._last_heard = time.monotonic()

    def _read(self) -> None:
        conn = self._conn
        try:
            while True:
                message = conn.recv()
                self._last_heard = time.monotonic()
                if isinstance(message, Events):
                    self._dispatch(message.items)
                elif isinstance(message, Return):
                    with self._lock:
                        future = self._calls.pop(message.call_id, None)
                    if future is not None:
                        if message.ok:
                            future.set_result(message.value)
                        else:
                            future.set_exception(message.value)
                elif isinstance(message, Ready):
                    self._on_ready(message.info)
                elif isinstance(message, LoadError):
                    error = getattr(builtins, message.kind, None)
                    if not (isinstance(error, type) and issubclass(error, Exception)):
                        error = RuntimeError
                    self._load_error = error(message.message)
                    self._ready.set()
                elif isinstance(message, Dead):
                    log.critical("the engine process reports: %s", message.message)
                    self._alive = False
                elif isinstance(message, Exit):
                    self._exited.set()
                    break
        except (EOFError, OSError):
            pass
        finally:
            self._gone()

    def _on_ready(self, info: EngineInfo) -> None:
        try:
            self._loaded(info)
        except Exception as exc:
            log.exception("could not load the tokenizer the engine process serves")
            self._load_error = exc
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

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Send ``request`` to the engine; returns its handle at once. What the model's static
        facts decide raises here (as ``Engine.submit``); a refusal that needs the engine's state
        (queue full, a shrunk pool, draining) is the handle's FinishEvent, carrying a
        ``types.Refusal`` (``types.rejection_of`` turns it back into the error).

        Raises:
            EngineNotReadyError: Still loading, draining, or the engine process is gone.
            InvalidRequestError, RequestTooLargeError: See ``checks.static_problem``.
        """
        request = self._check(request)
        request_id = next(self._ids)
        handle = RequestHandle(request_id, request)
        with self._lock:
            self._work_starts()
            self._handles[request_id] = handle
        try:
            self._send(Add(request_id, request))
        except EngineNotReadyError:
            with self._lock:
                self._handles.pop(request_id, None)
            raise
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a queued or running request; the child frees its blocks within one step."""
        if not handle.done and self._alive:
            with contextlib.suppress(EngineNotReadyError):  # gone: _gone() ends the handle
                self._send(Cancel(handle.request_id))

    def shrink(self, stream: str, target_free: int, timeout: float = 30.0) -> int:
        """As ``Engine.shrink``, in the child."""
        return int(self._call("shrink", (stream, target_free), timeout))

    def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """As ``Engine.reset_prefix_cache``, in the child."""
        return int(self._call("reset_prefix_cache", (), timeout))

    def score(
        self,
        prompt: tuple[int, ...],
        top: int,
        timeout: float = 300.0,
        cancelled: threading.Event | None = None,
    ) -> list[Any]:
        """As ``Engine.score``, in the child (blocks the caller); ``cancelled`` sends the
        child a ``cancel_score`` for this call, which stops it at its next chunk."""
        future, call_id = self._start_call("score", (prompt, top, timeout))

        def cancel() -> None:
            with contextlib.suppress(EngineNotReadyError):
                self._send(Call(next(self._ids), "cancel_score", (call_id,)))

        try:
            return list(wait_cancellable(future, timeout + 5.0, cancelled, cancel))
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def view(self, timeout: float = 2.0) -> EngineView:
        """The child's counters and pool now (one round trip). When the child does not answer
        within ``timeout`` (stopped, or gone), the last view it sent, with ``age_s`` saying how
        old it is and ``alive``/``ready`` as this side knows them."""
        try:
            view: EngineView = self._call("view", (), timeout)
            self._last_view, self._last_view_at = view, time.monotonic()
            age = 0.0
        except (EngineNotReadyError, TimeoutError):
            view = self._last_view or EngineView(EngineStats(), None)
            age = time.monotonic() - self._last_view_at if self._last_view is not None else 0.0
        rejected = Counter(view.stats.rejections_total) + Counter(self._refusals())
        stats = dataclasses.replace(
            view.stats,
            alive=self.alive,
            ready=self.ready,
            draining=self._draining or view.stats.draining,
            rejections_total=dict(rejected),
        )
        return EngineView(stats, view.pool, age)

    def stats(self) -> EngineStats:
        return self.view().stats

    def _call(self, name: str, args: tuple[Any, ...], timeout: float) -> Any:
        future, call_id = self._start_call(name, args)
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def _start_call(self, name: str, args: tuple[Any, ...]) -> tuple[Future[Any], int]:
        if not self._alive:
            raise EngineNotReadyError("the engine is not running")
        future: Future[Any] = Future()
        call_id = next(self._ids)
        with self._lock:
            self._work_starts()
            self._calls[call_id] = future
        try:
            self._send(Call(call_id, name, args))
        except EngineNotReadyError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return future, call_id
