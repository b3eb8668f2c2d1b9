"""A request as the scheduler holds it (``Seq``), and what one step does (``StepPlan``, its
prefill ``Chunk``s): written by the scheduler, carried out by the runner and the core. No MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from veloxquant_mlx.engine.loop.prefix_cache import SeqPages
from veloxquant_mlx.engine.request.handle import RequestHandle

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.rows import RowState
    from veloxquant_mlx.engine.request.running import Running


@dataclass(eq=False, slots=True)
class Seq:
    """One request's tokens and block table. Each part has one writer:

    - the scheduler: ``table`` (``table[2 * layer]`` lists the K block ids of ``layer`` in
      position order, ``[2 * layer + 1]`` its V blocks), ``n_kv`` (how many tokens have KV
      written or planned), ``decoding`` (its prompt is in: it is a row of the decode batch),
      ``pages`` and ``preemptions``;
    - the core's read-back: ``tokens`` (the prompt, then every generated token) and ``out``
      (its output state: detokenizer, stops, counts);
    - the runner: ``state`` (its MLX side: sampler, processors, prefill caches).
    """

    handle: RequestHandle
    tokens: list[int]
    n_prompt: int
    table: list[list[int]] = field(default_factory=list)
    n_kv: int = 0
    decoding: bool = False
    preemptions: int = 0
    state: RowState | None = None
    pages: SeqPages = field(default_factory=SeqPages)  # its side of the prefix cache
    preloaded: Any = None  # KV the disk tier loaded past its pages (the runner takes it)
    disk_read: Any = None  # the disk tier's read of its next pages (a Future), while waiting
    disk_turn: bool = False  # its pages are on disk and the readers are taken: it waits
    out: Running | None = None

    @property
    def request_id(self) -> int:
        return self.handle.request_id

    @property
    def group(self) -> int:
        """Its client request's group (a request of its own: minus its id)."""
        return self.handle.request.group or -self.handle.request_id

    @property
    def kv_format(self) -> str:
        """The KV format its request asked for ("": the server's own; ``--kv-formats``)."""
        return self.handle.request.kv_format

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def n_blocks(self) -> int:
        """Blocks per layer and stream."""
        return len(self.table[0]) if self.table else 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """``n`` prompt tokens of ``seq`` from position ``start``, in one forward, launched in
    ``parts`` runs of its layers while other rows decode (the scheduler's ``PrefillParts``)."""

    seq: Seq
    start: int
    n: int
    parts: int = 1

    @property
    def completes(self) -> bool:
        """The prompt is all in after it: the row joins the decode batch."""
        return self.start + self.n == len(self.seq.tokens)


@dataclass(slots=True)
class StepPlan:
    """What one step does, decided by ``Scheduler.schedule``; the core carries it out in this
    order: end ``unservable`` and ``outgrown``, start ``admitted``, take ``preempted`` out of the
    batch, mirror ``grown`` tables, prefill ``together`` (one padded forward) and ``chunks``,
    then decode every row of the batch."""

    admitted: list[Seq] = field(default_factory=list)
    unservable: list[Seq] = field(default_factory=list)  # a shrink made them too large
    preempted: list[Seq] = field(default_factory=list)  # back in the queue, blocks freed
    # Alone and out of blocks: it outgrew the whole pool (True: as configured, so its
    # completion ends there, "length"; False: after a shrink, capacity_reduced).
    outgrown: list[tuple[Seq, bool]] = field(default_factory=list)
    grown: list[tuple[Seq, int]] = field(default_factory=list)  # (seq, blocks it had)
    together: list[Seq] = field(default_factory=list)  # short fresh prompts, one forward
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens this step prefills (its chunks and its prompts together)."""
        return sum(c.n for c in self.chunks) + sum(len(s.tokens) for s in self.together)
