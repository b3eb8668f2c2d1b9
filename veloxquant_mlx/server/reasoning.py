"""Reasoning output apart from the answer: the text a thinking model writes between its think
tags (``<think>`` ... ``</think>``: Qwen3, DeepSeek-R1 and the other formats mlx_lm's tokenizer
knows) comes back as ``reasoning_content`` (chat), a ``reasoning`` item (Responses) or a
``thinking`` block (Messages), and tool calls and structured outputs are read from the answer
after it, never across it.

The tags are the tokenizer's (``think_start`` / ``think_end``), or, for a model whose think tags
are not single tokens, ``<think>`` / ``</think>`` when its chat template writes both. A
template that opens the think block itself (its generation prompt ends with the start tag,
as DeepSeek-R1's does) makes the output start inside the reasoning. ``--reasoning off`` leaves
it all in the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_TAGS = ("<think>", "</think>")


def think_tags(tokenizer: Any) -> tuple[str, str] | None:
    """The model's think tags, or None for a model that does not think."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if start and end:
        return start, end
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    if isinstance(template, str) and all(tag in template for tag in DEFAULT_TAGS):
        return DEFAULT_TAGS
    return None


def effort_variables(effort: str | None) -> dict[str, Any]:
    """OpenAI's ``reasoning_effort`` (chat) or ``reasoning.effort`` (Responses) as the chat
    template variables models read: gpt-oss's ``reasoning_effort`` (low, medium, high), and
    for ``none`` the switch of Qwen3's (``enable_thinking``) and DeepSeek's (``thinking``)
    templates off. A template reads the names it knows and ignores the others."""
    if effort is None:
        return {}
    if effort == "none":
        return {"enable_thinking": False, "thinking": False}
    return {"reasoning_effort": "low" if effort == "minimal" else effort}


def starts_inside(prompt_text: str, tags: tuple[str, str]) -> bool:
    """Whether the rendered prompt leaves the output inside an open think block."""
    tail = prompt_text.rstrip()
    return tail.endswith(tags[0])


@dataclass(slots=True)
class ReasoningSplitter:
    """Splits streamed text into reasoning and answer. Owns the text held back: a possible
    start of the next tag. One think block: after it closes, everything is answer."""

    start: str
    end: str
    inside: bool = False
    done: bool = False  # the think block closed (or the answer began without one)
    _held: str = ""
    _trim: bool = False  # newlines right after the end tag are not part of the answer

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that ``text`` releases."""
        self._held += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._held:
            if self.done:
                if self._trim:
                    self._held = self._held.lstrip("\n")
                    self._trim = not self._held
                answer.append(self._held)
                self._held = ""
                break
            tag = self.end if self.inside else self.start
            at = self._held.find(tag)
            if at < 0:
                keep = _partial_suffix(self._held, tag)
                if not self.inside and not keep and self._held.strip():
                    self.done = True  # an answer with no think block first
                    continue
                (reasoning if self.inside else answer).append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            before, self._held = self._held[:at], self._held[at + len(tag) :]
            if self.inside:
                reasoning.append(before)
                self.inside, self.done, self._trim = False, True, True
            else:
                answer.append(before)
                self.inside = True
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is still held, as reasoning (inside the block) or answer."""
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def splitter_for(tokenizer: Any, prompt_text: str, enabled: bool) -> ReasoningSplitter | None:
    """A splitter for a request whose rendered prompt is ``prompt_text``, or None."""
    tags = think_tags(tokenizer) if enabled else None
    if tags is None:
        return None
    return ReasoningSplitter(*tags, inside=starts_inside(prompt_text, tags))


def think_then_split(
    reasoner: ReasoningSplitter | None,
    splitter: Any,
    text: str,
    final: bool,
    truncated: bool = False,
) -> tuple[str, str, list[Any]]:
    """(reasoning, content, tool calls) that ``text`` releases: the reasoning first, then the
    answer's content and calls (``tool_calls.split``: calls are read from the answer only)."""
    from veloxquant_mlx.server.tool_calls import split

    reasoning = ""
    if reasoner is not None:
        reasoning, text = reasoner.feed(text)
        if final:
            rest, more = reasoner.finish()
            reasoning, text = reasoning + rest, text + more
    content, calls = split(splitter, text, final, truncated)
    return reasoning, content, calls
