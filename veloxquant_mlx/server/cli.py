"""``veloxquant-serve`` / ``python -m veloxquant_mlx.server``: settings, BLAS, logging, uvicorn."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from veloxquant_mlx.blas import ensure_blas
from veloxquant_mlx.config import mlx_env
from veloxquant_mlx.config.launch import launched_rank, share_cpu_threads
from veloxquant_mlx.config.settings import SettingsError, load_settings
from veloxquant_mlx.logs import setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(exc.code, file=sys.stderr)
        return 2
    threads = share_cpu_threads()  # before the BLAS loads (ensure_blas may re-execute)
    try:
        blas = ensure_blas(
            settings.blas, gemv=settings.blas_gemv
        )  # may re-execute this process with a BLAS preloaded
    except ValueError as exc:
        print(f"veloxquant-serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_format, settings.log_level)
    log = logging.getLogger("veloxquant.server")
    log.info("BLAS: %s", blas)
    if threads is not None:
        log.info("BLAS threads per rank: %d (ranks share this host's cores)", threads)
    # before MLX's backend is first used (the engine's load), inherited by its process
    applied = mlx_env.apply({name: getattr(settings, name) for name in mlx_env.VARIABLES})
    if applied:
        log.info("MLX: %s", ", ".join(f"{k}={v}" for k, v in applied.items()))

    rank = launched_rank()
    if rank is not None and rank > 0:  # a follower of an mx.distributed group: no HTTP
        from veloxquant_mlx.engine.hosts.follower import run_follower
        from veloxquant_mlx.server.app import engine_config

        return run_follower(engine_config(settings))
    settings, generated = settings.with_admin_key()
    if generated:  # once, in the log's own format (a JSON line under --log-format json)
        log.warning("no admin key set; generated one for this run: %s", settings.admin_key)

    if settings.gil_switch_interval_ms is not None:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)

    import uvicorn

    from veloxquant_mlx.server.app import create_app, start_engine_for
    from veloxquant_mlx.server.edge import EdgeLimits, protocol_class

    exit_code = 0

    def engine_failed() -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    # The engine is loaded before the port is bound (uvicorn binds after the app's startup in
    # any case): a model or pool that cannot serve stops here with one line and exit code 3.
    engine = start_engine_for(settings)
    try:
        engine.wait_ready()  # in a group: exits 1 if the ranks do not join (group.init_group)
    except Exception as exc:
        engine.shutdown(0)
        print(f"veloxquant-serve: cannot start: {exc}", file=sys.stderr)
        return 3
    app = create_app(settings, engine=engine, on_engine_failure=engine_failed)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: keep listening, answer new requests 503 (with Retry-After), fail
        the queued ones the same way, let running requests finish within --drain-timeout, then
        stop. A second signal stops at once."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(app.state, "vq", None)
            if state is None or state.draining:  # not serving yet, or the second signal
                self.should_exit = True
                if sig == signal.SIGINT and state is not None:
                    self.force_exit = True
                return
            state.draining = True
            log.info("draining: up to %.0fs for running requests", settings.drain_timeout)

            def drain() -> None:
                if state.registration is not None:  # the router stops sending first
                    state.registration.deregister()
                state.engine.shutdown(settings.drain_timeout)
                log.info("drained; stopping")
                self.should_exit = True  # uvicorn's main loop polls it

            threading.Thread(target=drain, name="veloxquant-drain", daemon=True).start()

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol_class(
            EdgeLimits(
                max_connections=settings.max_connections,
                max_header_bytes=settings.max_header_bytes,
                header_timeout=settings.header_timeout,
                max_connections_per_client=settings.max_connections_per_client,
                trusted_proxies=frozenset(settings.trusted_proxies),
            )
        ),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        workers=1,
    )
    server = DrainingServer(config)
    try:
        server.run()
    finally:
        engine.shutdown(settings.drain_timeout)  # at once if drained or failed already
    if not server.started:
        log.error("the server did not start (see above)")
        return 3
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
