"""A resent answer encoded with the tokens the model generated (``server.answers``), with the
embedded model's real tokenizer and chat template."""

from __future__ import annotations

from veloxquant_mlx.engine.types import FinishEvent, TokenEvent, Usage
from veloxquant_mlx.server.answers import AnswerTokens

SYSTEM = {"role": "system", "content": "You are terse."}


def render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def finish(reason: str = "length", stop: str | None = None) -> FinishEvent:
    return FinishEvent(reason, Usage(1, 1, 0, 0), 0.0, stop_string=stop)


def answer(store, tokenizer, text, ids, *, prompt=None, continues=None, end=None) -> str:
    """Run an answer of ``ids`` to ``text`` (encoded as ``prompt``) through a tap; the text
    the client saw."""
    prompt = prompt or tuple(tokenizer.encode(text, add_special_tokens=False))
    tap = store.tap(text, prompt, continues, {2})
    detok = tokenizer.detokenizer
    detok.reset()
    for token in ids:
        detok.add_token(token)
        tap(TokenEvent(token, detok.last_segment, 0.0))
    detok.finalize()
    tap(end or finish())
    return tap.text


def test_the_next_turn_reuses_the_answers_tokens_and_encodes_only_the_rest(default_model):
    _, tok = default_model
    store = AnswerTokens(4)
    first = [SYSTEM, {"role": "user", "content": "hi"}]
    prompt = render(tok, first)
    ids = [1026, 1026, 31, 809]  # " 909 909909": not what encoding its text gives back
    shown = answer(store, tok, prompt, ids)
    assert shown == "909 909909" and tok.encode(shown, add_special_tokens=False) != ids
    second = [*first, {"role": "assistant", "content": shown}, {"role": "user", "content": "ok"}]
    text = render(tok, second)
    tokens, continues = store.encode(tok, text)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert continues == prompt + shown
    assert tokens[: len(prompt_ids) + len(ids)] == [*prompt_ids, *ids]
    rest = tok.encode(text[len(prompt + shown) :], add_special_tokens=False)
    assert tokens[len(prompt_ids) + len(ids) :] == rest
    # the same text but for the space the streaming detokenizer dropped
    assert tok.decode(tokens) == text.replace(shown, " " + shown)

    # the third turn continues the second: the first turn's entry is superseded
    more = answer(store, tok, text, [1026, 1026], prompt=tokens, continues=continues)
    third = [*second, {"role": "assistant", "content": more}, {"role": "user", "content": "x"}]
    tokens3, key3 = store.encode(tok, render(tok, third))
    assert key3 == text + more and len(store) == 1
    assert tokens3[: len(tokens) + 2] == [*tokens, 1026, 1026]


def test_other_conversations_and_cut_answers_are_encoded_whole(default_model):
    _, tok = default_model
    store = AnswerTokens(2)
    prompt = render(tok, [SYSTEM, {"role": "user", "content": "hi"}])
    other = render(tok, [SYSTEM, {"role": "user", "content": "bye"}])
    answer(store, tok, prompt, [1026, 1026])
    tokens, continues = store.encode(tok, other)
    assert continues is None and tokens == tok.encode(other, add_special_tokens=False)

    # a stop string cut the text: not remembered; an error: not remembered
    cut = AnswerTokens(2)
    answer(cut, tok, prompt, [1026, 1026], end=finish("stop", stop="909"))
    answer(cut, tok, prompt, [1026], end=finish("error"))
    assert len(cut) == 0

    # a client that changed the answer's text does not match it; one whose text the ids do
    # not decode to (edited in place, same length) is checked and encoded whole
    shown = answer(store, tok, prompt, [1026, 1026])
    edited = shown.replace("9", "8")
    text = render(tok, [SYSTEM, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": edited},
                        {"role": "user", "content": "ok"}])  # fmt: skip
    assert store.encode(tok, text)[1] is None
    key = prompt + shown
    store._turns[key].answer_text = edited  # ids that do not decode to the text remembered
    store._turns[prompt + edited] = store._turns.pop(key)
    tokens, continues = store.encode(tok, text)
    assert continues is None and tokens == tok.encode(text, add_special_tokens=False)


