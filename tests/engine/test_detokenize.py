"""Streaming detokenization: same text as mlx_lm in the end, released as soon as it decodes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

from tests.engine.conftest import wait_idle
from veloxquant_mlx.engine.request.detokenize import (
    ByteDetokenizer,
    SegmentDetokenizer,
    detokenizer_factory,
)
from veloxquant_mlx.engine.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


def stream(detok, ids: list[int]) -> tuple[list[str], str]:
    return [detok.add_token(t) for t in ids], detok.finalize()


def byte_token_ids(tokenizer, predicate) -> list[int]:
    """Ids whose whole text is one byte-level character standing for a byte that matches."""
    from veloxquant_mlx.engine.request.detokenize import gpt2_byte_decoder

    decoder = gpt2_byte_decoder()
    out = []
    for token, i in tokenizer.vocab.items():
        if len(token) == 1 and token in decoder and predicate(decoder[token]):
            out.append(i)
    return sorted(out)


def test_the_embedded_tokenizer_gets_the_byte_level_detokenizer(tokenizer):
    assert isinstance(detokenizer_factory(tokenizer)(), ByteDetokenizer)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_text_equals_mlx_lm_and_only_an_unfinished_character_is_held(tokenizer, data):
    # Ids biased towards the awkward ones: lone bytes >= 0x80 (continuations, lead bytes, bytes
    # that are never valid) and lone spaces, mixed with ordinary tokens.
    high = byte_token_ids(tokenizer, lambda b: b >= 0x80)
    space = byte_token_ids(tokenizer, lambda b: b == 0x20)
    ordinary = st.integers(1, len(tokenizer.vocab) - 1)
    ids = data.draw(
        st.lists(st.one_of(st.sampled_from(high), st.sampled_from(space), ordinary), max_size=40)
    )
    check_against_mlx_lm(tokenizer, ids)


def test_a_real_a_macron_is_text_in_both_from_its_two_byte_tokens(tokenizer):
    # "\u0100" (bytes C4 80) from two byte tokens, which Hypothesis drew once: its character
    # is also the NUL token's byte-level form, so mapping that character back broke this case.
    lead, cont = (byte_token_ids(tokenizer, lambda b, x=x: b == x)[0] for x in (0xC4, 0x80))
    check_against_mlx_lm(tokenizer, [lead, cont])


def check_against_mlx_lm(tokenizer, ids: list[int]) -> None:
    new = detokenizer_factory(tokenizer)
    detok = new()
    segments = []
    for i, token in enumerate(ids):
        segments.append(detok.add_token(token))
        # Whatever is released so far is final: it is the text of this prefix, minus at most
        # one unfinished character still held.
        assert detok.n_held_bytes() <= 3
        prefix = "".join(segments) + new().finalize()
        rest = new()
        whole = "".join(rest.add_token(t) for t in ids[: i + 1]) + rest.finalize()
        assert whole.startswith(prefix)
    text = "".join(segments) + detok.finalize()

    stock = tokenizer.detokenizer
    for token in ids:
        stock.add_token(token)
    stock.finalize()
    assert text == tokenizer.decode(ids).removeprefix(" ")
    # mlx_lm's BPE detokenizer keeps the NUL byte's token ("Ā" in byte-level form) as that
    # character (it tests the byte for truth); ours decodes it to "\x00" like tokenizer.decode.
    # A real "Ā" (bytes C4 80) is that character in both, so draws with the NUL token skip this.
    if tokenizer.vocab.get("\u0100") not in ids:
        assert text == stock.text


def test_the_nul_byte_token_decodes_to_nul_like_tokenizer_decode(tokenizer):
    (nul,) = byte_token_ids(tokenizer, lambda b: b == 0)
    segments, tail = stream(detokenizer_factory(tokenizer)(), [nul])
    assert "".join(segments) + tail == "\x00" == tokenizer.decode([nul])


def test_invalid_bytes_stream_at_once_where_mlx_lm_holds_them(tokenizer):
    (continuation,) = byte_token_ids(tokenizer, lambda b: b == 0x80)
    ours, tail = stream(detokenizer_factory(tokenizer)(), [continuation] * 10)
    assert ours == ["\ufffd"] * 10 and tail == ""

    stock = tokenizer.detokenizer
    released = []
    for _ in range(10):
        stock.add_token(continuation)
        released.append(stock.last_segment)
    assert released == [""] * 10  # mlx_lm: nothing until finalize


def test_a_multibyte_character_is_released_when_complete(tokenizer):
    ids = tokenizer.encode("é€😀 ok", add_special_tokens=False)
    segments, tail = stream(detokenizer_factory(tokenizer)(), ids)
    assert "".join(segments) + tail == "é€😀 ok"
    assert all("\ufffd" not in s for s in segments)


def test_the_first_leading_space_is_dropped_once(tokenizer):
    ids = tokenizer.encode("  two spaces", add_special_tokens=False)
    segments, tail = stream(detokenizer_factory(tokenizer)(), ids)
    assert "".join(segments) + tail == " two spaces"


def test_ids_outside_the_vocabulary_decode_to_nothing(tokenizer):
    detok = detokenizer_factory(tokenizer)()
    assert detok.add_token(10**6) == "" and detok.finalize() == ""


def test_other_tokenizers_keep_mlx_lms_detokenizer(tokenizer):
    inner = NaiveStreamingDetokenizer(tokenizer._tokenizer)
    ids = tokenizer.encode("hello there, world", add_special_tokens=False)
    segments, tail = stream(SegmentDetokenizer(inner), ids)
    assert "".join(segments) + tail == tokenizer.decode(ids)


def test_a_request_of_invalid_bytes_streams_token_by_token(make_engine, tokenizer):
    (continuation,) = byte_token_ids(tokenizer, lambda b: b == 0x80)
    engine = make_engine()
    sampling = SamplingParams(temperature=0.0, logit_bias=((continuation, 100.0),))
    prompt = tuple(tokenizer.encode("hello"))
    handle = engine.submit(GenerationRequest(prompt, 12, sampling))
    tokens, finish = handle.collect(60)
    assert [t.token_id for t in tokens] == [continuation] * 12
    assert [t.text for t in tokens] == ["\ufffd"] * 12
    assert finish.text == ""
    wait_idle(engine)
