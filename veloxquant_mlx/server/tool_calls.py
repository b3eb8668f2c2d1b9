"""Tool calls out of the generated text, as it streams (mlx_lm's tool parsers read each call):
``ToolCallSplitter`` parts content from calls; ``splitter_for`` makes one for a request that
may call tools."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from veloxquant_mlx.server.schemas import ChatCompletionRequest, NamedToolChoice
from veloxquant_mlx.server.tools import template_tools


@dataclass(slots=True)
class ToolCallSplitter:
    """Splits generated text into content and tool calls, as it streams.

    Owns the text held back: a possible start of a tool-call tag, or a call not yet closed.
    ``feed`` returns the content that is certainly not part of a call and the calls that
    completed; ``finish`` flushes. A call cut off by max_tokens comes back as a call as far as
    it came (its name, and its arguments' JSON text so far), as OpenAI returns one with
    ``finish_reason: length``; a call the parser cannot read otherwise (a weak model's broken
    JSON) is given back as content, not dropped.
    """

    start: str
    end: str
    parser: Any
    tools: list[dict[str, Any]] | None
    forced: str | None = None  # the tool the request's tool_choice forces, if one
    # Its calls' ids are ``call_`` + this + a 4-digit hex index: a resent call names the
    # answer it came from (server.answers)
    call_base: str = field(default_factory=lambda: uuid.uuid4().hex[:20])
    _held: str = ""
    _in_call: bool = False
    n_calls: int = field(default=0)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                at = self._held.find(self.start)
                if at < 0:
                    keep = _partial_suffix(self._held, self.start)
                    content.append(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    break
                content.append(self._held[:at])
                self._held = self._held[at + len(self.start) :]
                self._in_call = True
            at = self._held.find(self.end)
            if at < 0:
                break
            raw, self._held = self._held[:at], self._held[at + len(self.end) :]
            self._in_call = False
            parsed = self._parse(raw)
            if parsed is None:
                content.append(self.start + raw + self.end)
            else:
                calls.extend(parsed)
        return "".join(content), calls

    def finish(self, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The rest: held text, and a call still open (``truncated``: cut by max_tokens)."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        self._in_call = False
        if truncated:  # cut inside the end tag: the call before it is whole
            held = held[: len(held) - _partial_suffix(held, self.end)]
        parsed = self._parse(held)  # unclosed: some formats omit the end tag
        if parsed is not None:
            return "", parsed
        cut = self._cut_call(held) if truncated else None
        return ("", [cut]) if cut is not None else (self.start + held, [])

    def _cut_call(self, raw: str) -> dict[str, Any] | None:
        """A JSON call (``{"name": ..., "arguments": ...}``) cut off: the forced tool's name, or
        as much of the name as was written; the arguments' text so far. None without a name."""
        written = re.search(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)', raw)
        name = self.forced or (written.group(1) if written else None)
        if not name:
            return None
        arguments = re.search(r'"arguments"\s*:\s*', raw)
        return self._call(name, raw[arguments.end() :] if arguments else "")

    def _call(self, name: str, arguments: Any) -> dict[str, Any]:
        call = {
            "index": self.n_calls,
            "id": f"call_{self.call_base}{self.n_calls:04x}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": arguments
                if isinstance(arguments, str)
                else json.dumps(arguments, ensure_ascii=False),
            },
        }
        self.n_calls += 1
        return call

    def _parse(self, raw: str) -> list[dict[str, Any]] | None:
        try:
            parsed = self.parser(raw, self.tools)
        except Exception:  # a call the model got wrong is text, not a server error
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
            return None
        return [self._call(i["name"], i.get("arguments", {})) for i in items]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(
    splitter: ToolCallSplitter | None, text: str, final: bool, truncated: bool = False
) -> tuple[str, list[Any]]:
    """``text`` (and, when ``final``, whatever was held) as content and completed calls;
    ``truncated``: the output was cut by max_tokens (an open call is a call, cut)."""
    if splitter is None:
        return text, []
    content, calls = splitter.feed(text)
    if final:
        rest, more = splitter.finish(truncated)
        content, calls = content + rest, calls + more
    return content, calls


def splitter_for(body: ChatCompletionRequest, tokenizer: Any) -> ToolCallSplitter | None:
    """A splitter when this request may produce tool calls, else None."""
    tools = template_tools(body, tokenizer)
    if tools is None:
        return None
    choice, named = body.tool_choice, None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
    elif choice == "required" and body.tools and len(body.tools) == 1:
        named = body.tools[0].function.name
    return ToolCallSplitter(
        tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools, named
    )