def test_the_store_is_bounded_and_off_at_zero(default_model):
    _, tok = default_model
    store = AnswerTokens(2)
    for word in ("a", "b", "c"):
        answer(store, tok, render(tok, [{"role": "user", "content": word}]), [1026])
    assert len(store) == 2
    assert AnswerTokens(0).tap("x", (1,), None, {2}) is None


def test_resent_tool_calls_are_rendered_as_the_text_the_model_generated(default_model):
    _, tok = default_model
    store = AnswerTokens(4)
    prompt = render(tok, [{"role": "user", "content": "weather?"}])
    raw = '<tool_call>{"name": "w", "arguments": {"city":"Oslo"}}</tool_call>'
    ids = tok.encode(raw, add_special_tokens=False)
    tap = store.tap(prompt, tuple(tok.encode(prompt, add_special_tokens=False)), None, {2},
                    "0123456789abcdef0123")  # fmt: skip
    tap(TokenEvent(ids[0], raw, 0.0))
    for token in ids[1:]:
        tap(TokenEvent(token, "", 0.0))
    tap(finish("stop"))
    call = {"id": "call_0123456789abcdef01230000", "type": "function",
            "function": {"name": "w", "arguments": {"city": "Oslo"}}}  # fmt: skip
    sent = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "3"}]  # fmt: skip
    generated = store.as_generated(sent)
    assert generated is not None and generated[1] == {"role": "assistant", "content": raw}
    assert generated[0] is sent[0] and sent[1]["tool_calls"] == [call]  # the input untouched
    # the Messages API's id for the same call (toolu_...) names the same answer
    toolu = {**sent[1], "tool_calls": [{**call, "id": "toolu_0123456789abcdef01230000"}]}
    assert store.as_generated([sent[0], toolu]) is not None
    # calls of another answer, or of two answers in one message: as sent
    other = {**call, "id": "call_ffffffffffffffffffff0000"}
    assert store.as_generated([sent[0], {**sent[1], "tool_calls": [other]}]) is None
    assert store.as_generated([sent[0], {**sent[1], "tool_calls": [call, other]}]) is None
    tokens, continues = store.encode(tok, render(tok, generated))
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert continues == prompt + raw and tokens[: len(prompt_ids) + len(ids)] == prompt_ids + ids


def test_a_tool_loop_keeps_hitting_through_every_earlier_call(default_model):
    """Turn after turn of tool calls: each prompt renders every earlier call as generated, so
    each continues the previous turn (an earlier call rendered by the template would break the
    match from that call on)."""
    _, tok = default_model
    store = AnswerTokens(4)
    sent = [{"role": "user", "content": "weather?"}]
    prompt, continues, prompt_ids = render(tok, sent), None, None
    for turn in range(3):
        if turn:
            generated = store.as_generated(sent)
            assert generated is not None
            assert all(m.get("tool_calls") is None for m in generated)  # every call as text
            prompt = render(tok, generated)
            prompt_ids, continues = store.encode(tok, prompt)
            assert continues is not None, turn
        raw = f'<tool_call>{{"name": "w", "arguments": {{"n":{turn}}}}}</tool_call>'
        base = f"{turn:020x}"
        tap = store.tap(prompt, prompt_ids or tok.encode(prompt, add_special_tokens=False),
                        continues, {2}, base)  # fmt: skip
        ids = tok.encode(raw, add_special_tokens=False)
        for i, token in enumerate(ids):
            tap(TokenEvent(token, raw if i == 0 else "", 0.0))
        tap(finish("stop"))
        call = {"id": f"call_{base}0000", "type": "function",
                "function": {"name": "w", "arguments": {"n": turn}}}  # fmt: skip
        sent += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": str(turn)}]  # fmt: skip
    assert len(store) == 1  # one conversation, one turn remembered


