"""What a rank reads from its launcher's environment, and the settings a group refuses."""

from __future__ import annotations

import json

import pytest

from veloxquant_mlx.config.launch import launched_rank, ranks_on_this_host, share_cpu_threads
from veloxquant_mlx.config.settings import SettingsError, load_settings


def test_no_launcher_no_group(monkeypatch):
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    assert launched_rank() is None and ranks_on_this_host() is None
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert share_cpu_threads() is None


def test_ranks_sharing_a_host_split_its_cores(monkeypatch, tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.1:5001"], ["10.0.0.2:5000"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert launched_rank() == 1 and ranks_on_this_host() == 2
    assert share_cpu_threads() == 4
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")  # the operator's choice stands
    assert share_cpu_threads() is None
    monkeypatch.setenv("MLX_RANK", "2")  # alone on its host: nothing to share
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    assert ranks_on_this_host() == 1 and share_cpu_threads() is None
    hosts.write_text("not json")
    assert ranks_on_this_host() is None


def test_a_group_refuses_the_engine_process(monkeypatch):
    monkeypatch.setenv("MLX_RANK", "0")
    with pytest.raises(SettingsError, match="does not run in an mx"):
        load_settings(["--engine-process"])
    assert load_settings(["--pipeline", "--group-timeout", "5"]).group_timeout == 5
