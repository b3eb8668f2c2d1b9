"""The engine's facade for the server: submit, cancel, shrink, score, stats, shutdown.

The engine thread (``core.EngineCore``) owns the model, the scheduler and every MLX call; this
class owns that thread and the ``Inbox`` callers talk to it through. Callers never touch the
scheduler or the runner; they read the pool only through its own thread-safe methods.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.hosts.base import HostBase, wait_cancellable
from veloxquant_mlx.engine.loop.blocks import BlockMath
from veloxquant_mlx.engine.loop.commands import Command, GroupPools, ResetPrefixCache, Score, Shrink
from veloxquant_mlx.engine.loop.core import EngineCore
from veloxquant_mlx.engine.loop.inbox import Inbox, disk_fields
from veloxquant_mlx.engine.loop.parts import build_parts
from veloxquant_mlx.engine.loop.preload import preload
from veloxquant_mlx.engine.loop.turns import wait_for_stall
from veloxquant_mlx.engine.loop.warmup import (
    long_context,
    prefill_attention_shapes,
    run_warm_up,
    warm_up_waves,
)
from veloxquant_mlx.engine.loop.warmup import wanted as warm_up_wanted
from veloxquant_mlx.engine.model import loader
from veloxquant_mlx.engine.request.checks import score_problem
from veloxquant_mlx.engine.request.handle import EventSink, RequestHandle
from veloxquant_mlx.engine.types import (
    CapacityReducedError,
    EngineInfo,
    EngineNotReadyError,
    EngineStats,
    EngineView,
    GenerationRequest,
    GroupInfo,
    InvalidRequestError,
    PoolView,
    QueueFullError,
    RequestTooLargeError,
)
from veloxquant_mlx.pool import BlockPoolAllocator

__all__ = ["Engine", "EngineConfig"]

log = logging.getLogger("veloxquant.engine")


class Engine(HostBase):
    """Runs every request on one engine thread, batched over the pool's KV memory.

    A request is admitted when the pool holds its prompt now (``max_tokens`` is not reserved);
    when the pool runs out mid-decode the newest request is preempted and recomputed later
    (``scheduler``). Whatever ends a request (finish, stop string, cancel, error, shutdown), its
    blocks are released in a ``finally``.

    Owns the engine thread, the ``Inbox`` callers reach it through, and (set at load, read-only
    afterwards) the pool and the ``BlockMath`` submit checks prompts with.

    Args:
        config: What to load and how to size and batch.
        step_hook: Called on the engine thread before every turn (tests inject faults here).
    """

    def __init__(self, config: EngineConfig, *, step_hook: Callable[[], None] | None = None):
        super().__init__()
        self.config = config
        self._step_hook = step_hook
        self._inbox = Inbox()
        self._next_request_id = 0
        self._thread = threading.Thread(target=self._run, name="veloxquant-engine", daemon=True)
        self._core: EngineCore | None = None
        self.pool: BlockPoolAllocator | None = None
        self._blocks: BlockMath | None = None
        self._abandoned = False  # the group watchdog gave up on the engine thread

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        self._inbox.alive = True
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._inbox.alive and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._inbox.draining

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting; let running requests finish until the deadline; fail the rest.

        Waiting requests are answered at once. Returns when the engine thread has exited and
        released every block. Idempotent.
        """
        ib = self._inbox
        with ib.lock:
            if not ib.draining:
                ib.draining = True
                ib.drain_deadline = time.monotonic() + max(0.0, drain_timeout)
            ib.lock.notify_all()
        if self._thread.is_alive() and not self._abandoned:  # a stuck thread never returns
            self._thread.join(max(0.0, drain_timeout) + 30.0)
        self._stop_tools()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:
            # One line: a model that cannot load is the operator's to fix (a truncated
            # weights file, a config value of the wrong type); the traceback at debug level.
            log.error("engine failed to load: %s: %s", type(exc).__name__, _first_line(exc))
            log.debug("engine load failure", exc_info=True)
            self._load_error = exc
            self._inbox.alive = False
            self._ready.set()
            mx.clear_streams()
            return
        self._ready.set()
        assert self._core is not None
        try:
            self._core.run()
        except BaseException as exc:
            log.exception("engine thread died")
            if _out_of_memory(exc):
                log.error(
                    "the device ran out of memory (MLX: %d MiB alive, %d MiB of freed buffers "
                    "kept): lower --kv-cache-mb, --max-running or --mlx-cache-limit-mb",
                    mx.get_active_memory() >> 20,
                    mx.get_cache_memory() >> 20,
                )
            self._core.fail_all(
                f"the engine failed ({type(exc).__name__}); the server is restarting"
            )
        finally:
            self._inbox.alive = False
            self._core.persist_cache()
            self._core.release_everything()
            # MLX needs its thread-local streams cleared before the thread ends, or the process
            # aborts at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _load(self) -> None:
        rt = loader.build_runtime(self.config)
        self.pool, self._blocks = rt.pool, rt.scheduler.blocks
        parts = build_parts(rt)
        self._core = EngineCore(self.config, self._inbox, parts, self._step_hook, rt.group)
        info = EngineInfo(
            model_name=rt.name,
            model_path=str(rt.path),
            vocab_size=rt.vocab_size,
            context_window=rt.geometry.context_window,
            kv_bytes_per_block=rt.kv_bytes_per_block,
            kv_layers=rt.geometry.n_layers_total,
            block_size=self.config.block_size,
            kv_layout=rt.runner.kv.kind,
            blas=rt.blas,
            device=rt.device,
            group=GroupInfo() if rt.group is None else rt.group.info,
            chat_template=self.config.chat_template,
            kv_formats=rt.kv_formats,
            disk_dir=None if rt.disk is None else str(rt.disk.dir),
        )
        if warm_up_wanted(self.config.warm_up) and rt.group is None:
            started = time.monotonic()
            waves = warm_up_waves(
                self.config.max_running,
                self.config.prefill_step,
                info.context_window,
                info.vocab_size,
                self._core.scheduler.prefill_budget,
                self._core.runner.kv.ragged.prefill_bucket,
                rt.kv_formats[1:],
                long_context(
                    self.config.warm_up_context,
                    info.context_window,
                    self._core.scheduler.blocks.could_ever_fit,
                ),
            )
            try:
                n, hits = run_warm_up(self._core, waves)
            except (RuntimeError, ValueError) as exc:  # a shape these flags cannot run here
                raise RuntimeError(
                    f"the warm-up's requests failed on {rt.device}: {_first_line(exc)}"
                ) from exc
            built, shapes = prefill_attention_shapes(
                self._core, rt.geometry.dtype, info.context_window, self.config.prefill_step
            )
            log.info(
                "warmed up: %d requests%s in %.1f s (%d prompt tokens found cached)",
                n,
                f" and {built} of {shapes} prefill attention shapes" if shapes else "",
                time.monotonic() - started,
                hits,
            )
        if rt.disk is not None and rt.group is None:
            preload(self._core, rt.disk, self.config, rt.kv_bytes_per_block)
        self._loaded(info, parts)
        if rt.group is not None:
            watchdog = threading.Thread(
                target=self._watch_group, name="veloxquant-group-watchdog", daemon=True
            )
            watchdog.start()

    def _watch_group(self) -> None:
        """A turn that waits on the other ranks past ``group_timeout`` (a rank stopped, or the
        network between them) takes the engine down: its requests fail now, ``alive`` turns
        False (``/health`` 503, the server exits 1), and the stuck thread is left behind."""
        core, limit = self._core, self.config.group_timeout
        assert core is not None
        if wait_for_stall(core.turns, limit, lambda: self.alive):
            log.critical("no answer from the other ranks for %.0f s: the group is dead", limit)
            self._abandoned = True
            core.abandon("a rank of the model's group stopped answering")

    # ------------------------------------------------------------------ callers' API

    def submit(
        self, request: GenerationRequest, sink: EventSink | None = None, tag: Any = None
    ) -> RequestHandle:
        """Queue ``request``; returns its handle at once (events arrive as it runs, in the
        handle or, given a ``sink``, there, with ``tag`` on the handle).

        Raises:
            EngineNotReadyError: Still loading, draining, or the engine thread is dead.
            RequestTooLargeError: Over the context window, or a prompt the whole pool at its
                maximum size could never hold.
            CapacityReducedError: A prompt the pool holds as configured but not as shrunk.
            InvalidRequestError: A token id or ``top_k`` outside the model's vocabulary, or a
                grammar not compiled (``GrammarCompiler``: never on the engine thread).
            QueueFullError: The waiting queue is at ``max_queue``.
        """
        request = self._check(request)
        if request.grammar is not None and request.grammar.compiled is None:
            raise self._refuse(InvalidRequestError("a grammar must come compiled", "grammar"))
        if self.group_info.world_size > 1 and request.sampling.seed is None:
            # Every rank samples this request: they must draw from the same key.
            seeded = dataclasses.replace(request.sampling, seed=secrets.randbits(63))
            request = dataclasses.replace(request, sampling=seeded)
        n_prompt = len(request.prompt_tokens)
        blocks = self._blocks
        assert blocks is not None
        if not blocks.could_ever_fit(n_prompt + 1, request.kv_format):
            if blocks.fits_configured(n_prompt + 1, request.kv_format):
                raise self._refuse(
                    CapacityReducedError(
                        "the KV pool has been shrunk below what this prompt needs; try again later"
                    )
                )
            raise self._refuse(
                RequestTooLargeError(
                    f"the prompt ({n_prompt} tokens) needs more KV blocks than the whole pool holds"
                )
            )
        ib = self._inbox
        with ib.lock:
            if not self.ready or ib.draining:
                raise self._refuse(EngineNotReadyError("the engine is draining"))
            waiting = ib.n_waiting + len(ib.adds)  # the unit --max-queue counts
            if waiting >= self.config.max_queue:
                raise self._refuse(
                    QueueFullError(
                        f"{waiting} sequences waiting, the most this server queues (each "
                        "choice of each prompt is one); try again later"
                    )
                )
            self._next_request_id += 1
            handle = RequestHandle(self._next_request_id, request, sink, tag)
            ib.adds.append(handle)
            ib.lock.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a queued or running request; its blocks are freed within one step."""
        ib = self._inbox
        with ib.lock:
            if not handle.done:
                ib.cancels.add(handle.request_id)
                ib.lock.notify_all()

    def shrink(self, stream: str, target_free: int, timeout: float = 30.0) -> int:
        """Retire free blocks down to ``target_free`` on the engine thread (never a block in
        use). ``stream`` "kv" on a separate pool means both.

        Raises:
            ValueError: On a bad stream or target; EngineNotReadyError if the engine is down.
        """
        if stream not in ("k", "v", "kv"):
            raise ValueError(f"stream must be 'k', 'v' or 'kv', got {stream!r}")
        if isinstance(target_free, bool) or not isinstance(target_free, int) or target_free < 0:
            raise ValueError(f"target_free must be an int >= 0, got {target_free!r}")
        command = Shrink(stream, target_free)
        group, blocks = self.group_info, self._blocks
        if group.world_size > 1 and blocks is not None:  # whole token blocks on every rank
            unit = blocks.blocks_per_token_block
            command = Shrink(stream, -(-target_free // unit), in_token_blocks=True)
        return int(self._call(command, timeout))

    def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """Drop every cached page no request holds (on the engine thread); returns the blocks
        freed. Pages running requests hold stay until they finish.

        Raises:
            EngineNotReadyError: If the engine is down.
        """
        return int(self._call(ResetPrefixCache(), timeout))

    def score(
        self,
        prompt: tuple[int, ...],
        top: int,
        timeout: float = 300.0,
        cancelled: threading.Event | None = None,
    ) -> list[Any]:
        """Prompt logprobs (``scoring.ScoringJob``), computed on the engine thread a chunk per
        turn, beside the decode steps. Blocks the caller (use a worker thread from async
        code); setting ``cancelled`` stops it at the next chunk (CancelledError).

        Raises:
            InvalidRequestError: Token ids outside the vocabulary, or over the context window.
            EngineNotReadyError: If the engine is down.
        """
        problem = score_problem(tuple(prompt), self.vocab_size, self.context_window)
        if problem is not None:
            raise problem
        future = self._command(Score(tuple(prompt), top))
        # on a cancel (or the timeout) the engine drops the job at its next chunk
        try:
            return list(wait_cancellable(future, timeout, cancelled, future.cancel))
        except FutureTimeout:
            future.cancel()
            raise

    def group_pools(self, timeout: float = 30.0) -> list[list[int]]:
        """``[rank, blocks, free, blocks in use, owners]`` for the pool of every rank of the
        group (one row for a single process), read between steps.

        Raises:
            EngineNotReadyError: If the engine is down.
        """
        return list(self._call(GroupPools(), timeout))

    def stats(self) -> EngineStats:
        """A frozen snapshot of the counters and the last published step. Thread-safe."""
        ib = self._inbox
        with ib.lock:
            c, snap, disk = ib.counters, ib.snapshot, ib.disk
            waiting = ib.n_waiting + len(ib.adds)  # what submit's bound counts (fresher)
            counters = {
                "prompt_tokens_total": c.prompt_tokens,
                "generated_tokens_total": c.generated_tokens,
                "requests_finished_total": dict(c.finished),
                "failures_total": dict(c.failed),
            }
        live = {} if disk is None else disk_fields(disk)
        return EngineStats.of(
            dataclasses.replace(snap, waiting=waiting, **live),
            alive=self.alive,
            ready=self.ready,
            draining=self.draining,
            rejections_total=self._refusals(),
            kv_bytes_per_block=self.kv_bytes_per_block,
            **counters,
        )

    def view(self) -> EngineView:
        """The counters and the pool now (``/metrics``, ``/admin/pool``). Thread-safe."""
        stats = self.stats()
        return EngineView(stats, None if self.pool is None else PoolView.of(self.pool))

    def _call(self, command: Command, timeout: float) -> Any:
        return self._command(command).result(timeout)

    def _command(self, command: Command) -> Future[Any]:
        future: Future[Any] = Future()
        ib = self._inbox
        with ib.lock:
            if not self.alive:
                raise EngineNotReadyError("the engine is not running")
            ib.commands.append((command, future))
            ib.lock.notify_all()
        return future


def _out_of_memory(exc: BaseException) -> bool:
    """Whether MLX failed to allocate (CUDA's "out of memory", MLX's own "[malloc] Unable to
    allocate"), which the operator's settings decide."""
    text = str(exc)
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "Unable to allocate" in text
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
