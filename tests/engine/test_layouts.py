"""Both batch KV layouts give stock mlx_lm's greedy tokens, for every attention kind we serve.

For llama, qwen3 (q/k norms) and a llama whose layers alternate sliding-window (window 8) and
full attention, each layout's engine serves prompts of different lengths with different
``max_tokens`` at once, with fewer running slots than requests (so rows join and leave, holes
open and fill) and a small prefill chunk (so long prompts prefill in chunks between decode
steps, short ones together). Every request's tokens must equal ``mlx_lm.generate_step`` alone
with stock caches (``KVCache``, ``RotatingKVCache`` for the sliding layers).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tests.conftest import assert_engine_all_free
from tests.engine.conftest import wait_idle
from veloxquant_mlx.engine.hosts.thread import Engine, EngineConfig
from veloxquant_mlx.engine.model.default_model import ASSETS, CONFIG, TOKENIZER_FILES
from veloxquant_mlx.engine.types import FinishEvent, GenerationRequest, SamplingParams

ARCHS = {
    "llama": {},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "llama_sliding": {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 8,
    },
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_model(request, tmp_path_factory) -> tuple[Path, object]:
    import mlx_lm
    from mlx_lm.utils import _get_classes

    config = {**CONFIG, **ARCHS[request.param]}
    model_class, args_class = _get_classes(config)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    target = tmp_path_factory.mktemp(request.param)
    mx.save_safetensors(
        str(target / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (target / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, target / name)
    loaded, _ = mlx_lm.load(str(target))
    return target, loaded


def stock_tokens(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
    return out


def serve_greedy(path: Path, prompts: list[list[int]], lengths: list[int], **config) -> list:
    """Every prompt through one engine of ``config`` at once (3 running slots, 16-token prefill
    chunks, so rows join and leave): each request's greedy tokens; the pool all free after."""
    engine = Engine(
        EngineConfig(model=str(path), kv_cache_mb=16, max_running=3, prefill_step=16, **config)
    ).start()
    try:
        engine.wait_ready(120)
        greedy = SamplingParams(temperature=0.0)
        handles = [
            engine.submit(GenerationRequest(tuple(p), n, greedy))
            for p, n in zip(prompts, lengths, strict=True)
        ]
        ours = []
        for h in handles:
            tokens, finish = h.collect(120)
            assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
            ours.append([t.token_id for t in tokens])
        wait_idle(engine)
        assert engine.stats().kv_layout == config["kv_layout"]
        compiled = engine._core.runner.compiled  # the CPU's default: it traced this model
        if config["kv_layout"] == "dense" and compiled is not None:
            assert compiled.failed is None and compiled.traces > 0, compiled.failed
        assert_engine_all_free(engine)
    finally:
        engine.shutdown(5)
    return ours


@pytest.mark.parametrize(
    ("layout", "attention"),
    [("dense", "sdpa"), ("paged", "sdpa"), ("dense", "matmul"), ("paged", "matmul")],
)
def test_greedy_tokens_match_stock_caches_with_rows_joining_and_leaving(
    arch_model, layout, attention, monkeypatch
):
    """``attention``: how ragged steps attend (kv/attention.py); the matmul path must have
    been taken, by as many calls as the ragged steps' layers. The rest of the engine's
    attention, prefill chunks and uniform steps, takes the CPU's exp2 softmax (auto)."""
    from veloxquant_mlx.kv import attention as attention_module

    calls = []
    exp2_queries = set()
    real = attention_module.matmul_attention
    real_exp2 = attention_module.grouped_attention

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    def counted_exp2(*args):
        exp2_queries.add(args[0].shape[2])
        return real_exp2(*args)

    monkeypatch.setattr(attention_module, "matmul_attention", counted)
    monkeypatch.setattr(attention_module, "grouped_attention", counted_exp2)
    path, model = arch_model
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 23, 9, 41, 3, 17, 30, 12)]
    lengths = [12, 5, 20, 9, 16, 3, 11, 7]
    ours = serve_greedy(path, prompts, lengths, kv_layout=layout, ragged_attention=attention)
    for p, n, got in zip(prompts, lengths, ours, strict=True):
        assert got == stock_tokens(model, p, n)
    if attention == "matmul":
        assert calls and max(calls) > 1, "ragged multi-row steps went through matmul_attention"
    else:
        assert not calls
    if mx.default_device() != mx.gpu:  # prefill (several queries) and decode (one)
        assert 1 in exp2_queries and max(exp2_queries) > 1


