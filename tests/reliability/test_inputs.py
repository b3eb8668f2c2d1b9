"""Bad input at every field's edges, of every wrong type and encoding: a 400 (404 for an unknown
model) in OpenAI's shape naming the field, nothing leaked, the engine still serving, the pool
all free."""

from __future__ import annotations

import json

import pytest

from tests.reliability.conftest import ADMIN, MODEL, assert_error

VOCAB = "VOCAB"  # replaced by the served model's vocabulary size

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

# (field, value, param the error names). Both endpoints share the sampling fields.
SAMPLING_CASES = [
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", -1, "max_tokens"),
    ("max_tokens", 1.5, "max_tokens"),
    ("max_tokens", "4", "max_tokens"),
    ("max_tokens", True, "max_tokens"),
    ("max_tokens", 10**7, "max_tokens"),
    ("max_tokens", 900_000, "max_tokens"),  # schema-valid, over the context window
    ("temperature", -0.01, "temperature"),
    ("temperature", 2.01, "temperature"),
    ("temperature", "1", "temperature"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.01, "top_p"),
    ("top_k", -2, "top_k"),
    ("top_k", VOCAB, "top_k"),  # the engine-killer of the issue
    ("top_k", 100_001, "top_k"),
    ("top_k", 2.5, "top_k"),
    ("min_p", -0.1, "min_p"),
    ("min_p", 1.1, "min_p"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("repetition_penalty", 10.5, "repetition_penalty"),
    ("presence_penalty", -2.01, "presence_penalty"),
    ("presence_penalty", 2.01, "presence_penalty"),
    ("frequency_penalty", 2.5, "frequency_penalty"),
    ("logit_bias", {"²": 1}, "logit_bias"),  # isdigit() but not int()
    ("logit_bias", {"-1": 1}, "logit_bias"),
    ("logit_bias", {"1e3": 1}, "logit_bias"),
    ("logit_bias", {VOCAB: 1}, "logit_bias"),
    ("logit_bias", {"1": 100.5}, "logit_bias"),
    ("logit_bias", {"1": "x"}, "logit_bias"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias"),
    ("logit_bias", [1, 2], "logit_bias"),
    ("seed", -(2**63) - 1, "seed"),
    ("seed", 2**64, "seed"),
    ("seed", 1.5, "seed"),
    ("seed", "7", "seed"),
    ("n", 9, "n"),  # over --max-n (8)
    ("n", 129, "n"),
    ("n", 0, "n"),
    ("stream", "yes", "stream"),
    ("stream", 1, "stream"),
    ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage"),
    ("stream_options", "usage", "stream_options"),
    ("stop", [""], "stop"),
    ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("stop", 7, "stop"),
    ("stop", "\ud800", "stop"),
]

COMPLETION_CASES = [
    ("prompt", "", "prompt"),
    ("prompt", [], "prompt"),
    ("prompt", [-1], "prompt"),
    ("prompt", [VOCAB], "prompt"),
    ("prompt", [1, 2.5], "prompt"),
    ("prompt", "a\ud800b", "prompt"),  # a lone surrogate: a 500 before
    ("prompt", "\udfff", "prompt"),
    ("prompt", ["p"] * 9, "prompt"),  # over --max-n (8) prompts
    ("prompt", [[1]] * 129, "prompt"),
    ("prompt", ["one", 2], "prompt"),
    ("prompt", None, "prompt"),
    ("prompt", {"text": "x"}, "prompt"),
    ("prompt", 42, "prompt"),
    ("logprobs", 6, "logprobs"),
    ("logprobs", -1, "logprobs"),
    ("echo", "yes", "echo"),
    ("suffix", "tail", "suffix"),
    ("model", 7, "model"),
    ("model", "", "model"),
]

CHAT_CASES = [
    ("messages", [], "messages"),
    ("messages", "hello", "messages"),
    ("messages", [{"role": "robot", "content": "x"}], "messages.0.role"),
    ("messages", [{"role": "user", "content": 7}], "messages.0.content"),
    ("messages", [{"role": "user", "content": "a\ud800"}], "messages.0.content"),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], None),
    ("messages", [{"content": "no role"}], "messages.0.role"),
    ("max_completion_tokens", 0, "max_completion_tokens"),
    ("top_logprobs", 21, "top_logprobs"),
    ("top_logprobs", 3, "top_logprobs"),  # without logprobs: true
    ("logprobs", "yes", "logprobs"),
]


