"""Incremental detokenization: text as soon as it is complete, token by token."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Releases each token's text as soon as it decodes to whole characters.

    mlx_lm's streaming detokenizers hold text back until a word boundary, so a client sees
    nothing for several tokens (a long time to first token on a slow model). Here every step
    decodes the few tokens since the last release, with the tokens before them as context
    (so leading-space rules apply as in a full decode), and releases the new suffix unless it
    ends in an incomplete UTF-8 sequence (U+FFFD). The released pieces concatenate to the decode
    of all tokens. Cost per token: two decodes of a handful of ids. Engine thread only.
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens up to here have been released

    def add(self, token: int) -> str:
        """The text ``token`` completes (possibly empty while a character is unfinished)."""
        self._ids.append(token)
        return self._release(final=False)

    def finalize(self) -> str:
        """Whatever is still held at the end (an unfinished character is released as is)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]
