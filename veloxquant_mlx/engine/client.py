"""What the server holds: the engine on a thread of the server's process (the default,
``hosts.thread.Engine``) or in a process of its own (``--engine-process``,
``hosts.process.EngineProcess``). Both are an ``EngineClient``; they differ only in how they
reach the engine loop."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.request.grammar import GrammarCompiler
from veloxquant_mlx.engine.request.handle import RequestHandle
from veloxquant_mlx.engine.types import (
    EngineInfo,
    EngineStats,
    EngineView,
    GenerationRequest,
    GroupInfo,
)


class EngineClient(Protocol):
    """The engine as the server sees it. Every method is safe from any thread; the blocking
    ones (``shrink``, ``reset_prefix_cache``, ``score``, ``view``, ``shutdown``) belong on a
    worker thread in async code.

    ``info`` is None until ``wait_ready`` returns; the properties below read it. ``tokenizer``,
    ``token_bytes`` and ``grammars`` are this process's own (the routes template, tokenize and
    compile grammars here). Health: ``alive`` (the engine runs), ``ready`` (loaded and
    admitting), ``draining`` (admitting no more).
    """

    info: EngineInfo | None
    tokenizer: Any
    token_bytes: list[bytes] | None
    grammars: GrammarCompiler | None

    @property
    def alive(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def model_name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context_window(self) -> int | None: ...
    @property
    def kv_bytes_per_block(self) -> int: ...
    @property
    def kv_layers(self) -> int: ...
    @property
    def blas(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def group_info(self) -> GroupInfo: ...

    def stalled_for(self) -> float: ...
    def wait_ready(self, timeout: float | None = None) -> None: ...
    def submit(self, request: GenerationRequest) -> RequestHandle: ...
    def cancel(self, handle: RequestHandle) -> None: ...
    def shrink(self, stream: str, target_free: int, timeout: float = 30.0) -> int: ...
    def reset_prefix_cache(self, timeout: float = 30.0) -> int: ...
    def score(
        self,
        prompt: tuple[int, ...],
        top: int,
        timeout: float = 300.0,
        cancelled: threading.Event | None = None,
    ) -> list[Any]: ...
    def stats(self) -> EngineStats: ...
    def view(self) -> EngineView: ...
    def shutdown(self, drain_timeout: float = 30.0) -> None: ...


def start_engine(
    config: EngineConfig,
    *,
    own_process: bool,
    log_format: str = "text",
    log_level: str = "info",
    switch_interval: float | None = None,
) -> EngineClient:
    """Start loading the engine (``wait_ready`` to wait for it): in a child process when
    ``own_process``, else on a thread of this one."""
    from veloxquant_mlx.engine.hosts.process import EngineProcess
    from veloxquant_mlx.engine.hosts.thread import Engine

    if own_process:
        return EngineProcess(
            config, log_format=log_format, log_level=log_level, switch_interval=switch_interval
        ).start()
    return Engine(config).start()
