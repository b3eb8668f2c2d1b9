"""What the engine thread loads for the loop (``Parts``): the runner and scheduler over the model
and the pool, and the tokenizer's pieces the loop and the routes use. Made by the host
(``build_parts``), handed to ``EngineCore``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from veloxquant_mlx.engine.loop.disk_tier import DiskTier
from veloxquant_mlx.engine.loop.runner import Runner
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.request.detokenize import (
    Detokenizer,
    detokenizer_factory,
    token_bytes_table,
)
from veloxquant_mlx.engine.request.grammar import GrammarCompiler, grammar_tokenizer

if TYPE_CHECKING:
    from veloxquant_mlx.engine.model import loader


@dataclass(slots=True)
class Parts:
    """What the engine thread loaded, handed to the core."""

    runner: Runner
    scheduler: Scheduler
    new_detokenizer: Callable[[], Detokenizer]
    grammars: GrammarCompiler | None  # None: the tokenizer cannot be constrained
    vocab_size: int
    eos: frozenset[int]
    kv_bytes_per_block: int
    token_bytes: list[bytes] | None = None
    tokenizer: Any = None  # the host's, for the routes (the loop decodes through its parts)
    disk: DiskTier | None = None  # the prefix cache's disk tier (--prefix-cache-dir)


def build_parts(rt: loader.Runtime) -> Parts:
    """What the core needs besides the runner and scheduler, made from the loaded runtime."""
    token_bytes = token_bytes_table(rt.tokenizer)
    ll_tokenizer = grammar_tokenizer(rt.tokenizer, rt.vocab_size)
    return Parts(
        runner=rt.runner,
        scheduler=rt.scheduler,
        new_detokenizer=detokenizer_factory(rt.tokenizer, token_bytes),
        grammars=None if ll_tokenizer is None else GrammarCompiler(ll_tokenizer),
        vocab_size=rt.vocab_size,
        eos=frozenset(rt.tokenizer.eos_token_ids),
        kv_bytes_per_block=rt.kv_bytes_per_block,
        token_bytes=token_bytes,
        tokenizer=rt.tokenizer,
        disk=rt.disk,
    )
