"""The ops kit: alert rules and the dashboard refer to metrics the server really exports, the
rules pass promtool (syntax and unit tests), the compose stack validates, the image has no
compiler and the gemv forwarder is opt-in."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from veloxquant_mlx.config import Settings
from veloxquant_mlx.config.settings import load_settings
from veloxquant_mlx.server.app import create_app

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "veloxquant.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\bveloxquant_[a-z0-9_]+")


@pytest.fixture(scope="module")
def exported(default_model_dir) -> set[str]:
    """Every sample name a real server's /metrics carries (after one request)."""
    settings = Settings(model_cache_dir=str(default_model_dir.parent), admin_key="k" * 16)
    with TestClient(create_app(settings)) as client:
        body = {"model": "veloxquant-tiny-llama", "prompt": "hi", "max_tokens": 3}
        assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return exprs


def test_every_metric_in_the_rules_and_dashboard_is_exported(exported):
    referenced = {name for expr in _exprs() for name in METRIC.findall(expr)}
    assert len(referenced) >= 15
    missing = sorted(referenced - exported)
    assert missing == [], f"referenced but not exported: {missing}"


def test_the_dashboard_covers_what_operators_watch():
    dash = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dash["panels"]}
    for wanted in (
        "Time to first token",
        "Inter-token latency",
        "Tokens per second",
        "Running and waiting",
        "KV cache: used vs capacity",
        "Pool: free blocks per stream",
        "Rejections by reason",
        "Engine alive",
    ):
        assert wanted in titles  # fmt: skip
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = provisioned["datasources"][0]["uid"]
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == uid
        assert all(t["expr"].strip() for t in panel["targets"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize(
    "args",
    [
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "alerts.test.yml"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_promtool_accepts_the_rules_and_their_unit_tests_pass(args):
    r = subprocess.run(
        ["promtool", *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def compose_config_validates(where, env) -> None:
    """``docker compose config -q`` on ``where``/docker-compose.yml, with whichever compose
    CLI is here (none: skipped; the YAML checks below still run)."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if (
            shutil.which(cmd[0]) is None
            or subprocess.run([*cmd, "version"], capture_output=True, timeout=60).returncode
        ):
            continue
        r = subprocess.run(
            [*cmd, "-f", "docker-compose.yml", "config", "-q"],
            cwd=where, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return


def test_the_compose_stack_validates():
    env = {**os.environ, "VQ_ADMIN_KEY": "compose-test-key"}
    compose_config_validates(ROOT, env)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"veloxquant", "prometheus", "grafana"}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), source


def test_the_image_has_no_compiler_and_the_forwarder_is_opt_in():
    run_lines = [
        line for line in (ROOT / "Dockerfile").read_text().splitlines() if "install" in line
    ]
    assert run_lines and not any(
        re.search(r"\b(gcc|clang|build-essential|libc6-dev)\b", line) for line in run_lines
    )
    assert Settings().blas_gemv is False


def test_the_fleet_compose_validates_and_its_replicas_settings_load():
    """deploy/fleet: two replicas that register with an SMG router; every VQ_ variable a
    replica sets is a real setting, and together they pass Settings' checks."""
    fleet = ROOT / "deploy" / "fleet"
    env = {**os.environ, "VQ_ADMIN_KEY": "compose-test-key"}
    compose_config_validates(fleet, env)
    compose = yaml.safe_load((fleet / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"router", "replica-1", "replica-2"}
    assert (fleet / compose["services"]["router"]["build"]["dockerfile"]).exists()
    for name in ("replica-1", "replica-2"):
        variables = {
            k: v.replace("${VQ_ADMIN_KEY:?set VQ_ADMIN_KEY (bearer key for /admin)}", "k" * 16)
            for k, v in compose["services"][name]["environment"].items()
        }
        fields = {f"VQ_{field.upper()}" for field in Settings.model_fields}
        assert set(variables) <= fields, set(variables) - fields
        settings = Settings(**{k[3:].lower(): v for k, v in variables.items()})
        assert settings.register_with == "http://router:30000"
        assert settings.advertise_url == f"http://{name}:8000"


def test_the_kubernetes_example_loads_and_names_exported_metrics(exported, tmp_path):
    """deploy/kubernetes: the server's flags are real settings, the probes are /ready and
    /health, the grace period outlasts the drain, and every metric the endpoint picker and
    KEDA read is one the server exports."""
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "veloxquant.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert kinds == {"Deployment", "InferencePool", "Service", "ScaledObject"}
    serve = next(
        d for d in docs if d["metadata"]["name"] == "veloxquant" and d["kind"] == "Deployment"
    )
    pod = serve["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = list(container["args"])
    args[args.index("--model") + 1] = str(tmp_path)  # the example's path is the cluster's
    settings = load_settings(args)
    assert pod["terminationGracePeriodSeconds"] > settings.drain_timeout
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert pool["spec"]["targetPorts"][0]["number"] == settings.port
    assert pool["spec"]["selector"]["matchLabels"] == serve["spec"]["selector"]["matchLabels"]
    referenced = set(METRIC.findall((DEPLOY / "kubernetes" / "veloxquant.yaml").read_text()))
    assert {"veloxquant_requests_waiting", "veloxquant_kv_cache_usage_ratio"} <= referenced
    assert referenced <= exported, referenced - exported
