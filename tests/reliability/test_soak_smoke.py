"""`make soak` for a few seconds: its own server, mixed traffic, a hostile client, a probe of
plain requests' latency, shrinks, scrapes, all checks."""

from __future__ import annotations

import json

from loadtest.soak import main


def test_a_short_soak_is_clean(tmp_path, default_model_dir, monkeypatch):
    monkeypatch.setenv("VQ_MODEL_CACHE_DIR", str(default_model_dir.parent))
    out = tmp_path / "soak.json"
    rc = main(["--minutes", "0.25", "--clients", "4", "--json", str(out),
               "--log", str(tmp_path / "server.log")])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report["failures"]
    kinds = {key.split(":")[0] for key in report["requests"]}
    assert kinds >= {"stream", "bad", "chat", "probe"}  # the mix ran
    assert any(k.startswith("hostile_") for k in kinds)  # and the hostile client beside it
    assert report["plain_latency_s"]  # the probe was answered, within --plain-latency-s
    assert report["leak_free"] and report["scrapes"] >= 5 and report["rss_end_mb"] > 0
