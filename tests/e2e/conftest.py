"""A real ``veloxquant-serve`` process on a free 127.0.0.1 port, driven over HTTP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from veloxquant_mlx.engine.model.default_model import ASSETS

ADMIN = "e2e-admin-key"
MODEL = "veloxquant-tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: str

    def admin(self) -> dict:
        r = httpx.get(
            f"{self.base_url}/admin/pool", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
        )
        r.raise_for_status()
        return r.json()

    def wait_pool_free(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        view = self.admin()
        while time.monotonic() < deadline:
            view = self.admin()
            if view["blocks_in_use_by_running"] == 0:
                # the prefix cache drops the pages no request holds: then nothing may be left
                r = httpx.post(
                    f"{self.base_url}/admin/prefix-cache/reset",
                    headers={"Authorization": f"Bearer {ADMIN}"},
                    timeout=10,
                )
                r.raise_for_status()
                view = r.json()
                if view["stats"]["blocks_in_use"] == 0 and view["owners"] == {}:
                    return view
            time.sleep(0.05)
        raise AssertionError(f"pool not free: {view}")

    def log(self) -> str:
        with open(self.log_path) as fh:
            return fh.read()


def start_server(tmp_path, *args: str) -> Server:
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    cmd = [
        sys.executable, "-m", "veloxquant_mlx.server",
        "--port", str(port),
        "--admin-key", ADMIN,
        "--model-cache-dir", os.environ["VQ_TEST_MODEL_CACHE"],
        *args,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"server not ready:\n{server.log()}")


def stop_server(server: Server, timeout: float = 30.0) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)
    return server.process.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path_factory.mktemp("e2e"),
        "--n-blocks", "6000", "--max-queue", "64",
        "--gil-switch-interval-ms", "1",  # the opt-in GIL setting serves like the default
        "--engine-process",  # the API end to end through the engine's own process
    )  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture
def pool_free_after(server) -> Iterator[None]:
    yield
    server.wait_pool_free()


# The embedded model's own template: Hermes-style tool calls (JSON in <tool_call> tags).
TOOL_TEMPLATE = json.loads((ASSETS / "tokenizer_config.json").read_text())["chat_template"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, default_model_dir) -> Iterator[Server]:
    model = tmp_path_factory.mktemp("tool-model") / MODEL
    shutil.copytree(default_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    # the model names Claude Code sends (tests/fixtures/claude_code_request.json) are served
    srv = start_server(
        tmp_path_factory.mktemp("tools"), "--model", str(model), "--model-aliases", "claude-*"
    )
    yield srv
    srv.wait_pool_free()
    assert stop_server(srv) == 0, srv.log()
