"""The fields and errors real clients read, through the official openai SDK and raw HTTP on a
real server: usage details, fingerprints, request ids, model lookup, messages that name the
real problem, OpenAI's context-overflow wording, raw logprob bytes."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.usefixtures("pool_free_after")


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_usage_details_and_fingerprint(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.system_fingerprint == r.system_fingerprint for c in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_models_have_a_real_created_time_and_can_be_looked_up(oai):
    [card] = oai.models.list().data
    assert card.id == MODEL and 1_700_000_000 < card.created <= time.time()
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"


def test_an_omitted_model_means_the_served_one(server):
    r = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_request_ids_are_echoed_or_made(server):
    r = httpx.get(f"{server.base_url}/v1/models", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(f"{server.base_url}/v1/models", headers={"x-request-id": "a space " + "x" * 200})
    assert r.headers["x-request-id"].startswith("req-")
    r = httpx.get(f"{server.base_url}/nowhere")
    assert r.status_code == 404 and r.headers["x-request-id"].startswith("req-")
    assert r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"temperature": "0.5"}, "temperature", "valid number"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "only text content parts are supported",
        ),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions",
         "deprecated function calling) is not supported: send tools"),
        ({"function_call": {"name": "f"}}, "function_call", "send tools and tool_choice"),
        ({"modalities": ["text", "audio"]}, "modalities", "only text output is supported"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output is not supported"),
    ],
)  # fmt: skip
def test_messages_name_the_real_problem(oai, extra, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**body)
    err = info.value.body
    assert err["param"] == param and words in err["message"], err


def test_legacy_function_fields_that_ask_for_nothing_pass(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        functions=[], function_call="none", modalities=["text"],
    )  # fmt: skip
    assert r.choices[0].message.content is not None


def test_context_overflow_is_worded_as_openai_does(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hello", max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"
    assert "This model's maximum context length is 8192 tokens. However, you requested" in str(
        info.value
    )


def test_logprob_bytes_are_the_tokens_own_bytes(oai, default_model):
    _, tokenizer = default_model
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "bytes"}], max_tokens=40,
        logprobs=True, top_logprobs=2, temperature=0,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    raw = b"".join(bytes(entry.bytes) for entry in content)
    ids = tokenizer.encode(r.choices[0].message.content, add_special_tokens=False)
    # The text is the tokens' raw bytes decoded (the first token's leading space is trimmed).
    text = raw.decode("utf-8", errors="replace")
    assert text.removeprefix(" ") == r.choices[0].message.content.removeprefix(" ")
    assert len(content) == 40 and ids


def test_a_partial_character_token_reports_its_raw_bytes_not_the_replacement(oai, default_model):
    from veloxquant_mlx.engine.request.detokenize import token_bytes_table

    _, tokenizer = default_model
    table = token_bytes_table(tokenizer)
    assert table is not None
    token = next(i for i, b in enumerate(table) if len(b) == 1 and b[0] >= 0xC0)  # a lead byte
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, temperature=0,
        logprobs=True, logit_bias={str(token): 100},
    )  # fmt: skip
    [entry] = r.choices[0].logprobs.content
    assert bytes(entry.bytes) == table[token] and entry.bytes != list("\ufffd".encode())


def test_n_choices_and_prompt_lists(oai):
    r = oai.completions.create(model=MODEL, prompt="hi", max_tokens=5, n=3, temperature=1.0,
                               seed=5)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # each choice draws on its own
    assert r.usage.completion_tokens == 15
    one = oai.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    batch = oai.completions.create(model=MODEL, prompt=["hi", "hello there"], max_tokens=4,
                                   temperature=0)  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text[: len(batch.choices[0].text)]
    both = oai.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=2, n=2)
    assert len(both.choices) == 4
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, n=2, temperature=1.0)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]


def test_streamed_choices_are_each_complete(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6, n=3,
        temperature=1.0, stream=True, stream_options={"include_usage": True},
        logit_bias={"2": -100},  # no sampled EOS: each choice runs to its length
    )  # fmt: skip
    chunks = list(stream)
    texts: dict[int, str] = {}
    finished = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 18
    plain = oai.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, stream=True,
                                   temperature=0)  # fmt: skip
    ends = [c.choices[0].index for c in plain if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1]


def test_echo_with_prompt_logprobs_and_no_generation_scores_the_prompt(oai, default_model):
    """lm-eval-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    import mlx.core as mx

    model, tokenizer = default_model
    prompt = "the pool holds the cache"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    ids = tokenizer.encode(prompt)
    assert choice.text == tokenizer.decode(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-3
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # echo with generation: the prompt's scores, then the completion's
    both = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                  logprobs=0, temperature=0)  # fmt: skip
    assert both.choices[0].text.startswith(choice.text)
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 3
    assert both.choices[0].logprobs.text_offset[len(ids)] == len(choice.text)


def test_max_tokens_zero_needs_echo(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "echo" in info.value.body["message"]
