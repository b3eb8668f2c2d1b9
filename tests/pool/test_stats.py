import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pool.helpers import make_pool
from veloxquant_mlx.memory import AllocationStats


def test_fields_and_defaults_are_the_seeds():
    stats = AllocationStats(n_blocks=3)
    documented = [
        "n_blocks",
        "n_allocations",
        "n_frees",
        "n_reused",
        "n_exhausted",
        "n_grown",
        "n_retired",
        "peak_blocks_in_use",
        "_fragmented_count",
    ]
    assert [f.name for f in dataclasses.fields(stats)][: len(documented)] == documented
    assert all(getattr(stats, name) == 0 for name in documented[1:])


def test_fragmentation_of_an_empty_pool_is_zero():
    assert AllocationStats(n_blocks=0, _fragmented_count=0).fragmentation() == 0.0
    assert AllocationStats(n_blocks=4, _fragmented_count=1).fragmentation() == 0.25


def test_snapshot_is_independent():
    pool = make_pool()
    pool.allocate("k", 1, owner=1)
    live = pool.stats
    snap = live.snapshot()
    live.n_allocations += 10
    live._free_by_stream["k"] = -1
    assert snap.n_allocations == 1 and snap._free_by_stream["k"] == 3
    assert snap == snap.snapshot()


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_to_prometheus_parses_with_help_type_and_right_values():
    pool = make_pool(n_blocks=8, block_size=4)
    pool.allocate("k", 6, owner=1)  # 2 blocks, one half full
    pool.allocate("v", 4, owner=2)
    pool.free_all(2)
    text = pool.stats.to_prometheus()
    assert text.endswith("\n") and ":" not in text.replace("# HELP", "").split("\n")[0]
    fams = _families(text)
    p = "veloxquant_block_pool"
    assert fams[f"{p}_blocks"].type == "gauge"
    assert fams[f"{p}_blocks"].samples[0].value == 8
    assert fams[f"{p}_blocks_in_use"].samples[0].value == 2
    assert fams[f"{p}_fragmentation_ratio"].samples[0].value == pytest.approx(1 / 8)
    free = {s.labels["stream"]: s.value for s in fams[f"{p}_blocks_free"].samples}
    assert free == {"k": 2, "v": 4}
    assert fams[f"{p}_allocations"].type == "counter"
    assert fams[f"{p}_allocations"].samples[0].value == 2
    assert fams[f"{p}_frees"].samples[0].value == 1
    for fam in fams.values():
        assert fam.documentation, fam.name
        for sample in fam.samples:
            assert sample.name.endswith("_total") == (fam.type == "counter"), sample.name
    for line in text.splitlines():
        assert line.startswith("# ") or line.split(" ")[0].startswith(p)


def test_to_prometheus_honours_prefix_and_rejects_bad_ones():
    text = AllocationStats(n_blocks=1).to_prometheus(prefix="myapp_kv")
    assert "myapp_kv_blocks 1" in text
    assert "veloxquant" not in text
    for bad in ["", "1abc", "a:b", "has space", "dash-name"]:
        with pytest.raises(ValueError):
            AllocationStats(n_blocks=1).to_prometheus(prefix=bad)


def test_shared_pool_reports_one_kv_stream():
    pool = make_pool(n_blocks=4, separate_kv=False)
    fams = _families(pool.stats.to_prometheus())
    labels = [s.labels for s in fams["veloxquant_block_pool_blocks_free"].samples]
    assert labels == [{"stream": "kv"}]
