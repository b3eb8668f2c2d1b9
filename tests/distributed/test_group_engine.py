"""Two ranks on the ring backend over loopback run the engine's workload exactly as one process
does: the same greedy and seeded tokens, logprobs and scores within float noise, cancel and
shrink applied on every rank, and every rank's pool all free at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.group import kill_all, start_ranks

WORKLOAD = [sys.executable, "-m", "tests.support.group_workload"]


def run_single(tmp_path: Path, model: str, *flags: str) -> dict:
    out = tmp_path / "single.json"
    subprocess.run([*WORKLOAD, str(out), model, *flags], check=True, timeout=300)
    return json.loads(out.read_text())


def run_group(tmp_path: Path, model: str, *flags: str) -> tuple[dict, list[str]]:
    out = tmp_path / "group.json"
    procs = start_ranks([*WORKLOAD, str(out), model, *flags], tmp_path)
    try:
        codes = [proc.wait(300) for proc, _ in procs]
    finally:
        kill_all(procs)
    logs = [log.read_text() for _, log in procs]
    assert codes == [0, 0], logs
    return json.loads(out.read_text()), logs


def assert_same_run(single: dict, group: dict) -> None:
    runs = zip(
        [*single["batch"], single["hit"], single["after_shrink"]],
        [*group["batch"], group["hit"], group["after_shrink"]],
        strict=True,
    )
    for one, two in runs:
        assert two["tokens"] == one["tokens"]
        assert two["finish"] == one["finish"]
        for (lp1, top1), (lp2, top2) in zip(one["logprobs"], two["logprobs"], strict=True):
            if lp1 is not None:
                assert lp2 == pytest.approx(lp1, abs=2e-3)
                assert [t for t, _ in top2] == [t for t, _ in top1]
    assert group["cancelled"] == single["cancelled"] == "cancelled"
    for (lp1, _), (lp2, _) in zip(single["scored"], group["scored"], strict=True):
        assert (lp1 is None) == (lp2 is None)
        if lp1 is not None:
            assert lp2 == pytest.approx(lp1, abs=2e-3)


def assert_pools_free(group: dict) -> list[list[int]]:
    pools = group["pools"]
    assert [row[0] for row in pools] == [0, 1]
    for rank, blocks, free, in_use, owners in pools:
        assert (free, in_use, owners) == (blocks, 0, 0), f"rank {rank}: {pools}"
    return pools


def test_tensor_parallel_matches_one_process(tmp_path, model_cache):
    single = run_single(tmp_path, "-")
    group, logs = run_group(tmp_path, "-")
    assert (group["world_size"], group["mode"]) == (2, "tensor")
    assert_same_run(single, group)
    pools = assert_pools_free(group)
    # Half the KV heads per rank: the same MiB holds twice the blocks, the same on both ranks.
    assert pools[0][1] == pools[1][1]
    assert "rank 0 drained; pool all free" in logs[1]


def test_tensor_parallel_paged_layout(tmp_path, model_cache):
    single = run_single(tmp_path, "-", "--paged")
    group, _ = run_group(tmp_path, "-", "--paged")
    assert_same_run(single, group)
    assert_pools_free(group)


def test_pipeline_matches_one_process(tmp_path, model_cache, qwen2_dir):
    single = run_single(tmp_path, str(qwen2_dir))
    group, logs = run_group(tmp_path, str(qwen2_dir), "--pipeline")
    assert (group["world_size"], group["mode"]) == (2, "pipeline")
    assert_same_run(single, group)
    pools = assert_pools_free(group)
    # Rank 0 holds 2 layers, rank 1 one: blocks in proportion, the same capacity in tokens
    # (and a shrink kept it the same on both).
    assert pools[0][1] == 2 * pools[1][1]
    assert "pipeline parallel" in logs[1]


def test_a_model_without_pipeline_support_is_refused(tmp_path, model_cache):
    out = tmp_path / "never.json"
    procs = start_ranks([*WORKLOAD, str(out), "-", "--pipeline"], tmp_path)
    try:
        codes = [proc.wait(120) for proc, _ in procs]
    finally:
        kill_all(procs)
    logs = [log.read_text() for _, log in procs]
    assert codes[1] == 3, logs[1]
    assert "does not support pipeline parallelism" in logs[1]
    assert codes[0] != 0 and not out.exists()
