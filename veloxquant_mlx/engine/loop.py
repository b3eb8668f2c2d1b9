"""The engine thread's half of the engine: load, admit, step, finish, cancel, shrink, fail."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache import build_pooled_caches
from veloxquant_mlx.engine import loader
from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.detokenize import Detokenizer, detokenizer_factory, token_bytes_table
from veloxquant_mlx.engine.faults import RequestFault
from veloxquant_mlx.engine.grammar import GrammarProcessor, grammar_tokenizer
from veloxquant_mlx.engine.handle import RequestHandle
from veloxquant_mlx.engine.running import Running
from veloxquant_mlx.engine.sampling import make_processors, make_sampler
from veloxquant_mlx.engine.sizing import Admission, KVGeometry
from veloxquant_mlx.engine.types import (
    CAPACITY_REDUCED,
    DRAINING,
    ENGINE_FAILED,
    REQUEST_FAILED,
    EngineNotReadyError,
    FinishEvent,
    TokenEvent,
    Usage,
)
from veloxquant_mlx.pool import BlockPoolAllocator

log = logging.getLogger("veloxquant.engine")


@dataclass(slots=True)
class Counters:
    """Request and token counters; guarded by the engine's lock."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)  # by code


class EngineLoop:
    """What runs on the engine thread; ``Engine`` (engine.py) adds the callers' API.

    Every method here runs on the engine thread only. The state is declared here and set up by
    ``Engine.__init__``; see ``Engine`` for who owns what and what ``_lock`` guards.
    """

    config: EngineConfig
    _step_hook: Callable[[], None] | None
    _lock: threading.Condition
    _waiting: collections.deque[RequestHandle]
    _cancels: set[int]
    _commands: collections.deque[tuple[Callable[[], Any], Future[Any]]]
    _counters: Counters
    _ready: threading.Event
    _draining: bool
    _drain_deadline: float | None
    _alive: bool
    _load_error: BaseException | None
    _running: dict[int, Running]  # uid -> request
    pool: BlockPoolAllocator | None
    tokenizer: Any
    model_name: str
    geometry: KVGeometry | None
    kv_bytes_per_block: int
    blas: str
    device: str
    _model: Any
    _new_detokenizer: Callable[[], Detokenizer] | None
    _generator: Any
    _admission: Admission | None
    vocab_size: int
    token_bytes: list[bytes] | None  # each token id's raw bytes (byte-level tokenizers)
    ll_tokenizer: Any  # llguidance's tokenizer (None: no structured outputs for this model)
    _faulted: list[RequestFault]  # faults recorded since the last step's check
    _n_running = 0  # mirrored under the lock for stats()
    _promised = 0
    _changed = False  # the running set changed since the last _publish

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:
            if isinstance(exc, (ValueError, OSError)):  # what the operator must change
                log.error("engine cannot start: %s", exc)
            else:
                log.exception("engine failed to load the model")
            self._load_error = exc
            self._alive = False
            self._ready.set()
            mx.clear_streams()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:
            log.exception("engine thread died")
            self._fail_all(f"the engine failed ({type(exc).__name__}); the server is restarting")
        finally:
            self._alive = False
            self._release_everything()
            if self._generator is not None:
                self._generator.close()
            # MLX needs its thread-local streams cleared before the thread ends, or the process
            # aborts at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _load(self) -> None:
        rt = loader.build_runtime(self.config)
        self._model, self.tokenizer, self.model_name = rt.model, rt.tokenizer, rt.name
        self.geometry, self.pool, self._admission = rt.geometry, rt.pool, rt.admission
        self._generator, self.kv_bytes_per_block, self.blas = (
            rt.generator,
            rt.kv_bytes_per_block,
            rt.blas,
        )
        self.device = rt.device
        self.vocab_size = rt.vocab_size
        self.token_bytes = token_bytes_table(rt.tokenizer)
        self.ll_tokenizer = grammar_tokenizer(rt.tokenizer, rt.vocab_size)
        self._new_detokenizer = detokenizer_factory(rt.tokenizer, self.token_bytes)

    def _loop(self) -> None:
        while True:
            # Fast path while decoding: no lock unless something is pending (reads of these
            # containers without the lock are safe in CPython; the lock is taken to act on them).
            pending = self._cancels or self._commands or self._draining or self._waiting
            if pending or not self._running:
                self._housekeeping_or_wait()
                if self._draining and self._finish_draining():
                    return
            if self._running:
                if self._step_hook is not None:
                    self._step_hook()
                self._step()
            if self._changed:
                self._publish()

    def _housekeeping_or_wait(self) -> None:
        with self._lock:
            while (
                not self._waiting
                and not self._running
                and not self._cancels
                and not self._commands
                and not self._draining
            ):
                self._lock.wait()
            cancels, self._cancels = self._cancels, set()
            commands = list(self._commands)
            self._commands.clear()
        for fn, future in commands:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
        self._apply_cancels(cancels)
        if not self._draining:
            self._admit()

    def _finish_draining(self) -> bool:
        """While draining: fail the waiting at once, and past the deadline the running (both
        with DRAINING: the client should retry elsewhere). True: nothing is left."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for h in waiting:
            self._push_finish(h, "error", 0, 0, error="the server is shutting down", code=DRAINING)
        if not self._running:
            return True
        deadline = self._drain_deadline
        if deadline is not None and time.monotonic() >= deadline:
            for uid in list(self._running):
                self._finish(
                    uid,
                    "error",
                    error="the server shut down before this request finished",
                    code=DRAINING,
                )
            return True
        return False

    def _publish(self) -> None:
        promised = (
            self._admission.need([r.end for r in self._running.values()]) if self._admission else 0
        )
        with self._lock:
            self._n_running = len(self._running)
            self._promised = promised

    def _admit(self) -> None:
        """Admit waiting requests in FIFO order while they fit, then start them shortest prompt
        first: BatchGenerator prefills its queue in order, in left-padded batches, so requests
        admitted together (a burst) are prefilled with little padding."""
        assert self._admission is not None and self.pool is not None
        ends = [r.end for r in self._running.values()]
        admitted: list[tuple[RequestHandle, int]] = []
        unservable: list[RequestHandle] = []
        with self._lock:
            while self._waiting and len(ends) < self.config.max_running:
                head = self._waiting[0]
                end = len(head.request.prompt_tokens) + head.request.max_tokens
                if not self._admission.fits([*ends, end]):
                    if self._admission.could_ever_fit(end):
                        break  # FIFO: nobody overtakes the head
                    self._waiting.popleft()  # a shrink made it unservable: answer, move on
                    unservable.append(head)
                    continue
                self._waiting.popleft()
                self._counters.prompt_tokens += len(head.request.prompt_tokens)
                ends.append(end)
                admitted.append((head, end))
        for h in unservable:
            self._push_capacity_reduced(h)
        admitted.sort(key=lambda item: len(item[0].request.prompt_tokens))
        for i, (handle, end) in enumerate(admitted):
            try:
                self._start(handle, end)
            except BaseException:
                with self._lock:  # not started: back to the queue (failed with the engine)
                    self._waiting.extendleft(h for h, _ in reversed(admitted[i:]))
                raise

    def _push_capacity_reduced(self, handle: RequestHandle) -> None:
        self._push_finish(
            handle,
            "error",
            0,
            0,
            error="the KV pool has been shrunk below what this request needs; "
            "try again later or with a smaller max_tokens",
            code=CAPACITY_REDUCED,
        )

    def _start(self, handle: RequestHandle, end: int) -> None:
        """Put one admitted request into the batch. A failure of the request's own parts (its
        sampler's random key, its processors, its caches) fails it alone."""
        assert self.pool is not None and self._new_detokenizer is not None
        request = handle.request
        owner = handle.request_id
        fault = RequestFault(owner, self._faulted)
        try:
            sampler = make_sampler(request.sampling)
            processors = make_processors(request.sampling)
            if request.grammar is not None:  # last: it sees the penalties' and biases' result
                processors.append(
                    GrammarProcessor(request.grammar, self.ll_tokenizer, self.vocab_size)
                )
            detokenizer = self._new_detokenizer()
            caches = build_pooled_caches(self._model, self.pool, owner=owner)
            uid = self._generator.insert(
                [list(request.prompt_tokens)],
                [request.max_tokens],
                caches=[caches],
                samplers=[None if sampler is None else fault.sampler(sampler)],
                logits_processors=[[fault.processor(p) for p in processors]],
            )[0]
        except Exception as exc:
            self.pool.free_all(owner)
            fault.record("setup", exc)
            self._push_finish(handle, "error", 0, 0, error=fault.error, code=REQUEST_FAILED)
            return
        self._running[uid] = Running(handle, detokenizer, end, fault)
        self._changed = True

    def _step(self) -> None:
        assert self.pool is not None
        _, responses = self._generator.next()
        now = time.monotonic()
        finished: list[tuple[int, str]] = []
        stepped: list[tuple[int, Running]] = []
        for r in responses:
            run = self._running.get(r.uid)
            if run is None:
                continue
            stepped.append((r.uid, run))
            if run.n_generated % 16 == 0 or r.finish_reason is not None:  # growth is in chunks
                blocks = self.pool.n_blocks_for(run.handle.request_id)
                run.peak_blocks = max(run.peak_blocks, blocks)
            if run.fault.error is not None:
                continue  # ended below; this step's token came from the stand-in
            if r.finish_reason == "stop":  # EOS: not part of the text
                finished.append((r.uid, "stop"))
                continue
            try:  # this request's own text, stop strings and logprobs: its fault alone
                text, stopped = run.add_token(r.token)
                logprob, top = run.logprobs(r.token, r.logprobs)
            except Exception as exc:
                run.fault.record("detokenizer or logprobs", exc)
                continue
            run.pending.append(TokenEvent(r.token, text, now, logprob, top))
            if stopped:
                finished.append((r.uid, "stop"))
            elif r.finish_reason == "length":
                finished.append((r.uid, "length"))
        failed: list[int] = []
        if self._faulted:  # a fault can also come from a row with no token this step (prefill)
            self._faulted.clear()
            failed = [uid for uid, run in self._running.items() if run.fault.error is not None]
        ending = {uid for uid, _ in finished}.union(failed)
        interval = self.config.stream_interval
        # Tokens go out when some request is due (its first token, `interval` since its last
        # delivery, its finish), and then everyone's pending tokens go along: each delivery
        # wakes the consumer's thread, so one wake-up carries as much as it can.
        if any(uid in ending or run.is_due(now, interval) for uid, run in stepped):
            RequestHandle.push_tokens([(run.handle, run.take_all(now)) for _, run in stepped])
        with self._lock:
            self._counters.generated_tokens += len(stepped)
        for uid, reason in finished:
            self._finish(uid, reason, error=None)
        for uid in failed:
            self._finish(uid, "error", error=self._running[uid].fault.error, code=REQUEST_FAILED)

    def _finish(self, uid: int, reason: str, error: str | None, code: str | None = None) -> None:
        """End a running request: out of the batch, blocks back, FinishEvent. Exactly once."""
        assert self.pool is not None
        run = self._running.pop(uid)
        self._changed = True
        try:
            self._generator.remove([uid])  # a no-op once BatchGenerator dropped it itself
        finally:
            self.pool.free_all(run.handle.request_id)
            RequestHandle.push_tokens([(run.handle, run.take_all(time.monotonic()))])
            tail = ""
            if reason in ("length", "stop"):
                try:
                    tail = run.flush()
                except Exception as exc:  # its detokenizer's last words: its fault alone
                    run.fault.record("detokenizer", exc)
                    reason, error, code = "error", run.fault.error, REQUEST_FAILED
            self._push_finish(
                run.handle, reason, run.n_generated, run.peak_blocks, tail, error, code
            )

    def _push_finish(
        self,
        handle: RequestHandle,
        reason: str,
        n_generated: int,
        peak_blocks: int,
        tail: str = "",
        error: str | None = None,
        code: str | None = None,
    ) -> None:
        usage = Usage(
            prompt_tokens=len(handle.request.prompt_tokens),
            completion_tokens=n_generated,
            peak_kv_blocks=peak_blocks,
            peak_kv_bytes=peak_blocks * self.kv_bytes_per_block,
        )
        with self._lock:
            self._counters.finished[reason] += 1
            if code is not None:
                self._counters.failed[code] += 1
        handle._push(FinishEvent(reason, usage, time.monotonic(), tail, error, code))

    def _apply_cancels(self, request_ids: set[int]) -> None:
        if not request_ids:
            return
        with self._lock:
            cancelled = [h for h in self._waiting if h.request_id in request_ids]
            for h in cancelled:
                self._waiting.remove(h)
        for h in cancelled:
            self._push_finish(h, "cancelled", 0, 0)
        for uid, run in list(self._running.items()):
            if run.handle.request_id in request_ids:
                self._finish(uid, "cancelled", error=None)

    def _shrink(self, stream: str, target_free: int) -> int:
        assert self.pool is not None and self._admission is not None
        ends = [r.end for r in self._running.values()]
        streams = [stream] if stream != "kv" or not self.config.separate_kv else ["k", "v"]
        retired = 0
        for s in streams:
            name = s if self.config.separate_kv else "kv"
            floor = self.pool.n_free(name) - self._admission.retirable(name, ends)
            retired += self.pool.shrink(name, max(target_free, floor))
        if retired:
            self._reject_unservable()
        return retired

    def _reject_unservable(self) -> None:
        """After a shrink: answer every waiting request that can no longer fit at all (503
        capacity_reduced), so nobody behind it waits for a pool that will not come back."""
        assert self._admission is not None
        with self._lock:
            doomed = [
                h
                for h in self._waiting
                if not self._admission.could_ever_fit(
                    len(h.request.prompt_tokens) + h.request.max_tokens
                )
            ]
            for h in doomed:
                self._waiting.remove(h)
        for h in doomed:
            self._push_capacity_reduced(h)

    def _fail_all(self, message: str) -> None:
        for uid in list(self._running):
            try:
                self._finish(uid, "error", error=message, code=ENGINE_FAILED)
            except BaseException:  # the batch itself may be broken: still tell the caller
                log.exception("while failing request %d", uid)
        self._running.clear()
        with self._lock:
            self._alive = False
            waiting = list(self._waiting)
            self._waiting.clear()
            commands = list(self._commands)
            self._commands.clear()
        for h in waiting:
            self._push_finish(h, "error", 0, 0, error=message, code=ENGINE_FAILED)
        for _, future in commands:
            future.set_exception(EngineNotReadyError(message))

    def _release_everything(self) -> None:
        if self.pool is None:
            return
        for owner in list(self.pool.owner_block_counts()):
            self.pool.free_all(owner)  # type: ignore[arg-type]
