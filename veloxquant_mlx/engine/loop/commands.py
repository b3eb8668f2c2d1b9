"""What one engine turn takes from its callers, as plain data: requests to add, ids to cancel,
typed commands, the drain decision. Pure Python (no MLX).

A ``Turn`` is the unit the loop applies before it schedules. In a group over mx.distributed
(``engine/loop/group.py``) rank 0 builds each turn from its inbox and broadcasts it, and every rank
applies the same turn and then runs the same step, so the ranks' schedulers, pools and batches
stay identical. Everything in a turn therefore pickles and nothing in it depends on the clock
or randomness of the rank that applies it: the leader decides the drain deadline
(``drain_expired``) and the random seeds (``hosts.thread.Engine.submit``).
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.engine.types import GenerationRequest


@dataclass(frozen=True, slots=True)
class Shrink:
    """Retire free blocks down to ``target_free`` (``stream`` "k", "v" or "kv").

    In a group, ``target_free`` counts token blocks (``in_token_blocks``): a rank's own block
    count is that times its blocks per token block, so ranks holding different layers
    (pipeline) keep the same capacity in tokens."""

    stream: str
    target_free: int
    in_token_blocks: bool = False


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Drop every cached prefix page no request holds."""


@dataclass(frozen=True, slots=True)
class Score:
    """Prompt logprobs of ``prompt`` with the ``top`` most likely alternatives."""

    prompt: tuple[int, ...]
    top: int


@dataclass(frozen=True, slots=True)
class GroupPools:
    """Every rank's pool, gathered to every rank: ``[(rank, blocks in use, owners, blocks)]``."""


Command = Shrink | ResetPrefixCache | Score | GroupPools


@dataclass(frozen=True, slots=True)
class Turn:
    """The callers' input to one turn of the loop."""

    adds: tuple[tuple[int, GenerationRequest], ...] = ()  # (request id, request)
    cancels: tuple[int, ...] = ()
    commands: tuple[Command, ...] = ()
    draining: bool = False
    drain_expired: bool = False  # the drain deadline has passed: fail what still runs

    @property
    def empty(self) -> bool:
        return not (self.adds or self.cancels or self.commands or self.draining)


EMPTY = Turn()

__all__ = [
    "EMPTY",
    "Command",
    "GroupPools",
    "ResetPrefixCache",
    "Score",
    "Shrink",
    "Turn",
]
