"""Where each loop turn's input comes from, and the callers' side of it. Engine thread.

Alone, or as rank 0 of a group, a turn is taken from the inbox (waiting while idle) and, in a
group, broadcast to the other ranks; on the other ranks it is rank 0's broadcast. The handles
and command futures taken with it stay here until the core applies the turn: a request another
rank answers gets a handle that discards its events, a command no caller waits for is only run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from veloxquant_mlx.engine.loop.commands import EMPTY, Command, Turn
from veloxquant_mlx.engine.loop.group import Group
from veloxquant_mlx.engine.loop.inbox import Inbox
from veloxquant_mlx.engine.loop.readback import push_finish
from veloxquant_mlx.engine.request.handle import DISCARD, RequestHandle
from veloxquant_mlx.engine.request.scoring import ScoringJob
from veloxquant_mlx.engine.types import ENGINE_FAILED, EngineNotReadyError, GenerationRequest

log = logging.getLogger("veloxquant.engine")


def wait_for_stall(turns: TurnSource, limit: float, watching: Callable[[], bool]) -> bool:
    """Block until one turn has waited on the other ranks past ``limit`` seconds (True: the
    group is dead) or ``watching()`` turns false (False). A watchdog thread's loop."""
    while watching():
        time.sleep(min(1.0, limit / 4))
        since = turns.since
        if since is not None and time.monotonic() - since > limit:
            return True
    return False


class TurnSource:
    """The input of every turn. ``since`` (read by watchdogs from other threads): when the
    current turn began waiting on the other ranks, None between turns."""

    def __init__(self, inbox: Inbox, group: Group | None, heartbeat: float) -> None:
        self.inbox = inbox
        self.group = group
        self.heartbeat = heartbeat
        self.since: float | None = None
        self._handles: dict[int, RequestHandle] = {}  # taken from the inbox, not yet applied
        self._futures: list[Future[Any]] = []  # the taken commands' answers, in order

    def next(self, busy: Callable[[], bool]) -> Turn | None:
        """This turn's input; None: nothing new. ``busy``: whether requests are queued or
        running (then nothing is waited for)."""
        group = self.group
        if group is not None and not group.leader:
            self.since = time.monotonic()
            return group.share(None)
        ib = self.inbox
        turn = None
        if ib.adds or ib.cancels or ib.commands or ib.draining or not busy():
            turn = self._take(None if group is None else self.heartbeat, busy)
        if group is not None:
            self.since = time.monotonic()
            group.share(turn)
        return turn

    def _take(self, timeout: float | None, busy: Callable[[], bool]) -> Turn:
        """What callers sent, waiting for something while idle (at most ``timeout``)."""
        ib = self.inbox
        deadline = None if timeout is None else time.monotonic() + timeout
        with ib.lock:
            while not (ib.adds or ib.cancels or ib.commands or ib.draining or busy()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return EMPTY
                ib.lock.wait(left)
            adds = list(ib.adds)
            ib.adds.clear()
            # Still waiting to submit's bound until the turn's plan counts them: without this
            # a submit between the two saw neither and went past --max-queue.
            ib.n_waiting += len(adds)
            cancels, ib.cancels = ib.cancels, set()
            commands = list(ib.commands)
            ib.commands.clear()
            draining, drain_deadline = ib.draining, ib.drain_deadline
        for handle in adds:
            self._handles[handle.request_id] = handle
        self._futures = [future for _, future in commands]
        return Turn(
            adds=tuple((h.request_id, h.request) for h in adds),
            cancels=tuple(sorted(cancels)),
            commands=tuple(command for command, _ in commands),
            draining=draining,
            drain_expired=draining
            and drain_deadline is not None
            and time.monotonic() >= drain_deadline,
        )

    def run_commands(self, turn: Turn, execute: Callable[[Command], Any]) -> None:
        """Run the turn's commands in order, answering whoever waits for each."""
        futures, self._futures = self._futures, []
        for i, command in enumerate(turn.commands):
            future = futures[i] if i < len(futures) else None
            try:
                result = execute(command)
            except BaseException as exc:
                if future is None:
                    log.info("command %s failed on this rank: %s", command, exc)
                elif not future.done():  # an abandoned engine has answered it already
                    future.set_exception(exc)
            else:
                if isinstance(result, ScoringJob):  # answered later, a chunk a turn
                    result.future = future
                elif future is not None and not future.done():
                    future.set_result(result)

    def handle(self, request_id: int, request: GenerationRequest) -> RequestHandle:
        """The caller's handle of a new request, or one that discards its events (another
        rank answers it)."""
        handle = self._handles.pop(request_id, None)
        return RequestHandle(request_id, request, DISCARD) if handle is None else handle

    def fail_unapplied(self, message: str, handles: Sequence[RequestHandle] = ()) -> None:
        """The engine is failing: close the inbox, then answer with ENGINE_FAILED ``handles``,
        every request and command taken but not applied, and whatever callers sent that was
        never taken."""
        adds, commands = self.inbox.close()
        taken, self._handles = list(self._handles.values()), {}
        futures, self._futures = self._futures, []
        for handle in [*handles, *taken, *adds]:
            if not handle.done:
                push_finish(self.inbox, handle, "error", 0, 0, 0, error=message, code=ENGINE_FAILED)
        for future in [*futures, *(f for _, f in commands)]:
            if not future.done():
                future.set_exception(EngineNotReadyError(message))
