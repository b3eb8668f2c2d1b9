"""Stored responses for the Responses API's ``previous_response_id`` (``--responses-store``).

A response created with ``store`` (the API's default) is kept in memory: its object as
returned (``GET /v1/responses/{id}``) and the turn it added to the conversation, as chat
messages: the request's input items, then its output (text, tool calls). A request naming
``previous_response_id`` continues that conversation: the messages of every response up its
chain, oldest first, then its own input. ``instructions`` are not carried over (the API's
rule: each request's own instructions are its system message).

Each response keeps only its own turn and its parent's id, so a chain of n turns holds n
turns, not n conversations. The newest ``capacity`` responses are kept, and at most
``max_bytes`` of their text (a client that sends whole conversations with ``store`` on would
otherwise keep ``capacity`` conversations) (LRU: continuing a conversation refreshes its whole
chain); a chain whose older part was evicted cannot be
continued, which the request is told (400). Per process: replicas behind a router do not
share it. Thread-safe (the event loop and threads that render prompts).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class Stored:
    """One response: its object, its turn as chat messages, and the response it continued."""

    response: dict[str, Any]
    turn: tuple[dict[str, Any], ...]
    previous: str | None
    size: int  # bytes of its text (the response object and the turn), for the store's cap


MAX_BYTES = 64 << 20  # of the stored responses' text, together


class ResponseStore:
    """The newest ``capacity`` stored responses by id, at most ``max_bytes`` of text (0: none
    are stored)."""

    def __init__(self, capacity: int = 256, max_bytes: int = MAX_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(
        self,
        response: dict[str, Any],
        turn: list[dict[str, Any]],
        previous: str | None,
    ) -> None:
        """Keep ``response`` (its ``id``) with the chat messages of its ``turn``."""
        if not self.capacity:
            return
        size = len(json.dumps([response, turn], separators=(",", ":")))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (continuing it is a 400)
        with self._lock:
            old = self._items.pop(response["id"], None)
            self.bytes -= 0 if old is None else old.size
            self._items[response["id"]] = Stored(dict(response), tuple(turn), previous, size)
            self.bytes += size
            while len(self._items) > self.capacity or self.bytes > self.max_bytes:
                self.bytes -= self._items.popitem(last=False)[1].size

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored response object, or None."""
        with self._lock:
            stored = self._items.get(response_id)
        return None if stored is None else dict(stored.response)

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        with self._lock:
            gone = self._items.pop(response_id, None)
            self.bytes -= 0 if gone is None else gone.size
        return gone is not None

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of ``response_id``'s chain, oldest turn first; each response of
        the chain becomes the newest again.

        Raises:
            KeyError: ``response_id`` is not stored, or a response it continued was evicted
                (the message says which).
        """
        turns: list[tuple[dict[str, Any], ...]] = []
        with self._lock:
            current: str | None = response_id
            chain = []
            while current is not None:
                stored = self._items.get(current)
                if stored is None:
                    if current == response_id:
                        raise KeyError(f"previous response '{response_id}' is not stored here")
                    raise KeyError(
                        f"previous response '{response_id}' continues '{current}', which is no "
                        "longer stored (the oldest responses are dropped past "
                        "--responses-store); send the whole conversation in input"
                    )
                chain.append(current)
                turns.append(stored.turn)
                current = stored.previous
            for rid in reversed(chain):  # the newest id most recent
                self._items.move_to_end(rid)
        return [dict(m) for turn in reversed(turns) for m in turn]
