"""A rank other than 0 of a group: load this rank's shard, then apply rank 0's turns and run
the same steps until rank 0 drains (``engine/loop/group.py``). No HTTP, no callers.

The rank ignores SIGINT and SIGTERM (a launcher forwards them to every rank; rank 0 drains the
group and this rank stops with it). It exits 0 once rank 0 has drained and its own pool is all
free, 1 if it lost the group (a collective failed: rank 0 or another rank died) or waited on
it past ``group_timeout``, 3 if it could not load.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.loop.core import EngineCore
from veloxquant_mlx.engine.loop.inbox import Inbox
from veloxquant_mlx.engine.loop.parts import build_parts
from veloxquant_mlx.engine.loop.turns import wait_for_stall
from veloxquant_mlx.engine.model import loader

log = logging.getLogger("veloxquant.group")


def run_follower(config: EngineConfig) -> int:
    """Serve as a follower rank until the group stops; returns the process's exit code."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        rt = loader.build_runtime(config)
    except Exception as exc:
        log.error("cannot start: %s", exc)
        return 3
    group = rt.group
    if group is None or group.leader:
        log.error("not a follower rank of a group")
        return 3
    inbox = Inbox()
    inbox.alive = True
    core = EngineCore(config, inbox, build_parts(rt), group=group)
    threading.Thread(target=_watch, args=(core, config.group_timeout), daemon=True).start()
    log.info("rank %d: following rank 0 (%s parallel)", group.rank, group.mode)
    try:
        core.run()
    except Exception as exc:
        log.error("rank %d: lost the group (%s: %s); exiting", group.rank, type(exc).__name__, exc)
        return 1
    core.reset_prefix_cache()
    pool = rt.pool
    held = pool.owner_block_counts()
    if pool.stats.blocks_in_use() or held:
        log.error("rank %d: stopped with blocks held: %s", group.rank, held)
        return 1
    log.info("rank %d: rank 0 drained; pool all free (%d blocks)", group.rank, pool.stats.n_blocks)
    return 0


def _watch(core: EngineCore, limit: float) -> None:
    """Exit the process when one turn has waited on the group past ``limit`` seconds: rank 0
    (or a peer) stopped without closing its connections."""
    if wait_for_stall(core.turns, limit, lambda: True):
        log.critical("no turn from rank 0 for %.0f s: the group is dead; exiting", limit)
        logging.shutdown()
        os._exit(1)
