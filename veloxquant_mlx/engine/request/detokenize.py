"""Streaming detokenization that releases text as soon as it can be decoded.

mlx_lm's streaming detokenizers hold text back while it ends in an invalid or unfinished UTF-8
sequence: a model that emits stray byte tokens (a byte-level BPE's ``0x80``, an SPM byte-fallback
``<0x80>``) streams nothing until the request finishes. For byte-level BPE and SPM tokenizers,
this module maps each token id to its bytes once and runs them through Python's incremental
UTF-8 decoder: only a possibly unfinished character (at most 3 bytes) is held, invalid bytes come
out as U+FFFD at once, and the concatenated text equals mlx_lm's final text (the whole byte
string decoded with replacement, one leading space dropped as mlx_lm does). Other tokenizers
keep mlx_lm's own detokenizer.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# mlx_lm's GPT-2 byte map (character -> byte), the one its BPE detokenizer decodes with.
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import _byte_decoder as gpt2_byte_decoder

_SPM_SPACE = "\u2581".encode()


class Detokenizer(Protocol):
    """One request's token-to-text state (engine thread only)."""

    def add_token(self, token: int) -> str:
        """Text this token releases (may be empty)."""
        ...

    def finalize(self) -> str:
        """Text still held at the end of the request."""
        ...


class ByteDetokenizer:
    """Owns one request's incremental UTF-8 decoder over a shared id -> bytes table.

    ``add_token`` is O(bytes of the token). Ids outside the table decode to nothing (a padded
    vocabulary's unused rows), as the Hugging Face tokenizers do.
    """

    __slots__ = ("_decoder", "_started", "_table", "_trim_space")

    def __init__(self, table: Sequence[bytes], trim_space: bool) -> None:
        self._table = table
        self._trim_space = trim_space
        self._started = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add_token(self, token: int) -> str:
        data = self._table[token] if 0 <= token < len(self._table) else b""
        return self._emit(self._decoder.decode(data))

    def finalize(self) -> str:
        return self._emit(self._decoder.decode(b"", final=True))

    def n_held_bytes(self) -> int:
        """Bytes received but not yet released (an unfinished character)."""
        return len(self._decoder.getstate()[0])

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self._trim_space and text[0] == " ":
                return text[1:]
        return text


class SegmentDetokenizer:
    """Adapter over an mlx_lm ``StreamingDetokenizer`` (tokenizers without a byte table)."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def add_token(self, token: int) -> str:
        self._inner.add_token(token)
        return str(self._inner.last_segment)

    def finalize(self) -> str:
        self._inner.finalize()
        return str(self._inner.last_segment)


def token_bytes_table(tokenizer: Any) -> list[bytes] | None:
    """Each token id's raw bytes, for byte-level BPE and SPM tokenizers (None for others).
    O(vocabulary), built once at model load."""
    proto = tokenizer.detokenizer
    if isinstance(proto, BPEStreamingDetokenizer):
        decoder = gpt2_byte_decoder()
        return [bytes(_bpe_token_bytes(t, decoder)) for t in proto.tokenmap]
    if isinstance(proto, SPMStreamingDetokenizer):
        return [t.replace(_SPM_SPACE, b" ") for t in proto.tokenmap]
    return None


def detokenizer_factory(
    tokenizer: Any, table: list[bytes] | None = None
) -> Callable[[], Detokenizer]:
    """A maker of fresh per-request detokenizers for an mlx_lm ``TokenizerWrapper``.

    ``table`` is ``token_bytes_table(tokenizer)`` (built here when not given).
    """
    proto = tokenizer.detokenizer
    if table is None:
        table = token_bytes_table(tokenizer)
    if table is not None and isinstance(proto, BPEStreamingDetokenizer):
        return functools.partial(ByteDetokenizer, table, True)
    if table is not None and isinstance(proto, SPMStreamingDetokenizer):
        return functools.partial(ByteDetokenizer, table, bool(proto.trim_space))
    return lambda: SegmentDetokenizer(tokenizer.detokenizer)


def _bpe_token_bytes(token: str | None, decoder: dict[str, int]) -> bytearray:
    out = bytearray()
    for ch in token or "":
        b = decoder.get(ch)
        if b is None:  # not a byte-level character (an added token's text): its own UTF-8
            out += ch.encode()
        else:
            out.append(b)
    return out
