"""The engine in a process of its own: the child's side (``hosts.process.EngineProcess`` is the
server's).

Why a process: the event loop (HTTP, JSON, SSE) and the engine thread share one GIL in one
process, and at dozens of streams the loop's Python work delays every decode step
(DESIGN-NOTES.md, "Engine process"). Here the engine has its own interpreter; the two talk over
one duplex pipe with the frozen messages of ``hosts.messages``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from multiprocessing.connection import Connection
from typing import Any

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.hosts.messages import (
    CALLS,
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
from veloxquant_mlx.engine.hosts.thread import Engine
from veloxquant_mlx.engine.request.grammar import Grammar, GrammarBusyError, GrammarError
from veloxquant_mlx.engine.request.handle import Event, RequestHandle
from veloxquant_mlx.engine.types import (
    EngineError,
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    Refusal,
    Usage,
)

log = logging.getLogger("veloxquant.engine")


def serve(
    config: EngineConfig,
    conn: Connection,
    log_format: str = "text",
    log_level: str = "info",
    switch_interval: float | None = None,
) -> None:
    """The child process's main: load, then relay until the server says shutdown or goes away.

    Signals are the server's business: SIGINT (a terminal's Ctrl-C reaches the whole process
    group) and SIGTERM (systemd and ``kill -- -PGID`` signal every process) are ignored here,
    so the server's drain decides when this engine stops; it stops when the pipe closes too.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from veloxquant_mlx.logs import setup_logging

    setup_logging(log_format, log_level)
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    Bridge(Engine(config), conn).run()


