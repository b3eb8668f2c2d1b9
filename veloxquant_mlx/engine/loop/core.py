"""The engine loop: take the inbox, schedule, run one step, publish a snapshot. Engine thread.

Each turn: callers' commands run (shrink, scoring), cancels apply, new requests join the queue;
the scheduler admits what the pool holds now; prefill chunks run under a token budget; every
running row gets the block its next token needs (preempting the newest request when the pool is
out); one decode step is launched; the previous step's tokens are read back (``readback``),
turned into text and delivered, and finished requests leave with their blocks freed in a
``finally``. Then one frozen ``StepSnapshot`` is published for ``/metrics`` and ``/admin``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop.clock import TurnClock
from veloxquant_mlx.engine.loop.commands import (
    Command,
    GroupPools,
    ResetPrefixCache,
    Score,
    Shrink,
    Turn,
)
from veloxquant_mlx.engine.loop.disk_tier import persist_at_stop
from veloxquant_mlx.engine.loop.group import Group, pool_rows
from veloxquant_mlx.engine.loop.inbox import Counters, Inbox, snapshot_of
from veloxquant_mlx.engine.loop.parts import Parts
from veloxquant_mlx.engine.loop.prefill_log import PrefillProgress
from veloxquant_mlx.engine.loop.readback import push_finish, read_back
from veloxquant_mlx.engine.loop.rows import RowState, Sampled
from veloxquant_mlx.engine.loop.scoring_queue import ScoringQueue
from veloxquant_mlx.engine.loop.seq import Seq
from veloxquant_mlx.engine.loop.turns import TurnSource
from veloxquant_mlx.engine.request.faults import RequestFault
from veloxquant_mlx.engine.request.grammar import GrammarRow
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.request.running import Running
from veloxquant_mlx.engine.request.sampling import RowSampling
from veloxquant_mlx.engine.request.scoring import prompt_logprobs
from veloxquant_mlx.engine.types import (
    CAPACITY_REDUCED,
    DRAINING,
    ENGINE_FAILED,
    REQUEST_FAILED,
    GenerationRequest,
)

log = logging.getLogger("veloxquant.engine")


# The largest batch (rows, holes included) whose joining rows' first tokens are read before
# the next launch on a CPU (``EngineCore._first_tokens_first``).
FIRST_TOKENS_FIRST_ROWS = 4


class EngineCore:
    """The loop over one ``Scheduler`` and one ``Runner``. Engine thread only."""

    def __init__(
        self,
        config: EngineConfig,
        inbox: Inbox,
        parts: Parts,
        step_hook: Callable[[], None] | None = None,
        group: Group | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.turns = TurnSource(inbox, group, config.heartbeat)
        self.inbox = inbox
        inbox.disk = parts.disk
        if parts.disk is not None:
            parts.disk.on_read = self._wake
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.parts = parts
        self._step_hook = step_hook
        self._faulted: list[RequestFault] = []
        self._live: dict[int, Seq] = {}  # request id -> every admitted or queued request
        self._inflight: list[Sampled] = []  # launched, not read back
        self._scoring = ScoringQueue()  # prompts being scored, a chunk a turn
        self._changed = True
        self._holds_a_request = True  # checked at load; only a shrink can change it
        self.runner.on_join = self._cache_prompt
        after = config.launch_after_previous
        self._launch_after = self.runner.kv.launch_after_previous if after is None else after
        # On MLX's CPU backend ``async_eval`` of a decode step returns only once most of the
        # step has run (30-42 ms for one 2,000-token row of the embedded model), so a joining
        # row's first token, read back after it, waited for a whole step: in a small batch (a
        # few agent sessions) it is read before. Not in a larger one, where reading first
        # leaves the CPU idle while the host reads back (~0.9x tok/s at 32 clients); nor on a
        # GPU, where the launch returns at once and the first tokens are read while it runs.
        self._first_tokens_first = mx.default_device() == mx.cpu
        self._clock = TurnClock()  # a slow turn's phases, at debug level
        self._progress = PrefillProgress()  # long prefills' lines

    # ------------------------------------------------------------------ loop

    def _busy(self) -> bool:
        return self.scheduler.ready() or bool(self._scoring)

    def _wake(self) -> None:
        """Something the engine waits for outside its inbox is ready (a disk read)."""
        with self.inbox.lock:
            self.inbox.lock.notify_all()

    def run(self) -> None:
        while True:
            turn = self.turns.next(self._busy)
            if turn is not None:
                self._apply(turn)
                if turn.draining and self._finish_draining(turn.drain_expired):
                    return
            if self.scheduler.running or self.scheduler.waiting:
                if self._step_hook is not None:
                    self._step_hook()
                self._turn()
            if self._scoring:
                self._score()
            self.turns.since = None
            if self._changed:
                self._publish()

    def _apply(self, turn: Turn) -> None:
        """Apply one turn's input: commands, then new requests, then cancels."""
        self.turns.run_commands(turn, self.execute)
        for request_id, request in turn.adds:
            handle = self.turns.handle(request_id, request)
            seq = Seq(handle, list(request.prompt_tokens), len(request.prompt_tokens))
            self._live[request_id] = seq
            self.scheduler.waiting.append(seq)
            self._changed = True
        for request_id in turn.cancels:
            cancelled = self._live.get(request_id)
            if cancelled is not None:
                self._end(cancelled, "cancelled")
        if turn.adds or turn.cancels:
            self._count_waiting()

    def _count_waiting(self) -> None:
        """Submit's bound (``--max-queue``): the requests queued now (those taken from the inbox
        were counted as they were taken)."""
        with self.inbox.lock:
            self.inbox.n_waiting = len(self.scheduler.waiting)

    def execute(self, command: Command) -> Any:
        """Run one caller's command between steps."""
        if isinstance(command, Shrink):
            return self.shrink(command.stream, command.target_free, command.in_token_blocks)
        if isinstance(command, ResetPrefixCache):
            return self.reset_prefix_cache()
        if isinstance(command, Score):
            if self.group is not None:  # the ranks step together: in one forward
                return prompt_logprobs(self.runner.model, command.prompt, command.top)
            return self._scoring.add(command.prompt, command.top)  # answered when scored
        if isinstance(command, GroupPools):
            return self.group_pools()
        raise TypeError(f"not an engine command: {command!r}")

    def _score(self) -> None:
        """One chunk of the oldest scoring job, of the step's prefill budget (the decoding
        one while rows decode)."""
        sched = self.scheduler
        budget = sched.prefill_budget if sched.running else sched.idle_prefill_budget
        self._scoring.step(self.runner.model, budget)

    def _finish_draining(self, expired: bool) -> bool:
        """While draining: fail the waiting at once, and once the deadline has passed
        (``expired``) the running (both DRAINING: the client should retry elsewhere). True:
        nothing is left."""
        for seq in [s for s in self.scheduler.waiting if s.out is None]:
            self._end(seq, "error", "the server is shutting down", DRAINING)
        if not self.scheduler.running and not self.scheduler.waiting and not self._scoring:
            return True
        if expired:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self._end(
                    seq, "error", "the server shut down before this request finished", DRAINING
                )
            self._scoring.drop("the server shut down before this prompt was scored")
            return True
        return False

    def _turn(self) -> None:
        """One step: the scheduler's plan, carried out (schedule -> run -> deliver)."""
        sched, runner, clock = self.scheduler, self.runner, self._clock
        clock.start()
        plan = sched.schedule(prefill=not runner.staging())
        self._count_waiting()  # before any token of this turn is sent
        clock.mark()
        for seq in plan.unservable:
            self._end(seq, "error", _SHRUNK, CAPACITY_REDUCED)
        for seq, configured in plan.outgrown:
            # Alone and out of blocks: as configured, that is where its completion ends (like
            # the context end); after a shrink, the operator took the memory.
            if configured:
                self._end(seq, "length")
            else:
                self._end(seq, "error", _SHRUNK, CAPACITY_REDUCED)
        for seq in plan.admitted:
            self._changed = True
            if seq.out is None:
                self._start(seq)
        for seq in plan.preempted:
            log.info("preempted request %d (pool full); it will be recomputed", seq.request_id)
            self._progress.forget(seq)
            runner.remove(seq)
            self._changed = True
        for seq, before in plan.grown:
            runner.grew(seq, before)
        if any(s.request_id not in self._live for s in plan.admitted):  # its setup failed
            plan.together = [s for s in plan.together if s.request_id in self._live]
            plan.chunks = [c for c in plan.chunks if c.seq.request_id in self._live]
        results = runner.prefill(plan)
        self._progress.chunks(plan.chunks)
        clock.mark()
        launched = runner.step(sched.tables.max_block_id) if runner.rows else None
        clock.mark()
        sched.decoded(runner.rows)
        if self._first_tokens_first and len(runner.rows) <= FIRST_TOKENS_FIRST_ROWS:
            for sampled in results:
                self._absorb(sampled)
            results = []
        if launched is not None:
            if (self._launch_after and self._inflight) or runner.pages.copied_out():
                # Built while the previous step ran (or a leaving row's pages were copied out
                # of the working set); launched once MLX has let go of their inputs
                # (synchronize, not the tokens: they are ready before that), so the step's
                # writes are in place.
                mx.synchronize()
            runner.launch(launched)
        clock.mark()
        # Read back what was launched before this step, then the joining rows' first tokens
        # (``settle`` times their wait), while the new step runs.
        for sampled in self._inflight:
            self._absorb(sampled)
        runner.settle()
        for sampled in results:
            self._absorb(sampled)
        clock.mark()
        clock.report(len(runner.rows), plan)
        if sched.learns:  # (a moving budget, learned parts; nothing a turn when both are fixed)
            decoding = sum(row is not None for row in runner.rows)
            sched.turn_ended(clock.gap(), plan.prompt_tokens, runner.take_work(), decoding)
        self._inflight = [launched] if launched is not None else []
        if launched is None:
            runner.flush()
        if self._faulted:
            self._faulted.clear()
            for seq in list(self._live.values()):
                error = None if seq.state is None else seq.state.fault.error
                if error is not None:
                    self._end(seq, "error", error, REQUEST_FAILED)

    # ------------------------------------------------------------------ prefix cache

    def _cache_prompt(self, seq: Seq, layers: list[tuple[mx.array, mx.array]]) -> None:
        """A prefilled row joined: cache its prompt's full pages (``PageCopies.page_source``)."""
        if self.scheduler.cache is not None:
            self.scheduler.tables.register(
                seq, seq.n_kv, self.runner.pages.page_source(seq, layers)
            )

    def run_before_ready(self, requests: Sequence[GenerationRequest], first_id: int) -> None:
        """Before the engine is ready (nothing else runs): queue ``requests`` (request ids from
        ``first_id``) and run turns until every one has ended, sleeping while all wait for
        the disk's reads (``_wake``). The warm-up's and the preload's (``warmup``,
        ``preload``)."""
        for i, request in enumerate(requests):
            handle = RequestHandle(first_id + i, request)
            seq = Seq(handle, list(request.prompt_tokens), len(request.prompt_tokens))
            self._live[handle.request_id] = seq
            self.scheduler.waiting.append(seq)
        while self._live or self._inflight:
            if self._busy() or self._inflight:
                self._turn()
            else:
                with self.inbox.lock:
                    self.inbox.lock.wait(0.05)

    def reset_after_start(self) -> None:
        """What runs before ready leaves behind, back to a fresh engine's: the join clock,
        the prefill budget and parts, preemptions, the request counters, the published
        snapshot."""
        self.runner.restart_join_clock()
        self.scheduler.budget.reset()
        self.scheduler.parts.reset()
        self.scheduler.preemptions = 0
        with self.inbox.lock:
            self.inbox.counters = Counters()
        self._publish()

    def reset_prefix_cache(self) -> int:
        """Drop every cached page no request holds; returns the blocks freed."""
        freed = self.scheduler.tables.reset_cache()
        self._changed = True
        return freed

    # ------------------------------------------------------------------ requests

    def _start(self, seq: Seq) -> None:
        """Make an admitted request's sampling, grammar matcher and detokenizer. A failure of
        its own parts fails it alone."""
        request = seq.handle.request
        fault = RequestFault(seq.request_id, self._faulted)
        where = "sampler"
        try:
            sampling = RowSampling(request.sampling, self.runner.vocab_size)
            where = "setup"
            grammar = request.grammar
            if grammar is not None and grammar.compiled is None:
                # A follower rank: the turn carries the text, and the ranks step together, so
                # it compiles here (cached: once per grammar). Hosts hand over compiled ones.
                assert self.parts.grammars is not None, "a grammar for an unconstrained model"
                grammar = self.parts.grammars.compile(grammar.text)
            matcher = None if grammar is None else GrammarRow(grammar)
            detokenizer = self.parts.new_detokenizer()
        except Exception as exc:
            fault.record(where, exc)
            self._faulted.remove(fault)
            self._end(seq, "error", fault.error, REQUEST_FAILED)
            return
        seq.state = RowState(sampling, matcher, fault)
        seq.out = Running(seq.handle, detokenizer, fault)
        with self.inbox.lock:
            self.inbox.counters.prompt_tokens += seq.n_prompt

    def _absorb(self, sampled: Sampled) -> None:
        """Read back one launch's tokens (``readback``); end the requests that finished."""
        n_layers, interval = self.scheduler.n_layers, self.config.stream_interval
        finished = read_back(sampled, self._live, self.parts.eos, n_layers, interval, self.inbox)
        for seq, reason in finished:
            self._end(seq, reason)

    def _end(
        self, seq: Seq, reason: str, error: str | None = None, code: str | None = None
    ) -> None:
        """End a request however it ends: out of the batch and the queue, blocks back, one
        FinishEvent. Exactly once."""
        if self._live.pop(seq.request_id, None) is None:
            return
        self._changed = True
        run: Running | None = seq.out
        try:
            if reason in ("stop", "length", "cancelled"):
                self.scheduler.tables.cache_leaving(seq, len(self.scheduler.running))
            self._progress.left(seq, reason, seq.pages.n_known * self.runner.block_size)
            self.runner.remove(seq)
        finally:
            self.scheduler.finish(seq)
            tail = ""
            if run is not None:
                RequestHandle.push_tokens([(run.handle, run.take_all(time.monotonic()))])
                if reason in ("length", "stop"):
                    try:
                        tail = run.flush()
                    except Exception as exc:  # its detokenizer's last words: its fault alone
                        run.fault.record("detokenizer", exc)
                        self._faulted.clear()
                        reason, error, code = "error", run.fault.error, REQUEST_FAILED
            push_finish(
                self.inbox,
                seq.handle,
                reason,
                0 if run is None else run.n_generated,
                0 if run is None else run.peak_blocks,
                self.parts.kv_bytes_per_block,
                tail,
                error,
                code,
                seq.pages.n_cached,
                None if run is None else run.stops.matched,
            )

    # ------------------------------------------------------------------ commands

    def shrink(self, stream: str, target_free: int, in_token_blocks: bool = False) -> int:
        """Retire free blocks down to ``target_free`` (never a block in use; the prefix cache's
        unreferenced pages are evicted first, so their memory goes back too); then answer every
        waiting request that can no longer fit at all. ``in_token_blocks``: the target counts
        token blocks (commands.Shrink)."""
        pool = self.scheduler.pool
        if in_token_blocks:
            target_free *= self.scheduler.blocks.blocks_per_token_block
        if self.scheduler.tables.reset_cache():
            self._changed = True
        streams = [stream] if stream != "kv" or not self.config.separate_kv else ["k", "v"]
        retired = 0
        for s in streams:
            retired += pool.shrink(s if self.config.separate_kv else "kv", target_free)
        if retired:
            self._holds_a_request = self.scheduler.blocks.could_ever_fit(
                self.config.min_request_tokens
            )
            for seq in [s for s in self.scheduler.waiting]:
                if not self.scheduler.blocks.could_ever_fit(len(seq.tokens) + 1, seq.kv_format):
                    self._end(seq, "error", _SHRUNK, CAPACITY_REDUCED)
            self._publish()  # before the caller hears back: /ready and /v1/loads show it
        return retired

    def group_pools(self) -> list[list[int]]:
        """Every rank's pool in a row (``group.pool_rows``; a collective in a group)."""
        return pool_rows(self.scheduler.pool, self.group)

    def _publish(self) -> None:
        self._changed = False
        snap = snapshot_of(self.scheduler, self.runner, self._holds_a_request)
        with self.inbox.lock:
            self.inbox.snapshot = snap
            self.inbox.n_waiting = snap.waiting

    # ------------------------------------------------------------------ failure

    def fail_all(self, message: str) -> None:
        """The engine itself failed: every request ends with ENGINE_FAILED."""
        for seq in list(self._live.values()):
            try:
                self._end(seq, "error", message, ENGINE_FAILED)
            except BaseException:  # the batch itself may be broken: still tell the caller
                log.exception("while failing request %d", seq.request_id)
        self._fail_unapplied(message)

    def abandon(self, message: str) -> None:
        """From another thread, while this loop is stuck in a collective that will not return:
        every request still live ends with ENGINE_FAILED (no MLX call, no state beyond the
        answers), and the engine counts as dead."""
        self._fail_unapplied(message, [s.handle for s in list(self._live.values())])

    def _fail_unapplied(self, message: str, handles: Sequence[RequestHandle] = ()) -> None:
        """Drop the scoring jobs, then answer ``handles`` and everything not applied
        (``TurnSource.fail_unapplied``)."""
        self._scoring.drop(message)
        self.turns.fail_unapplied(message, handles)

    def persist_cache(self) -> None:
        """At a stop: every cached page to the disk tier (``disk_tier.persist_at_stop``)."""
        if self.parts.disk is not None:
            persist_at_stop(self.parts.disk, self.scheduler.cache, self.runner.kv)

    def release_everything(self) -> None:
        pool = self.scheduler.pool
        for owner in list(pool.owner_block_counts()):
            pool.free_all(owner)  # type: ignore[arg-type]
        mx.clear_cache()


_SHRUNK = (
    "the KV pool has been shrunk below what this request needs; try again later or with a "
    "shorter prompt"
)
