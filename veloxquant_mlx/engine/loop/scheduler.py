"""Who runs and who waits, and what each step does: admission against the pool, preemption,
fair shares between groups, the prefill budget. Every scheduling decision is made here
(``schedule``); what each request holds is its block table (``tables.BlockTables``); the
runner executes the plan and the core delivers. No MLX.

A request is admitted when the pool can hold its prompt now (``max_tokens`` is not reserved);
it gets one more block per layer and stream when its tokens fill the last one. When the pool
runs out mid-decode, the newest running request is preempted: its blocks go back, it returns to
the head of the queue, and later its prompt and the tokens it has generated are prefilled again
(vLLM's recompute policy), so no running request ever fails for lack of memory and nobody's
budget is held hostage by a ``max_tokens`` that is rarely used.
"""

from __future__ import annotations

import collections
import contextlib

from veloxquant_mlx.engine.loop import lookup
from veloxquant_mlx.engine.loop.prefill_budget import PrefillBudget
from veloxquant_mlx.engine.loop.prefill_parts import PrefillParts
from veloxquant_mlx.engine.loop.prefill_plan import plan_prefill
from veloxquant_mlx.engine.loop.seq import Seq, StepPlan
from veloxquant_mlx.engine.loop.tables import BlockTables
from veloxquant_mlx.pool import BlockPoolAllocator