def test_saved_answers_are_read_back_and_a_bad_file_is_skipped_in_one_line(
    default_model, tmp_path, caplog
):
    import json
    import logging

    from veloxquant_mlx.server.answers import FILE

    _, tok = default_model
    store = AnswerTokens(4)
    prompt = render(tok, [SYSTEM, {"role": "user", "content": "hi"}])
    shown = answer(store, tok, prompt, [1026, 1026, 31, 809])
    assert store.save(str(tmp_path), 2048) == 1 and (tmp_path / FILE).exists()
    assert not list(tmp_path.glob("*.tmp"))

    again = AnswerTokens(4)
    assert again.load(str(tmp_path), vocab_size=2048) == 1
    text = render(tok, [SYSTEM, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": shown},
                        {"role": "user", "content": "ok"}])  # fmt: skip
    assert again.encode(tok, text) == store.encode(tok, text)
    assert again.encode(tok, text)[1] == prompt + shown
    assert AnswerTokens(4).load(str(tmp_path / "none"), 2048) == 0  # no file: none, silently
    assert AnswerTokens(0).load(str(tmp_path), 2048) == 0  # off

    good = json.loads((tmp_path / FILE).read_text())
    bad_files = {
        "not json": "{",
        "another version": json.dumps({**good, "version": 99}),
        "an id past the vocabulary": json.dumps(
            {**good, "turns": [[*good["turns"][0][:2], [5000], good["turns"][0][3]]]}
        ),
        "a key that is not the answer's": json.dumps(
            {**good, "turns": [[*good["turns"][0][:3], "other text"]]}
        ),
        "a turn of the wrong shape": json.dumps({**good, "turns": [[1, 2]]}),
    }
    for what, content in bad_files.items():
        (tmp_path / FILE).write_text(content)
        caplog.clear()
        store = AnswerTokens(4)
        with caplog.at_level(logging.WARNING, logger="veloxquant.server"):
            assert store.load(str(tmp_path), 2048) == 0, what
        assert len(store) == 0, what
        [record] = caplog.records
        assert "remembered answers" in record.getMessage() and "skipped" in record.getMessage()


def test_load_keeps_the_newest_up_to_capacity(default_model, tmp_path):
    _, tok = default_model
    store = AnswerTokens(8)
    for word in "abcde":
        answer(store, tok, render(tok, [{"role": "user", "content": word}]), [1026])
    store.save(str(tmp_path), 2048)
    small = AnswerTokens(2)
    assert small.load(str(tmp_path), 2048) == 2
    kept = list(small._turns)
    assert [k for k in store._turns][-2:] == kept


def test_servers_sharing_a_directory_merge_their_answers_newest_last(default_model, tmp_path):
    import json

    from veloxquant_mlx.server.answers import FILE

    _, tok = default_model
    one, two = AnswerTokens(3), AnswerTokens(3)
    for word in "ab":
        answer(one, tok, render(tok, [{"role": "user", "content": word}]), [1026])
    for word in "cd":
        answer(two, tok, render(tok, [{"role": "user", "content": word}]), [31])
    assert one.save(str(tmp_path), 2048) == 2
    assert two.save(str(tmp_path), 2048) == 3  # one's two, then its own two: the newest 3
    both = AnswerTokens(3)
    assert both.load(str(tmp_path), 2048) == 3
    assert list(both._turns) == [*list(one._turns)[1:], *two._turns]
    # A turn both hold is written once, where the writer has it (its newest place).
    assert one.save(str(tmp_path), 2048) == 3
    keys = [t[0] for t in json.loads((tmp_path / FILE).read_text())["turns"]]
    assert len(keys) == len(set(keys)) == 3 and keys[-2:] == list(one._turns)
    # A file another writer left broken is replaced, not merged.
    (tmp_path / FILE).write_text("{")
    assert two.save(str(tmp_path), 2048) == 2
    assert not list(tmp_path.glob("*.tmp"))
    assert AnswerTokens(0).save(str(tmp_path), 2048) == 0  # off: another's file is left alone
    assert len(json.loads((tmp_path / FILE).read_text())["turns"]) == 2
