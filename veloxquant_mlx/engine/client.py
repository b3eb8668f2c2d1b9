"""What the server holds: the engine on a thread of the server's process (the default) or in a
process of its own (``--engine-process``). Both facades answer the same calls."""

from __future__ import annotations

from veloxquant_mlx.engine.config import EngineConfig
from veloxquant_mlx.engine.hosts.process import EngineProcess
from veloxquant_mlx.engine.hosts.thread import Engine

EngineClient = Engine | EngineProcess


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
    if own_process:
        return EngineProcess(
            config, log_format=log_format, log_level=log_level, switch_interval=switch_interval
        ).start()
    return Engine(config).start()
