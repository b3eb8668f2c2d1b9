"""The MLX side of a request in the batch (``RowState``: its sampling, grammar, fault plan,
prefill caches and next input) and a step's sampled tokens not yet read back (``Sampled``).
Made and used on the engine thread only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.engine.request.faults import RequestFault
from veloxquant_mlx.engine.request.grammar import GrammarRow
from veloxquant_mlx.engine.request.sampling import Drawn, RowSampling

if TYPE_CHECKING:
    from veloxquant_mlx.engine.loop.seq import Seq


class RowState:
    """The MLX side of one request: its sampling, grammar, prefill progress."""

    __slots__ = ("caches", "fault", "grammar", "joined", "next_input", "sampling")

    def __init__(
        self, sampling: RowSampling, grammar: GrammarRow | None, fault: RequestFault
    ) -> None:
        self.sampling = sampling
        self.grammar = grammar
        self.fault = fault
        self.caches: list[KVCache] | None = None  # during prefill
        self.next_input: mx.array | None = None  # [1]: the token the next step feeds
        self.joined = False  # in the batch (prefill done)


def row_state(seq: Seq) -> RowState:
    """``seq``'s MLX side (made when it was admitted)."""
    assert seq.state is not None, "a row without its state"
    return seq.state


def next_input(seq: Seq) -> mx.array:
    token = row_state(seq).next_input
    assert token is not None, "a row in the batch without its next token"
    return token


@dataclass(slots=True)
class Sampled:
    """Tokens sampled for some rows, not yet read back (one step, or one prefill)."""

    seqs: list[Seq | None]  # None: a hole in the batch
    tokens: mx.array  # [rows]
    drawn: Drawn  # the tokens, their logprobs when a row asked, the sampler's carried state
