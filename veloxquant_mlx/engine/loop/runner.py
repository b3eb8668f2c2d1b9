"""The model side of the engine: the batch's rows, prefilled prompts joining them, the batched
decode step, sampling. With ``prefill.Prefiller`` (the forwards of prompts) the only code that
runs the model; engine thread only.

A request is prefilled alone, in chunks, into stock mlx_lm caches (``prefill``); then its KV
is copied into the batch's memory (``kv.paged``: its blocks, or its row of the working set) and
it joins the next decode step. A step feeds every row its last sampled token at its own
position, samples every row in one vectorized pass (``request.sampling``), and is evaluated
asynchronously: the engine reads step ``n``'s tokens while step ``n + 1`` runs, as mlx_lm's
BatchGenerator does. A row leaves by leaving a hole in its slot (computed, masked, never read)
that the next arrival fills: nobody's KV moves or is copied when a row joins or leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.engine.loop.join_clock import Launch
from veloxquant_mlx.engine.loop.joins import JoinQueue, Prefilled
from veloxquant_mlx.engine.loop.page_copies import PageCopies
from veloxquant_mlx.engine.loop.prefill import Prefiller
from veloxquant_mlx.engine.loop.rows import RowState, Sampled, next_input, row_state
from veloxquant_mlx.engine.loop.seq import Seq, StepPlan
from veloxquant_mlx.engine.request.grammar import GrammarRow, fill_masks
from veloxquant_mlx.engine.request.logit_filters import bitmask_to_allowed
from veloxquant_mlx.engine.request.sampling import BatchSampler, Drawn, RowSampling
from veloxquant_mlx.kv.compiled_step import CompiledStep, decode_logits
from veloxquant_mlx.kv.layout import KVLayout


class Runner:
    """Runs the model over the batch. Owns the batch's rows (in row order) and the KV memory.

    Args:
        model: The mlx_lm model.
        kv: The layout the rows' KV lives in.
        block_size: Tokens per pool block (a cached page).
        prefill_stream: Run prefill forwards on an MLX stream of their own (made on the engine
            thread at the first prefill: MLX's streams are per thread), so the device runs a
            prompt's chunk beside the decode steps instead of queueing them behind it.
        join_when_ready: With ``prefill_stream``, a prefilled row joins the first step built
            once its prefill is probably done on the device (``join_clock``), not the step
            built with its last chunk (which would wait for that chunk, and every row with it).
        split_chunks: A chunk beside decoding rows may be launched in parts, as many as the
            scheduler planned (``Chunk.parts``, ``--prefill-parts``).
        compiled_step: Decode steps over the dense layout run the model's forward compiled
            (``kv.compiled_step``), reading positions in chunks of ``compiled_read_chunk``.
    """

    def __init__(
        self,
        model: Any,
        kv: KVLayout,
        vocab_size: int,
        block_size: int = 16,
        prefill_stream: bool = False,
        join_when_ready: bool = False,
        sampling_cut: str = "sort",
        split_chunks: bool = False,
        compiled_step: bool = False,
        compiled_read_chunk: int = 128,
    ) -> None:
        self.kv = kv
        self.vocab_size = vocab_size
        self.sampling_cut = sampling_cut  # the sampler's top_p / top_k cut (BatchSampler)
        self.block_size = block_size
        # Called with (seq, its prompt's KV per layer) when a prefilled row joins the batch.
        self.on_join: Callable[[Seq, list[tuple[mx.array, mx.array]]], None] | None = None
        self._deferred: list[mx.array] = []  # evaluated with the next launch
        self.rows: list[Seq | None] = []  # by slot; None: a hole a leaver left
        # what the prefix cache keeps of the rows' and prompts' KV (page_copies.py)
        self.pages = PageCopies(kv, block_size, self.rows, self.defer)
        self._n_layers = len(make_prompt_cache(model))
        # the decode forward over the dense layout, compiled (kv.compiled_step)
        self.compiled = (
            CompiledStep(model, self._n_layers, compiled_read_chunk) if compiled_step else None
        )
        self._last: Sampled | None = None  # the latest step, whose tokens feed the next
        self._sampler: BatchSampler | None = None  # the batch's, for the rows of ``_last``
        self._joins = JoinQueue() if prefill_stream and join_when_ready else None
        self.prefills = Prefiller(
            model,
            kv,
            self._n_layers,
            prefill_stream,
            self._sample_first,
            self._launched,
            split_chunks,
        )

    @property
    def model(self) -> Any:
        """The model (the prefiller's: one reference for prefill and decode)."""
        return self.prefills.model

    @model.setter
    def model(self, model: Any) -> None:
        self.prefills.model = model
        if self.compiled is not None:  # traced over the old one
            self.compiled = CompiledStep(model, self._n_layers, self.compiled.read_chunk)

    # ------------------------------------------------------------------ prefill

    def prefill(self, plan: StepPlan) -> list[Sampled]:
        """Run the plan's prefills (``Prefiller``): ``together`` in one padded forward, then
        each chunk. Returns the first tokens of the rows that joined the batch: those of an
        earlier prefill whose time came (``join_when_ready``), then this step's."""
        results = self._due()
        decoding = any(r is not None for r in self.rows)
        for done in self.prefills.advance(decoding):  # chunks launched a part a turn
            self._completed(done, results)
        if plan.together:
            self._completed(self.prefills.together(plan.together), results)
        for chunk in plan.chunks:  # each completes before the next is built
            self._completed(self.prefills.chunk(chunk, split=decoding), results)
        return results

    def take_work(self) -> float:
        """Prefill launched since the last call, in tokens' worth (``Prefiller.take_work``)."""
        return self.prefills.take_work()

    def staging(self) -> bool:
        """Whether a chunk's forward is being launched a part a turn (``--prefill-parts``):
        the scheduler plans no prefill meanwhile (its budget would run ahead of the
        launches)."""
        return self.prefills.staging

    def _completed(self, done: Prefilled | None, results: list[Sampled]) -> None:
        """A prefill's last forward launched (``done``; None: a chunk with more to come):
        ``_complete`` it, adding its first tokens to ``results`` where its rows joined."""
        first = None if done is None else self._complete(done)
        if first is not None:
            results.append(first)

    # ------------------------------------------------------------------ joining the batch

    def _launched(self, n_tokens: int) -> Launch | None:
        """A prefill forward of ``n_tokens`` is launched: when it should be done."""
        return None if self._joins is None else self._joins.clock.launched(n_tokens)

    def _complete(self, done: Prefilled) -> Sampled | None:
        """A prefill's last forward is launched: its rows join the batch now, or, where rows
        decode beside a prefill on its own stream, once it is probably done (``_due``): the
        prefix cache gets its pages now either way (copied on the prefill's stream, so that
        no decode step waits for them). Returns the first tokens when they joined now."""
        mx.async_eval(done.sampled.tokens)
        if self._joins is None or not any(r is not None for r in self.rows):
            for seq, layers in done.joins:
                self._join(seq, layers)
            if self._joins is not None:
                self._joins.joined_now(done)
            return done.sampled
        with self.prefills.stream():
            for seq, layers in done.joins:
                row_state(seq).caches = None
                if self.on_join is not None:
                    self.on_join(seq, layers)
        self._joins.hold(done)
        return None

    def _due(self) -> list[Sampled]:
        """Join the rows of the prefills probably done by now; their first tokens."""
        if self._joins is None:
            return []
        due = self._joins.take_due(any(r is not None for r in self.rows))
        for done in due:
            for seq, layers in done.joins:
                self._join(seq, layers, cache_pages=False)
        return [p.sampled for p in due]

    def settle(self) -> None:
        """After the step is launched: read the first tokens of the rows that joined it
        (``JoinQueue.settle``)."""
        if self._joins is not None:
            self._joins.settle()

    def restart_join_clock(self) -> None:
        if self._joins is not None:
            self._joins.restart_clock()

    @property
    def late_joins(self) -> int:
        """Rows that joined a step after their last chunk's."""
        return 0 if self._joins is None else self._joins.late

    def waiting_to_join(self) -> int:
        return 0 if self._joins is None else self._joins.waiting()

    def _join(
        self, seq: Seq, layers: list[tuple[mx.array, mx.array]], cache_pages: bool = True
    ) -> None:
        """Make the prefilled ``seq`` a row of the batch, its KV ``layers`` copied into the
        layout; the prefix cache gets its prompt pages (``on_join``) unless they were given
        already (``cache_pages``). A prompt whose first token is its last (``max_tokens`` 1: a
        cache warm-up, a classification) never decodes: where the layout keeps no pages
        (dense), it gets its pages cached and does not join, so nobody's next step pays the
        copy of its context into the working set nor a decode step of it."""
        state = row_state(seq)
        state.caches = None
        if seq.handle.request.max_tokens > 1 or self.kv.keeps_pages:
            try:  # the first hole a leaver left, else a new row at the end
                slot = self.rows.index(None)
            except ValueError:
                slot = len(self.rows)
                self.rows.append(None)
            n_known = seq.pages.n_known * self.block_size
            self.kv.put_row(slot, layers, seq.table, n_known, seq.kv_format)
            state.joined = True
            self.rows[slot] = seq
        if cache_pages and self.on_join is not None:
            self.on_join(seq, layers)

    # ------------------------------------------------------------------ decode

    def grew(self, seq: Seq, old_blocks: int) -> None:
        """``seq``'s table gained blocks (from index ``old_blocks``): mirror them."""
        if seq in self.rows:
            self.kv.set_table(self.rows.index(seq), seq.table, old_blocks)

    def step(self, max_block_id: int) -> Sampled | None:
        """Build one decode step over every row (``launch`` starts it; tokens are read later)."""
        rows = list(self.rows)
        if not rows:
            return None
        last = self._last
        same_rows = last is not None and last.seqs == rows
        if last is not None and same_rows:
            inputs = last.tokens
        else:  # a hole (a row that left) feeds token 0 at position 0 of its own slot
            if last is not None:  # the rows that stay feed from the latest step's tokens
                for i, seq in enumerate(last.seqs):
                    if seq is not None and seq.state is not None:
                        seq.state.next_input = last.tokens[i : i + 1]
            hole = mx.zeros((1,), dtype=mx.uint32)
            inputs = mx.concatenate(
                [hole if s is None else next_input(s).astype(mx.uint32) for s in rows]
            )
        batch = self.kv.step_batch([0 if s is None else s.n_kv for s in rows])
        self.kv.begin_step(batch, max_block_id)
        logits = decode_logits(self.model, self.kv, inputs, batch, self._n_layers, self.compiled)
        if self._sampler is None or not same_rows:
            self._sampler = self._sampler_for(rows, self._sampler)
        sampled = self._sample(rows, logits, self._sampler, inputs)
        self._last = sampled
        return sampled

    def launch(self, sampled: Sampled) -> None:
        """Start evaluating a built step (asynchronously; ``Sampled.tokens`` is read later),
        with whatever was deferred to it (``defer``)."""
        extra, self._deferred = self._deferred, []
        self.pages.launched()
        mx.async_eval(sampled.tokens, *_logprob_arrays(sampled.drawn), *sampled.drawn.state, *extra)

    def defer(self, arrays: list[mx.array]) -> None:
        """Evaluate ``arrays`` with the next launch (``flush`` if none comes): one evaluation
        call per step instead of one more per joining row."""
        self._deferred.extend(arrays)

    def flush(self) -> None:
        """Start evaluating what was deferred, when no step is launched to carry it."""
        if self._deferred:
            extra, self._deferred = self._deferred, []
            mx.async_eval(extra)

    def _sampler_for(
        self, seqs: list[Seq | None], previous: BatchSampler | None = None
    ) -> BatchSampler:
        asked = [s.handle.request for s in seqs if s is not None and s.handle.request.logprobs]
        top = max((r.top_logprobs for r in asked), default=0) if asked else None
        return BatchSampler(
            [_sampling(s) for s in seqs], self.vocab_size, top, previous, self.sampling_cut
        )

    def _sample_first(self, seqs: list[Seq], logits: mx.array) -> Sampled:
        """The first tokens of prompts that complete their prefill (their windows start from
        the prompts' tails; their keys and windows go back to them after)."""
        for seq in seqs:
            row_state(seq).sampling.start_window(seq.tokens, self.vocab_size)
        sampler = self._sampler_for(list(seqs))
        sampled = self._sample(list(seqs), logits, sampler)
        sampler.release()
        return sampled

    def _sample(
        self,
        seqs: list[Seq | None],
        logits: mx.array,
        sampler: BatchSampler,
        inputs: mx.array | None = None,
    ) -> Sampled:
        constrained = self._constrained(seqs)
        if inputs is not None and self._early_forward(constrained):
            # The constrained rows' masks need the previous step's tokens on the host: the
            # step's forward runs meanwhile (launched now, it queues behind that step), so the
            # device computes it while the host waits for those tokens and fills the masks.
            mx.async_eval(logits)
        drawn = sampler.draw(logits, inputs, self._allowed(constrained, len(seqs), inputs))
        return Sampled(seqs, drawn.tokens, drawn)

    @staticmethod
    def _constrained(seqs: list[Seq | None]) -> list[tuple[int, RowState]]:
        """(slot, state) of the rows a grammar constrains."""
        return [
            (i, s.state)
            for i, s in enumerate(seqs)
            if s is not None and s.state is not None and s.state.grammar is not None
        ]

    def _early_forward(self, constrained: list[tuple[int, RowState]]) -> bool:
        """Whether a decode step's forward is launched before its grammar masks are made: some
        row is constrained (``_constrained``), and the layout lets a step run while the
        previous one does (its writes stay in place) with no leaving row's pages being copied
        out."""
        return (
            bool(constrained) and not self.kv.launch_after_previous and not self.pages.copied_out()
        )

    def _allowed(
        self, rows: list[tuple[int, RowState]], n_rows: int, inputs: mx.array | None
    ) -> mx.array | None:
        """The grammar masks of the constrained ``rows`` of ``n_rows`` (fed the tokens this
        step feeds first; a grammar that fails fails its request alone), or None when no row
        is constrained."""
        if not rows:
            return None
        fed: list[int] = [] if inputs is None else inputs.tolist()  # type: ignore[assignment]
        live: list[tuple[int, GrammarRow]] = []
        for i, state in rows:
            assert state.grammar is not None
            if fed and state.fault.error is None:
                try:
                    state.grammar.advance(fed[i])
                except Exception as exc:
                    state.fault.record("grammar", exc)
            if state.fault.error is None:
                live.append((i, state.grammar))
        if not live:
            return None
        return bitmask_to_allowed(fill_masks(live, n_rows, self.vocab_size), self.vocab_size)

    def remove(self, seq: Seq) -> None:
        """Take ``seq``'s row out of the batch (finish, cancel, preemption); O(row)."""
        state: RowState | None = seq.state
        if state is None:
            return
        state.caches = None
        self.prefills.forget(seq)
        if not state.joined:
            if self._joins is not None:
                self._joins.forget(seq)
            return
        state.joined = False
        slot = self.rows.index(seq)
        if self._sampler is not None:  # its key and window go with it (a preempted row returns)
            self._sampler.release_row(slot, state.sampling)
        self.rows[slot] = None  # a hole: nothing moves; the next arrival takes the slot
        self.kv.set_hole(slot)
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        if not self.rows:
            self.kv.clear()
            self._last = None
            self._sampler = None


def _sampling(seq: Seq | None) -> RowSampling | None:
    return None if seq is None else row_state(seq).sampling


def _logprob_arrays(drawn: Drawn) -> list[mx.array]:
    parts = (drawn.token_logprobs, drawn.top_ids, drawn.top_logprobs)
    return [a for a in parts if a is not None]
