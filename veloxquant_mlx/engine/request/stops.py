"""Stop strings matched across token boundaries, never emitted."""

from __future__ import annotations


class StopMatcher:
    """Holds back text that could still become a stop string; releases the rest.

    ``feed(delta)`` returns ``(text_to_emit, stopped)``. Once a stop string appears, the text
    before it is emitted and everything from it on is dropped. ``flush()`` releases what is
    held back when generation ends for another reason.
    """

    __slots__ = ("_held", "_max", "_stops", "matched")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._max = max((len(s) for s in stops), default=0)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        text = self._held + delta
        hits = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits, key=lambda h: h[0])
            return text[:at], True
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(self._max - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
