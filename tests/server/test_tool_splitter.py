"""The streaming split of generated text into content and tool calls, however it is chunked."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.tool_parsers.json_tools import parse_tool_call

from veloxquant_mlx.server.tool_calls import ToolCallSplitter

START, END = "<tool_call>", "</tool_call>"


def split_all(text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    splitter = ToolCallSplitter(START, END, parse_tool_call, None)
    content, calls, last = [], [], 0
    for cut in [*sorted(c % (len(text) + 1) for c in cuts), len(text)]:
        piece, last = text[last:cut], max(last, cut)
        c, k = splitter.feed(piece)
        content.append(c)
        calls += k
    c, k = splitter.finish()
    return "".join(content) + c, calls + k


@given(
    before=st.text(max_size=20),
    after=st.text(max_size=20),
    names=st.lists(st.sampled_from(["f", "get_weather", "x.y"]), min_size=0, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_calls_are_found_and_content_kept_however_the_text_is_chunked(before, after, names, cuts):
    if START in before + after or "<" in before + after:
        before, after = before.replace("<", ""), after.replace("<", "")
    calls_text = "".join(
        f'{START}{{"name": "{n}", "arguments": {{"i": {i}}}}}{END}' for i, n in enumerate(names)
    )
    content, calls = split_all(before + calls_text + after, cuts)
    assert content == before + after
    assert [c["function"]["name"] for c in calls] == names
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"i": i} for i in range(len(names))
    ]
    assert [c["index"] for c in calls] == list(range(len(names)))


def test_a_broken_call_is_given_back_as_text():
    content, calls = split_all(f"hi {START}{{not json{END} bye", [5, 9])
    assert calls == [] and content == f"hi {START}{{not json{END} bye"


def test_an_unclosed_call_is_parsed_at_the_end_or_kept_as_text():
    content, calls = split_all(f'{START}{{"name": "f", "arguments": {{}}}}', [3])
    assert content == "" and calls[0]["function"]["name"] == "f"
    content, calls = split_all(f"{START}{{cut off", [])
    assert calls == [] and content == f"{START}{{cut off"


def test_a_partial_tag_at_a_chunk_end_is_held_not_lost():
    splitter = ToolCallSplitter(START, END, parse_tool_call, None)
    assert splitter.feed("abc<tool_") == ("abc", [])
    assert splitter.feed("x") == ("<tool_x", [])


def test_closed_schemas_add_additional_properties_false_only_where_silent():
    from veloxquant_mlx.server.structured import closed

    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "items": {"type": "array", "items": {"properties": {"y": {}}}},
            "fixed": {"const": {"properties": {"z": 1}}},
        },
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["properties"]["fixed"] == {"const": {"properties": {"z": 1}}}  # a value, untouched
    assert "additionalProperties" not in schema  # the input is not changed


def test_a_call_cut_by_max_tokens_is_a_call_as_far_as_it_came():
    for text, forced, name, arguments in [
        ('{"name": "get_weathe', None, "get_weathe", ""),
        ('{"name": "get_weathe', "get_weather", "get_weather", ""),
        ('{"name": "get_weather", "arguments": {"city": "Pa', None, "get_weather", '{"city": "Pa'),
        # cut inside the end tag: the call is whole, and none of the tag is in its arguments
        ('{"name": "f", "arguments": {"a":1}}' + END[:-3], None, "f", '{"a": 1}'),
    ]:
        splitter = ToolCallSplitter(START, END, parse_tool_call, None, forced)
        content, calls = splitter.feed("Sure. " + START + text)
        rest, more = splitter.finish(truncated=True)
        assert (content + rest, calls) == ("Sure. ", [])
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in more] == [
            (name, arguments)
        ]
    # Not cut by max_tokens (a broken call), or no name to give: the text comes back as text.
    broken = ToolCallSplitter(START, END, parse_tool_call, None)
    broken.feed(START + '{"name": "f", "arguments": {')
    assert broken.finish(truncated=False) == (START + '{"name": "f", "arguments": {', [])
    nameless = ToolCallSplitter(START, END, parse_tool_call, None)
    nameless.feed(START + '{"na')
    assert nameless.finish(truncated=True) == (START + '{"na', [])
