"""Prefills whose rows wait to join the batch (``--prefill-join ready``): held until the join
clock calls them done, forgotten when a row leaves first, and the first tokens of the rows
that joined a step read after its launch, timed for the clock. The runner joins the rows
(``Runner._due``); this owns the waiting. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from veloxquant_mlx.engine.loop.join_clock import JoinClock, Launch
from veloxquant_mlx.engine.loop.seq import Seq

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.rows import Sampled


@dataclass(slots=True)
class Prefilled:
    """A prefill whose last forward is launched: its first tokens, and each row's KV per
    layer, to join the batch."""

    sampled: Sampled
    joins: list[tuple[Seq, list[tuple[mx.array, mx.array]]]]
    launch: Launch | None  # None: on the decode steps' stream


class JoinQueue:
    """The prefill stream's clock, the prefills waiting (oldest first), and those whose rows
    joined this step (``settle`` reads their first tokens)."""

    def __init__(self) -> None:
        self.clock = JoinClock()
        self._waiting: list[Prefilled] = []
        self._joined: list[Prefilled] = []
        self.late = 0  # rows that joined a step after their last chunk's

    def hold(self, done: Prefilled) -> None:
        """``done``'s rows wait until its prefill is probably done (``take_due``)."""
        self._waiting.append(done)

    def take_due(self, decoding: bool) -> list[Prefilled]:
        """The waiting prefills probably done by now (all of them when no row ``decoding``:
        nobody's step would wait), out of the queue; the caller joins their rows."""
        due = [
            p for p in self._waiting if not decoding or p.launch is None or self.clock.due(p.launch)
        ]
        for done in due:
            self._waiting.remove(done)
            self.late += len(done.joins)
        self._joined.extend(due)
        return due

    def joined_now(self, done: Prefilled) -> None:
        """``done``'s rows joined the step built with its last chunk: time its read too."""
        self._joined.append(done)

    def settle(self) -> None:
        """After the step is launched: wait for the first tokens of the rows that joined it,
        timing the wait for the clock (a wait means a late guess: the step waited too)."""
        joined, self._joined = self._joined, []
        if not joined:
            return
        start = self.clock.clock()
        mx.eval([p.sampled.tokens for p in joined])
        end = self.clock.clock()
        for done in joined:
            if done.launch is not None:
                self.clock.learn(done.launch, end - start, end)

    def forget(self, seq: Seq) -> None:
        """``seq`` leaves before it joined: out of its prefill's joins, a hole in its first
        tokens (a preempted request is read back nothing: it prefills again)."""
        for done in self._waiting:
            if any(s is seq for s, _ in done.joins):
                done.joins = [(s, layers) for s, layers in done.joins if s is not seq]
                done.sampled.seqs = [None if s is seq else s for s in done.sampled.seqs]
        self._waiting = [p for p in self._waiting if p.joins]

    def restart_clock(self) -> None:
        """Forget what the clock learned (after the warm-up, whose forwards paid the kernels'
        first compiles)."""
        self.clock = JoinClock()

    def waiting(self) -> int:
        """Rows prefilled and not yet joined."""
        return sum(len(p.joins) for p in self._waiting)
