"""What the engine thread loads for the loop (``Parts``): the runner and scheduler over the model
and the pool, and the tokenizer's pieces the loop and the routes use. Made by the host
(``hosts.thread.build_parts``), handed to ``EngineCore``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from veloxquant_mlx.engine.loop.disk_tier import DiskTier
from veloxquant_mlx.engine.loop.runner import Runner
from veloxquant_mlx.engine.loop.scheduler import Scheduler
from veloxquant_mlx.engine.request.detokenize import Detokenizer
from veloxquant_mlx.engine.request.grammar import GrammarCompiler


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
