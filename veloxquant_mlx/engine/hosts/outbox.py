"""The messages ``EngineProcess`` sends its child: a bounded queue and a sender thread, so a child
that stops reading (stopped, swapping) never blocks a caller (the event loop included) and a
caller far ahead of it is refused at once.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from multiprocessing.connection import Connection

from veloxquant_mlx.engine.types import EngineNotReadyError

OUTBOX = 4096  # messages queued for the child at most (then 503)
_CLOSE = object()  # tells the sender thread to stop


class Outbox:
    """Owns the queue and the sender thread over ``conn`` (the pipe's parent end)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.Queue[object] = queue.Queue(OUTBOX)
        self._sender = threading.Thread(
            target=self._send_all, name="veloxquant-engine-send", daemon=True
        )
        self._sender.start()

    def put(self, message: object) -> None:
        """Queue ``message`` for the child; never blocks.

        Raises:
            EngineNotReadyError: The child has not read its last ``OUTBOX`` messages (stopped
                or far behind: the caller answers 503).
        """
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            raise EngineNotReadyError(
                "the engine process is not keeping up; try again later"
            ) from None

    def close(self) -> None:
        """Stop the sender (after what is queued, or at once if the queue is full) and wait a
        little for it: one stuck in a send (a stopped child) is left behind."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_CLOSE)
        if self._sender is not threading.current_thread():
            self._sender.join(2.0)

    def _send_all(self) -> None:
        """The sender thread: hands queued messages to the pipe (blocking here, not in callers)."""
        while True:
            message = self._queue.get()
            if message is _CLOSE:
                return
            try:
                self._conn.send(message)
            except (OSError, EOFError, ValueError):  # closed: the reader sees the child gone
                return
