"""A conversation's next turn tokenized with the tokens the model generated for its answers.

An agent resends the whole conversation every turn, its previous answers as text. The chat
template renders that text and the tokenizer encodes it again, which need not give back the
tokens the model generated (a random-weight model's answers never come back the same; a
trained one's can differ at whitespace and merges). Where they differ the prefix cache stops
matching, and the answer and everything after it are prefilled again although their KV is
cached (``--prefix-cache-answers``).

So the server remembers its last answers: the rendered prompt (text and ids) and the answer
(text and generated ids). A rendered conversation that starts with a remembered prompt
followed by its answer is encoded as the prompt's ids, the answer's generated ids and the rest
encoded alone: the tokens the model saw and produced, and only the new text tokenized. Nothing
else changes: a conversation that does not start that way is encoded whole, as before.

An answer that was tool calls comes back as the calls (ids, names, arguments), which the
template renders its own way (its JSON spacing, not the model's). The calls' ids name the
answer (``ToolCallSplitter.call_base``), so such a message is rendered as the text the model
generated instead (``as_generated``), which then matches as a text answer does; a template that
refuses that conversation renders the calls as sent.

With ``--prefix-cache-dir`` the remembered answers survive a restart with the pages: written
at a clean stop (``save``, ``answers.json`` in the disk tier's directory for the model, which
its files key), read at start (``load``), so the first turn after a restart hits through the
answer it resends, as it would have before. A file that cannot be read is skipped with one log
line. Servers sharing the directory (replicas of one model) each merge their answers into what
the file holds when they write it, newest last, so one stopping does not drop another's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from veloxquant_mlx.engine.types import FinishEvent, TokenEvent

# Tool-call answers kept per remembered turn: a conversation resends every earlier call.
CALLS_PER_TURN = 32
FILE = "answers.json"  # in the disk tier's directory (``EngineInfo.disk_dir``)
VERSION = 1

log = logging.getLogger("veloxquant.server")
K = TypeVar("K")
V = TypeVar("V")


@dataclass(slots=True)
class Turn:
    """One answer the server gave, after the prompt it answered."""

    prompt_ids: Sequence[int]
    answer_ids: tuple[int, ...]
    answer_text: str
    checked: bool | None = None  # the answer's ids decode to its text (checked on first use)


class AnswerTokens:
    """The last ``capacity`` answers (LRU), keyed by prompt text + answer text. Thread-safe:
    turns are remembered on the event loop and looked up where prompts are rendered.

    Args:
        capacity: Answers kept; 0 keeps none (every prompt is encoded whole).
        counted: Called once for each prompt that reuses a remembered answer's tokens (the
            ``veloxquant_resent_answers_total`` counter).
    """

    def __init__(self, capacity: int = 32, counted: Callable[[], None] | None = None) -> None:
        self.capacity = capacity
        self.counted = counted
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        # A tool-call answer's id base -> its text, for as long as conversations resend it:
        # kept past its turn (a later turn still carries the calls), LRU, a few per turn.
        self._calls: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def encode(self, tokenizer: Any, text: str) -> tuple[list[int], str | None]:
        """``text`` (a rendered prompt) as token ids, and the key of the remembered turn it
        continues (None: encoded whole)."""
        key, turn = self._longest(text)
        if turn is not None and turn.checked is None:
            turn.checked = _same_text(tokenizer.decode(list(turn.answer_ids)), turn.answer_text)
        if key is None or turn is None or not turn.checked:
            return _encode(tokenizer, text), None
        rest = _encode(tokenizer, text[len(key) :])  # never empty: a key is shorter than text
        if self.counted is not None:
            self.counted()
        return [*turn.prompt_ids, *turn.answer_ids, *rest], key

    def as_generated(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """``messages`` with each assistant message whose tool calls all came from one
        remembered answer replaced by that answer's text; None when there is none."""
        out, changed = list(messages), False
        with self._lock:
            for i, message in enumerate(messages):
                calls = message.get("tool_calls") or []
                if message.get("role") != "assistant" or not calls:
                    continue
                bases = {_base(str(c.get("id") or "")) for c in calls}
                base = bases.pop() if len(bases) == 1 else ""  # "": calls of two answers
                text = self._calls.get(base)
                if text is not None:
                    self._calls.move_to_end(base)
                    out[i] = {"role": "assistant", "content": text}
                    changed = True
        return out if changed else None

    def tap(
        self,
        prompt_text: str,
        prompt_ids: Sequence[int],
        continues: str | None,
        eos: Any,
        call_base: str | None = None,
    ) -> Answer | None:
        """An answer to ``prompt_text`` to watch (``RequestHandle.tap``): remembered when it
        finishes whole. ``continues`` is the key ``encode`` returned: that turn is superseded
        by this one and dropped then. None when nothing is kept."""
        if not self.capacity:
            return None
        return Answer(self, prompt_text, prompt_ids, continues, frozenset(eos), call_base)

    def remember(self, answer: Answer) -> None:
        text = answer.text
        key = answer.prompt_text + text
        with self._lock:
            if answer.continues is not None:
                self._turns.pop(answer.continues, None)
            self._turns[key] = Turn(answer.prompt_ids, tuple(answer.ids), text)
            self._turns.move_to_end(key)
            while len(self._turns) > self.capacity:
                self._turns.popitem(last=False)
            if answer.call_base is not None:
                self._calls[answer.call_base] = text
                self._calls.move_to_end(answer.call_base)
                while len(self._calls) > CALLS_PER_TURN * self.capacity:
                    self._calls.popitem(last=False)

    def save(self, directory: str, vocab_size: int) -> int:
        """Write the remembered answers to ``directory``/``FILE`` after those the file holds
        that this server does not (another server's on the same directory, checked as ``load``
        checks them; a file that fails a check is replaced), the newest ``capacity`` of them
        all. Replaces the file whole: a temporary file of this process, then a rename. Returns
        how many turns it holds; a failure is logged, not raised. With ``capacity`` 0 nothing
        is written (the file stays as other servers left it)."""
        if not self.capacity:
            return 0
        path = os.path.join(directory, FILE)
        theirs, their_calls = self._read(path, vocab_size) or ([], [])
        with self._lock:
            merged = _newest_last(theirs, self._turns.items())[-self.capacity :]
            calls = _newest_last(their_calls, self._calls.items())
        turns = [[k, list(t.prompt_ids), list(t.answer_ids), t.answer_text] for k, t in merged]
        calls = calls[-CALLS_PER_TURN * self.capacity :]
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"version": VERSION, "turns": turns, "calls": calls}, f)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("remembered answers not written to %s: %s", path, exc)
            return 0
        return len(turns)

    def load(self, directory: str, vocab_size: int) -> int:
        """Remember the answers ``save`` wrote to ``directory`` (the newest ``capacity``), whose
        ids must be below ``vocab_size``. Returns how many; a missing file is none, one that
        cannot be read or checked is logged and skipped whole."""
        if not self.capacity:
            return 0
        read = self._read(os.path.join(directory, FILE), vocab_size, warn=True)
        if read is None:
            return 0
        turns, calls = read
        with self._lock:
            for key, turn in turns[-self.capacity :]:
                self._turns[key] = turn
            for base, text in calls[-CALLS_PER_TURN * self.capacity :]:
                self._calls[base] = text
        return min(len(turns), self.capacity)

    @staticmethod
    def _read(
        path: str, vocab_size: int, warn: bool = False
    ) -> tuple[list[tuple[str, Turn]], list[tuple[str, str]]] | None:
        """The turns and tool-call texts ``save`` wrote to ``path``, every one checked; None
        when there is no such file or it fails a check (one log line with ``warn``)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}, not {VERSION}")
            turns = [_turn(entry, vocab_size) for entry in data["turns"]]
            calls = [(str(base), str(text)) for base, text in data["calls"]]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if warn:
                log.warning("remembered answers in %s skipped: %s", path, exc)
            return None
        return turns, calls

    def _longest(self, text: str) -> tuple[str | None, Turn | None]:
        """The remembered turn whose prompt + answer ``text`` starts with, the longest."""
        best: str | None = None
        with self._lock:
            for key in self._turns:
                longer = best is None or len(key) > len(best)
                if longer and len(key) < len(text) and text.startswith(key):
                    best = key
            if best is None:
                return None, None
            self._turns.move_to_end(best)
            return best, self._turns[best]


@dataclass(slots=True)
class Answer:
    """One choice's generated tokens and text, as its events reach the consumer; remembered
    in ``store`` if it finishes whole (EOS or length, no stop string cut its text)."""

    store: AnswerTokens
    prompt_text: str
    prompt_ids: Sequence[int]
    continues: str | None
    eos: frozenset[int]  # the model's end-of-sequence ids: not part of the answer's text
    call_base: str | None = None  # its tool calls' id base (``ToolCallSplitter``)
    ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def __call__(self, event: TokenEvent | FinishEvent) -> None:
        self.parts.append(event.text)
        if isinstance(event, TokenEvent):
            if event.token_id not in self.eos:
                self.ids.append(event.token_id)
            return
        whole = event.finish_reason in ("stop", "length") and event.stop_string is None
        if whole and self.ids:
            self.store.remember(self)


def _newest_last(older: Iterable[tuple[K, V]], newer: Iterable[tuple[K, V]]) -> list[tuple[K, V]]:
    """``older``'s entries then ``newer``'s, a key in both once, at its place in ``newer``."""
    out: OrderedDict[K, V] = OrderedDict(older)
    for key, value in newer:
        out.pop(key, None)
        out[key] = value
    return list(out.items())


def _turn(entry: Any, vocab_size: int) -> tuple[str, Turn]:
    """One saved turn ``[key, prompt ids, answer ids, answer text]``, checked (ids in the
    vocabulary, the key ending with the answer). Raises ValueError or TypeError otherwise."""
    key, prompt_ids, answer_ids, text = entry
    ids = [*prompt_ids, *answer_ids]
    if not (isinstance(key, str) and isinstance(text, str) and key.endswith(text)):
        raise ValueError("a turn's key is not its prompt and answer text")
    if not answer_ids or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
        raise ValueError("a turn's token ids are not ids")
    return key, Turn(tuple(prompt_ids), tuple(answer_ids), text)


def _base(call_id: str) -> str:
    """The answer part of a tool call's id as any API gave it (``call_``, ``toolu_`` ...)."""
    return call_id.rpartition("_")[2][:20]


def _same_text(decoded: str, text: str) -> bool:
    """Whether an answer's ids (``decoded``) are the text the client saw: the same, or the
    same but for the first token's leading space, which mlx_lm's streaming detokenizer drops
    (a byte-level BPE's " 909" as the answer's first token is sent as "909"). The model
    generated that space, so its tokens are still what it saw."""
    return decoded == text or (decoded[:1] == " " and decoded[1:] == text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """What ``apply_chat_template`` gives for its rendered ``text``: the text encoded with no
    special tokens added (the template writes its own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