class Bridge:
    """Owns the child's ``Engine`` and its end of the pipe; the event sink of every handle.

    ``_handles`` (server id -> handle of a request not yet finished) and ``_compiling`` (server
    id -> cancelled?, for a request whose grammar is compiling) are guarded by ``_lock``;
    ``_send_lock`` keeps one message whole when the engine thread, the receiver and call
    threads send at once.
    """

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._compiling: dict[int, bool] = {}  # tag -> cancelled, while its grammar compiles
        self._stopping = threading.Event()
        self._scoring: dict[int, threading.Event] = {}  # call id -> its cancel, while it runs

    def send(self, message: object) -> None:
        # the server gone: the receiver sees it and stops the engine
        with self._send_lock, contextlib.suppress(OSError, EOFError):
            self.conn.send(message)

    # ------------------------------------------------------------------ engine thread

    def deliver(self, items: list[tuple[RequestHandle, Sequence[Event]]]) -> None:
        """One step's events of every request (``EventSink``), in one message."""
        out: list[tuple[int, list[Event]]] = []
        for handle, events in items:
            out.append((handle.tag, list(events)))
            if isinstance(events[-1], FinishEvent):
                with self._lock:
                    self._handles.pop(handle.tag, None)
        self.send(Events(out))

    # ------------------------------------------------------------------ the child's main thread

    def run(self) -> None:
        engine = self.engine.start()
        try:
            engine.wait_ready()
        except BaseException as exc:
            engine.shutdown(0)  # joins the engine thread: MLX aborts an exit under a live one
            self.send(LoadError(type(exc).__name__, str(exc)))
            return
        assert engine.info is not None
        gc.collect()  # the loaded heap out of the cyclic collector's way (server/app.py)
        gc.freeze()
        self.send(Ready(engine.info))
        threading.Thread(target=self._watch, name="veloxquant-engine-watch", daemon=True).start()
        try:
            self._receive()
        finally:
            self._stopping.set()
            engine.shutdown(0)  # a no-op after a drain; at once if the server vanished

    def _watch(self) -> None:
        """Tell the server when the engine thread died (it has failed its requests already)."""
        while not self._stopping.is_set():
            if not self.engine.alive and not self.engine.draining:
                self.send(Dead("the engine thread died"))
                return
            time.sleep(0.1)

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if not self._stopping.is_set():
                    log.warning("the server's process is gone; stopping the engine")
                return
            if isinstance(message, Add):
                self._add(message.request_id, message.request)
            elif isinstance(message, Cancel):
                self._cancel(message.request_id)
            elif isinstance(message, Call):
                self._call(message.call_id, message.name, message.args)
            elif isinstance(message, Shutdown):
                threading.Thread(
                    target=self._shutdown, args=(message.drain_timeout,), name="veloxquant-drain"
                ).start()
            else:
                log.error("unknown message from the server: %s", type(message).__name__)

    def _add(self, tag: int, request: GenerationRequest) -> None:
        grammar, grammars = request.grammar, self.engine.grammars
        if grammar is None or grammar.compiled is not None or grammars is None:
            self._submit(tag, request)
            return
        # A grammar crosses the pipe as text: compiled again here, on the compiler's workers
        # (a hit in its cache after the first time), never on this receiver or the engine.
        try:
            future = grammars.submit(grammar.text)
        except GrammarBusyError as exc:
            self._refuse(tag, request, InvalidRequestError(str(exc)))
            return
        with self._lock:
            self._compiling[tag] = False
        future.add_done_callback(lambda done: self._compiled(tag, request, done))

    def _compiled(self, tag: int, request: GenerationRequest, done: Future[Grammar]) -> None:
        with self._lock:
            cancelled = self._compiling.pop(tag, False)
        if cancelled:
            self._refuse(tag, request, None)
            return
        try:
            grammar = done.result()
        except GrammarError as exc:
            self._refuse(tag, request, InvalidRequestError(f"invalid grammar: {exc}"))
            return
        self._submit(tag, dataclasses.replace(request, grammar=grammar))

    def _cancel(self, tag: int) -> None:
        with self._lock:
            handle = self._handles.get(tag)
            if tag in self._compiling:
                self._compiling[tag] = True
        if handle is not None:
            self.engine.cancel(handle)

    def _submit(self, tag: int, request: GenerationRequest) -> None:
        try:
            handle = self.engine.submit(request, self, tag)
        except EngineError as exc:
            self._refuse(tag, request, exc)
            return
        with self._lock:
            if handle.finish is None:  # else it ended already and deliver() has let it go
                self._handles[tag] = handle

    def _refuse(self, tag: int, request: GenerationRequest, exc: EngineError | None) -> None:
        """End a request that never reached the engine: refused (``exc``), or cancelled."""
        usage = Usage(len(request.prompt_tokens), 0, 0, 0)
        if exc is None:
            finish = FinishEvent("cancelled", usage, time.monotonic())
        else:
            refusal = Refusal.of(exc)
            finish = FinishEvent("error", usage, time.monotonic(), error=str(exc), refusal=refusal)
        self.send(Events([(tag, [finish])]))

    def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        if name not in CALLS:
            self.send(Return(call_id, False, ValueError(f"no such call: {name}")))
            return
        if name == "view":  # thread-safe reads: answered here, never behind a step
            self._answer(call_id, name, args)
            return
        if name == "cancel_score":  # the caller gave up: that score stops at its next chunk
            event = self._scoring.get(args[0])
            if event is not None:
                event.set()
            return
        if name == "score":
            event = self._scoring[call_id] = threading.Event()
            args = (*args, event)
        threading.Thread(
            target=self._answer, args=(call_id, name, args), name=f"veloxquant-{name}"
        ).start()

    def _answer(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            value = getattr(self.engine, name)(*args)
        except CancelledError:
            return  # nobody waits for it
        except Exception as exc:
            self.send(Return(call_id, False, _portable(exc)))
            return
        finally:
            self._scoring.pop(call_id, None)
        self.send(Return(call_id, True, value))

    def _shutdown(self, drain_timeout: float) -> None:
        self.engine.shutdown(drain_timeout)
        self._stopping.set()
        self.send(Exit())  # the server closes its end: the receiver's recv ends, run returns


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling as itself (our errors and builtins do), else a
    RuntimeError naming its type (never its message: it may hold paths)."""
    if isinstance(exc, EngineError | ValueError | TimeoutError | OSError):
        return exc
    return RuntimeError(f"the engine call failed ({type(exc).__name__})")


def main(argv: list[str]) -> int:
    """``python -m veloxquant_mlx.engine.hosts.child FD``: FD is this end of the server's socket
    pair; the first message is a ``messages.Config``."""
    conn = Connection(int(argv[0]))
    try:
        first = conn.recv()
    except (EOFError, OSError):
        return 1
    assert isinstance(first, Config), type(first).__name__
    serve(first.config, conn, first.log_format, first.log_level, first.switch_interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
