"""``veloxquant-serve`` / ``python -m veloxquant_mlx.server``: settings, BLAS, logging, uvicorn."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from veloxquant_mlx.blas import ensure_blas
from veloxquant_mlx.config.settings import SettingsError, load_settings


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(exc.code, file=sys.stderr)
        return 2
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
    settings, generated = settings.with_admin_key()
    if generated:
        print(f"veloxquant-serve: admin key for this run: {settings.admin_key}", file=sys.stderr)

    import uvicorn

    from veloxquant_mlx.server.app import create_app

    app = create_app(settings)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop admitting and let running requests finish, then exit."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(app.state, "vq", None)
            if state is not None and not state.draining:
                state.draining = True
                log.info("draining: up to %.0fs for running requests", settings.drain_timeout)
                threading.Thread(
                    target=state.engine.shutdown, args=(settings.drain_timeout,), daemon=True
                ).start()
            # As uvicorn's, minus re-raising the signal at exit: a drained stop exits 0.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_timeout) + 10,
        workers=1,
    )
    DrainingServer(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