class Scheduler:
    """The waiting FIFO and the running list (admission order); their blocks in ``tables``.

    Engine thread only.
    """

    def __init__(
        self,
        pool: BlockPoolAllocator,
        n_layers: int,
        max_running: int,
        max_queue: int,
        prefix_caching: bool = False,
        *,
        prefill_step: int = 512,
        prefill_budget: int = 512,
        idle_prefill_budget: int = 2048,
        stall_ratio: float = 0.0,
        prefill_parts: int | None = 1,
        answers_up_to: int | None = None,
        kv_format: str = "fp16",
        windows: dict[str, int] | None = None,
        window_format: str = "",
        spans: dict[str, int] | None = None,
    ) -> None:
        self.tables = BlockTables(
            pool,
            n_layers,
            prefix_caching,
            answers_up_to=answers_up_to,
            kv_format=kv_format,
            windows=windows,
            window_format=window_format,
            spans=spans,
        )
        # the shared pool, the prefix cache and the block arithmetic, as the tables hold them
        self.pool, self.cache, self.blocks = pool, self.tables.cache, self.tables.blocks
        self.n_layers = n_layers
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_step = prefill_step  # prompt tokens per forward at most
        # Prompt tokens per step at most, rows decoding (moved by measurement under a stall
        # ratio: prefill_budget.py) and none decoding (``idle``)
        self.budget = PrefillBudget(prefill_budget, idle_prefill_budget, stall_ratio)
        # The parts a chunk beside decoding rows is launched in (None: adaptive, sized by the
        # budget's reference gaps: prefill_parts.py)
        self.parts = PrefillParts(prefill_parts, self.budget.gaps)
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.preemptions = 0

    @property
    def prefill_budget(self) -> int:
        return self.budget.tokens

    @property
    def idle_prefill_budget(self) -> int:
        return self.budget.idle

    # ------------------------------------------------------------------ queue

    def share(self) -> int:
        """The running slots one group may hold while another waits under its own: the slots
        split evenly between the groups running or waiting (at least one each)."""
        groups = {s.group for s in self.running} | {s.group for s in self.waiting}
        return max(1, -(-self.max_running // max(1, len(groups))))

    def admit(self) -> tuple[list[Seq], list[Seq]]:
        """Admit waiting requests in FIFO order while the pool holds their prompts now (plus
        the first generated token), keeping one block per running row in reserve. A request
        whose group holds its share of the running slots (``share``) is passed over, keeping
        its place, while a request of a group under its share waits behind it.

        Returns:
            (admitted, unservable): the admitted in order, with their blocks; the ones a
            shrink made too large for the pool, taken out of the queue for the caller to answer.
        """
        admitted: list[Seq] = []
        unservable: list[Seq] = []
        share = self.share()
        held = collections.Counter(s.group for s in self.running)
        under = {s.group for s in self.waiting if held[s.group] < share}  # waiting, under share
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_running:
            head = self.waiting[i]
            n = len(head.tokens) + 1
            fmt, span = head.kv_format, self.blocks.span(head.kv_format)
            if not self.blocks.could_ever_fit(n, fmt):
                unservable.append(head)
                del self.waiting[i]
                continue
            if held[head.group] >= share and under - {head.group}:
                i += 1  # at its share while another group waits under its own
                continue
            hits = lookup.hits(self.cache, head)
            if lookup.shares_a_prefill(self.cache, head, len(hits), self.running):
                i += 1  # its next pages are being prefilled by another: it will hit them
                continue
            reserve = self.blocks.per_stream(self.n_layers * len(self.running))
            free = self.tables.free_now() - self.blocks.per_stream(
                self.n_layers * sum(p.span for p in hits if p.refs == 0)
            )
            need = self.blocks.per_stream(
                self.n_layers * (self.blocks.blocks_for(n, fmt) - len(hits) * span)
                + self.blocks.window(fmt)
            )
            if self.running and free - need < reserve:
                break  # FIFO for memory: nobody overtakes the head
            # its next pages are on disk: read only for a request the pool holds now, a few
            # at a time (a read's KV waits outside the pool until it is admitted)
            if not lookup.disk_ready(self.tables.disk, self.cache, head, hits, self.waiting):
                i += 1  # being read (or waiting for a reader's turn): the others go on
                continue
            if not self.tables.take(head, hits, n):
                break
            del self.waiting[i]
            self.running.append(head)
            held[head.group] += 1
            if held[head.group] >= share:
                under.discard(head.group)
            admitted.append(head)
        return admitted, unservable

    def reclaim(self, plan: StepPlan) -> None:
        """The running slots are full and a group under its share waits: preempt the newest
        request of the group furthest over its share (it is recomputed later, from its cached
        pages), until the waiting group has a slot."""
        while len(self.running) >= self.max_running and self.waiting:
            share = self.share()
            held = collections.Counter(s.group for s in self.running)
            if not any(held[s.group] < share for s in self.waiting):
                return
            over = [g for g, c in held.items() if c > share]
            if not over:
                return
            group = max(over, key=lambda g: held[g])
            victim = next(s for s in reversed(self.running) if s.group == group)
            self.preempt(victim)
            plan.preempted.append(victim)

    def ready(self) -> bool:
        """Whether a step has work: a request runs, or one waits that is not waiting for the
        disk tier's reader (whose finished reads wake the engine), or for a reader's turn."""
        return bool(self.running) or any(
            not s.disk_turn and (s.disk_read is None or s.disk_read.done()) for s in self.waiting
        )

    def victim(self) -> Seq:
        """The request to preempt when the pool runs out: the newest running one."""
        return self.running[-1]

    def preempt(self, seq: Seq) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue. The full pages it
        computed stay cached (evictable): its return may hit them."""
        self.tables.cache_leaving(seq, len(self.running))
        self.running.remove(seq)
        self.tables.release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ the plan

    def schedule(self, prefill: bool = True) -> StepPlan:
        """Decide this step: take back slots a group holds over its fair share while another
        waits, admit, make room for every decoding row's next token (preempting the newest
        requests while the pool is out), then spend the prefill budget (not with ``prefill``
        False: a chunk planned earlier is still being launched a part a turn).
        Writes the planned ``n_kv`` of the prefilled requests; ``decoded`` advances the
        decoding rows' once the step is built."""
        plan = StepPlan()
        self.reclaim(plan)
        plan.admitted, plan.unservable = self.admit()
        self.make_room(plan)
        decoding = sum(s.decoding for s in self.running)
        if prefill:
            plan_prefill(
                plan,
                self.running,
                self.prefill_budget,
                self.idle_prefill_budget,
                self.prefill_step,
            )
        if decoding and plan.chunks:
            plan.chunks = self.parts.assign(plan.chunks, decoding)
        for seq in [*plan.together, *(c.seq for c in plan.chunks if c.completes)]:
            # Admission took blocks for the prompt and the first token: nothing to grow.
            need = self.blocks.blocks_for(seq.n_kv + 1, seq.kv_format)
            assert seq.n_blocks >= need, "a row joins short"
        return plan

    @property
    def learns(self) -> bool:
        """Whether the budget or the parts move by the turns' gaps (``turn_ended``)."""
        return self.budget.adaptive or self.parts.auto

    def turn_ended(self, gap: float, prefilled: int, launched: float, decoding: int) -> None:
        """A turn ended ``gap`` seconds after the previous one, having planned ``prefilled``
        prompt tokens and launched ``launched`` tokens' worth of prefill (parts of chunks
        planned earlier included) beside ``decoding`` rows: what the budget and the parts
        learn from."""
        counted = self.budget.observe(gap, prefilled, decoding, touched=launched > 0)
        self.parts.observe(gap, launched, decoding, counted)

    def decoded(self, rows: list[Seq | None]) -> None:
        """The step over ``rows`` (the batch's, holes as None) is built: each row's KV now
        holds (or will, when it runs) one more token."""
        for seq in rows:
            if seq is not None:
                seq.n_kv += 1

    def make_room(self, plan: StepPlan) -> None:
        """Give each decoding row (oldest first) the block its next token needs; while the pool
        is out, preempt the newest running request. A request that outgrows the whole pool
        alone goes to ``plan.outgrown``."""
        for seq in [s for s in self.running if s.decoding]:
            while seq.decoding:  # until it has room; False once preempted (released)
                before = seq.n_blocks
                if self.tables.grow(seq, seq.n_kv + 1):
                    if seq.n_blocks != before:
                        plan.grown.append((seq, before))
                    break
                victim = self.victim()
                if victim is seq and len(self.running) == 1:
                    configured = not self.blocks.fits_configured(seq.n_kv + 1, seq.kv_format)
                    plan.outgrown.append((seq, configured))
                    break
                self.preempt(victim)
                plan.preempted.append(victim)

    def finish(self, seq: Seq) -> None:
        """Take ``seq`` out (running or waiting) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.tables.release(seq)