def test_prefill_by_matmul_with_mlx_softmax_matches_stock_caches(arch_model, monkeypatch):
    """``--prefill-attention matmul --attention-softmax exp`` (CUDA's auto): prefill chunks
    attend by ``grouped_attention`` with MLX's ``exp``, decode steps by MLX's own."""
    from veloxquant_mlx.kv import attention as attention_module

    routes = set()
    real = attention_module.grouped_attention

    def counted(*args):
        routes.add((args[0].shape[2] > 1, args[5]))
        return real(*args)

    monkeypatch.setattr(attention_module, "grouped_attention", counted)
    path, model = arch_model
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 40, 23, 9)]
    lengths = [9, 6, 12, 4]
    ours = serve_greedy(
        path, prompts, lengths, kv_layout="dense", attention_softmax="exp",
        prefill_attention="matmul",
    )  # fmt: skip
    for p, n, got in zip(prompts, lengths, ours, strict=True):
        assert got == stock_tokens(model, p, n)
    assert routes == {(True, False)}  # prefill only, MLX's exp


def test_prefill_by_buckets_matches_stock_caches(arch_model, monkeypatch):
    """``--prefill-attention buckets``: prefill chunks of several queries attend by MLX's
    attention over their queries and keys padded to buckets (``bucketed_attention``); the
    tokens are stock's on every architecture."""
    from veloxquant_mlx.kv import attention as attention_module

    shapes = set()
    real = attention_module.bucketed_attention

    def counted(*args):
        shapes.add((args[0].shape[2], args[1].shape[2]))
        return real(*args)

    monkeypatch.setattr(attention_module, "bucketed_attention", counted)
    path, model = arch_model
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 40, 23, 9)]
    lengths = [9, 6, 12, 4]
    ours = serve_greedy(path, prompts, lengths, kv_layout="dense", prefill_attention="buckets")
    for p, n, got in zip(prompts, lengths, ours, strict=True):
        assert got == stock_tokens(model, p, n)
    # chunks of 16 over what the prompt's earlier chunks left (40 tokens: 16, 32, then 40)
    assert any(keys > queries > 1 for queries, keys in shapes), shapes


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_padded_prefill_widths_match_stock_caches(arch_model, layout, monkeypatch):
    """``--prefill-bucket`` (CUDA's default 64): each chunk, and prompts prefilled together,
    padded at the end (left for the together ones) to a multiple of 16 here; the prompt never
    sees the padding and the caches drop it, so the tokens are stock's, and the model only
    ever sees widths of that multiple."""
    widths = set()
    from mlx_lm.models import cache as cache_module

    original = cache_module.KVCache.update_and_fetch

    def seen(self, keys, values):
        widths.add(keys.shape[2])
        return original(self, keys, values)

    monkeypatch.setattr(cache_module.KVCache, "update_and_fetch", seen)
    path, model = arch_model
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 23, 9, 41, 3, 17)]
    lengths = [7, 5, 9, 6, 8, 4]
    ours = serve_greedy(path, prompts, lengths, kv_layout=layout, prefill_bucket=16)
    monkeypatch.setattr(cache_module.KVCache, "update_and_fetch", original)
    for p, n, got in zip(prompts, lengths, ours, strict=True):
        assert got == stock_tokens(model, p, n)
    widths.discard(1)  # the loader's one-token probe of the model's geometry (sizing.py)
    assert widths and all(w % 16 == 0 for w in widths), widths