def _fill(value, vocab: int):
    if value == VOCAB:
        return vocab
    if isinstance(value, list):
        return [_fill(v, vocab) for v in value]
    if isinstance(value, dict):
        return {(str(vocab) if k == VOCAB else k): _fill(v, vocab) for k, v in value.items()}
    return value


def _vocab(app_client) -> int:
    return app_client.app.state.vq.engine.vocab_size


def _post(app_client, path: str, body: dict):
    # json.dumps writes a lone surrogate as the escape "\ud800", as a client's JSON would.
    return app_client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize(("field", "value", "param"), SAMPLING_CASES + COMPLETION_CASES)
def test_bad_completion_field_is_400_naming_it(app_client, pool_free, field, value, param):
    body = {**COMPLETION, field: _fill(value, _vocab(app_client))}
    assert_error(_post(app_client, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize(("field", "value", "param"), SAMPLING_CASES + CHAT_CASES)
def test_bad_chat_field_is_400_naming_it(app_client, pool_free, field, value, param):
    body = {**CHAT, field: _fill(value, _vocab(app_client))}
    assert_error(_post(app_client, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"{",
        b'{"model": "x", "prompt": "a", "max_tokens": NaN}',
        b'{"model": "x", "prompt": "a", "temperature": Infinity}',
        b'{"model": "x", "prompt": "a", "temperature": 1e999}',
        b"[1, 2, 3]",
        b'"just a string"',
        b"\xff\xfe\x00",
        b'{"model": "x", "prompt": "\\ud800"}',
        b"[" * 5000 + b"]" * 5000,
    ],
    ids=lambda raw: raw[:24].decode("latin-1"),
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies_are_400(app_client, pool_free, path, raw):
    r = app_client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(app_client, pool_free, path):
    body = {**(COMPLETION if "chat" not in path else CHAT), "model": "gpt-4o"}
    assert_error(_post(app_client, path, body), 404, code="model_not_found", param="model")


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", -1), ("top_k", 0), ("seed", -1), ("seed", -(2**63)), ("seed", 2**64 - 1),
     ("logit_bias", {"0": -100, "5": 100}), ("prompt", [0]), ("temperature", 2.0)],
)  # fmt: skip
def test_values_at_the_valid_edges_are_served(app_client, pool_free, field, value):
    r = _post(app_client, "/v1/completions", {**COMPLETION, "temperature": 1.0, field: value})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_top_k_just_below_the_vocabulary_is_served(app_client, pool_free):
    body = {**COMPLETION, "temperature": 1.0, "top_k": _vocab(app_client) - 1, "stream": True}
    r = _post(app_client, "/v1/completions", body)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


def test_engine_serves_after_the_whole_catalogue(app_client, pool_free):
    r = _post(app_client, "/v1/chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert app_client.get("/health").status_code == 200
    assert app_client.get("/ready").status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"stream": "x", "target_free": 1},
        {"stream": "kv", "target_free": -1},
        {"stream": "kv", "target_free": 1.5},
        {"stream": "kv", "target_free": "1"},
        {"stream": "kv"},
        {"stream": "kv", "target_free": 1, "extra": True},
        [],
    ],
)
def test_bad_shrink_requests_are_400(app_client, pool_free, body):
    r = app_client.post(
        "/admin/pool/shrink", json=body, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert_error(r, 400)
