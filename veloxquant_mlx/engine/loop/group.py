"""One model over several processes (mx.distributed): who this rank is, and what the ranks
exchange besides the model's own collectives. MLX; engine and follower threads only.

Serving is SPMD, as in ``mlx_lm.server``: rank 0 owns HTTP, admission and the request ids; at
the start of every loop turn it broadcasts that turn's input (``commands.Turn``) and every rank
applies it and runs the same step, so the sharded model's collectives line up. When rank 0 is
idle it still broadcasts an empty turn every ``heartbeat`` seconds, so a rank that died is
noticed within about a second (the collective fails), not at the next request.
"""

from __future__ import annotations

import faulthandler
import logging
import pickle
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.config.launch import launched_rank
from veloxquant_mlx.engine.loop.commands import Turn
from veloxquant_mlx.engine.types import GroupInfo

log = logging.getLogger("veloxquant.group")

TENSOR, PIPELINE = "tensor", "pipeline"


class Group:
    """The ranks of one model. ``share`` and the reductions are collectives: every rank must
    call them in the same order (they run on the calling thread's default stream, in order
    with the model's own)."""

    def __init__(self, group: Any, mode: str) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.mode = mode

    @property
    def info(self) -> GroupInfo:
        return GroupInfo(self.size, self.rank, self.mode)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, turn: Turn | None) -> Turn | None:
        """Rank 0's ``turn`` on every rank (None: nothing this turn, one small collective)."""
        g = self.group
        if self.leader:
            data = b"" if turn is None or turn.empty else pickle.dumps(turn)
            mx.eval(mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=g))
            if not data:
                return None
            payload = mx.array(np.frombuffer(data, dtype=np.uint8))
            mx.eval(mx.distributed.all_sum(payload, group=g))
            return turn
        size = int(_evaluated(mx.distributed.all_sum(mx.array(0, dtype=mx.int32), group=g)))
        if not size:
            return None
        received = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=g)
        shared: Turn = pickle.loads(_evaluated(received).tobytes())
        return shared

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        out = mx.distributed.all_min(mx.array(value, dtype=mx.int64), group=self.group)
        return int(_evaluated(out))

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order."""
        out = mx.distributed.all_gather(mx.array([values], dtype=mx.int64), group=self.group)
        rows: list[list[int]] = _evaluated(out).tolist()
        return rows


def _evaluated(x: mx.array) -> np.ndarray:
    """``x`` as numpy, evaluated by ``mx.eval`` first: a failed collective raises there (read
    through numpy unevaluated, it gives zeros instead)."""
    mx.eval(x)
    return np.array(x)


def init_group(pipeline: bool, join_timeout: float) -> Group | None:
    """The group this process was launched into, or None for a single process.

    Joining waits for every rank; MLX holds the GIL meanwhile, so no Python thread can time it
    out: past ``join_timeout`` seconds, faulthandler's own thread prints where it waited and
    ends the process with exit code 1.

    Raises:
        RuntimeError: Launched as a rank but MLX could not join the group.
    """
    rank = launched_rank()
    if rank is None:
        return None
    log.info("rank %d: joining the group (waiting up to %.0f s for every rank)", rank, join_timeout)
    faulthandler.dump_traceback_later(join_timeout, exit=True)
    try:
        g = mx.distributed.init(strict=True)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if g.size() == 1:
        return None
    group = Group(g, PIPELINE if pipeline else TENSOR)
    log.info("rank %d of %d (%s parallel)", group.rank, group.size, group.mode)
    return group


def pool_rows(pool: Any, group: Group | None) -> list[list[int]]:
    """``[rank, blocks, free, blocks in use, owners]`` of every rank's pool ``pool`` (a
    collective in a group: every rank runs it in the same turn)."""
    stats = pool.stats
    mine = [
        0 if group is None else group.rank,
        stats.n_blocks,
        sum(pool.n_free(s) for s in pool.streams),
        stats.blocks_in_use(),
        len(pool.owner_block_counts()),
    ]
    return [mine] if group is None else group.gather_ints(mine)