def test_a_padded_prefill_caches_only_the_prompt(arch_model):
    """The pages a padded prefill leaves in the prefix cache hold the prompt's KV alone: the
    same prompt again hits them and gives stock's tokens."""
    path, model = arch_model
    prompt = tuple(random.Random(8).randrange(3, 2000) for _ in range(41))
    config = EngineConfig(
        model=str(path), kv_cache_mb=16, prefill_step=16, prefill_bucket=16, kv_layout="dense"
    )
    engine = Engine(config).start()
    try:
        engine.wait_ready(120)
        greedy = SamplingParams(temperature=0.0)
        for cached in (0, 32):
            tokens, finish = engine.submit(GenerationRequest(prompt, 6, greedy)).collect(120)
            assert [t.token_id for t in tokens] == stock_tokens(model, list(prompt), 6)
            assert finish.usage.cached_tokens == cached
        wait_idle(engine)
        assert_engine_all_free(engine)
    finally:
        engine.shutdown(5)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_rows_at_one_position_match_stock_caches(arch_model, layout):
    """One stream alone, and rows that joined together (every row at the same position): the
    step then runs without a mask where every row sees all its positions, and writes the new
    tokens with one slice update (dense). Prompts longer than the sliding window keep their
    mask."""
    path, model = arch_model
    rng = random.Random(5)
    engine = Engine(EngineConfig(model=str(path), kv_layout=layout, kv_cache_mb=16)).start()
    try:
        engine.wait_ready(120)
        greedy = SamplingParams(temperature=0.0)
        for group in ([30], [11, 11, 11]):
            prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in group]
            handles = [engine.submit(GenerationRequest(tuple(p), 14, greedy)) for p in prompts]
            for p, h in zip(prompts, handles, strict=True):
                tokens, finish = h.collect(120)
                assert isinstance(finish, FinishEvent)
                assert [t.token_id for t in tokens] == stock_tokens(model, p, 14)
            wait_idle(engine)
        assert_engine_all_free(engine)
    finally:
        engine.shutdown(5)


def test_a_step_batch_masks_only_what_some_row_must_not_see():
    from veloxquant_mlx.kv.step import StepBatch

    level = StepBatch([6, 6])
    assert level.uniform and level.mask(None) is None and level.mask(8) is None
    assert level.mask(None, return_array=True).tolist() == [[[[True] * 7]]] * 2
    assert level.mask(4).shape == (2, 1, 1, 7)  # the window hides the first positions
    ragged = StepBatch([6, 2])
    assert not ragged.uniform
    assert ragged.mask(None)[1, 0, 0].tolist() == [True] * 3 + [False] * 4


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_conversations_next_turn_hits_and_matches_stock_caches(arch_model, layout):
    """Prefix caching for every attention kind (sliding-window layers included: a page holds
    its positions' KV whatever window reads it): turn 2 resends turn 1's prompt and answer,
    finds them cached, and decodes stock's tokens for the whole conversation."""
    path, model = arch_model
    rng = random.Random(9)
    engine = Engine(EngineConfig(model=str(path), kv_layout=layout, kv_cache_mb=16)).start()
    try:
        engine.wait_ready(120)
        greedy = SamplingParams(temperature=0.0)
        prompt = [rng.randrange(3, 2000) for _ in range(37)]
        for turn in range(3):
            tokens, finish = engine.submit(GenerationRequest(tuple(prompt), 12, greedy)).collect(
                120
            )
            assert isinstance(finish, FinishEvent)
            answer = [t.token_id for t in tokens]
            assert answer == stock_tokens(model, prompt, 12)
            if turn:  # the previous prompt and answer, in full pages
                assert finish.usage.cached_tokens == (len(prompt) - 5) // 16 * 16
            prompt = prompt + answer + [rng.randrange(3, 2000) for _ in range(5)]
        wait_idle(engine)
        assert_engine_all_free(engine)
    finally:
        engine.shutdown(5)
