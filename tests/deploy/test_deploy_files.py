"""deploy/ is checked by the tools that will read it: promtool, docker-compose, Kubernetes schemas."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from encode_server.metrics import Metrics
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"


def run(*cmd: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def exported_names() -> set[str]:
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {m.name + suffix for m in Metrics().registry.collect() for suffix in suffixes[m.type]}


def queried_names(expr: str) -> set[str]:
    return set(re.findall(r"\bencode_server_[a-z_]+", expr))


def test_promtool_checks_the_config_and_rules() -> None:
    promtool = require_tool("promtool")
    run(promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    run(promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml"))


def test_each_alert_fires_when_it_should_and_not_on_a_healthy_server() -> None:
    promtool = require_tool("promtool")
    run(promtool, "test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")


def test_alerts_and_dashboard_query_only_metrics_the_server_exports() -> None:
    exported = exported_names()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "encode-server.json").read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Request rate by route and code", "Request latency (p50, p99)", "Cache hit ratio by tier",
            "Batch size", "Queue depth and requests in flight", "Redis up"} <= titles
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for expr in exprs:
        assert queried_names(expr) <= exported, (expr, queried_names(expr) - exported)


def test_compose_file_validates_and_wires_redis_and_the_drain() -> None:
    # Compose v2 (`docker compose`) where the plugin exists, else Debian's docker-compose 1.29.
    has_v2 = shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True, timeout=60
    ).returncode == 0
    cmd = ["docker", "compose"] if has_v2 else [require_tool("docker-compose")]
    rendered = yaml.safe_load(run(*cmd, "-f", str(DEPLOY / "docker-compose.yml"), "config"))
    server = rendered["services"]["encode-server"]
    env = server["environment"]
    assert env["ENCODE_SERVER_REDIS_URL"] == "redis://redis:6379/0"
    redis_cmd = rendered["services"]["redis"]["command"]
    assert "allkeys-lru" in redis_cmd and "--maxmemory" in redis_cmd
    assert {"prometheus", "grafana"} <= set(rendered["services"])
    grace = int(str(server["stop_grace_period"]).rstrip("s"))
    assert grace > float(env["ENCODE_SERVER_DRAIN_SECONDS"])


def render_kustomization(directory: Path) -> list[dict[str, Any]]:
    """kustomize's output for a kustomization that lists only ``resources`` (ours does)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}, "extend render_kustomization first"
    objects = []
    for resource in kustomization["resources"]:
        objects += [o for o in yaml.safe_load_all((directory / resource).read_text()) if o]
    return objects


def test_every_kubernetes_object_validates_against_its_schema() -> None:
    objects = render_kustomization(DEPLOY / "k8s")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Deployment", "encode-server"), ("Service", "encode-server"),
            ("PodDisruptionBudget", "encode-server"), ("Deployment", "encode-server-redis"),
            ("Service", "encode-server-redis")} == kinds
    for o in objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)

    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "encode-server")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    env = {e["name"]: e for e in container["env"]}
    assert env["ENCODE_SERVER_REDIS_URL"]["value"].startswith("redis://encode-server-redis:")
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(env["ENCODE_SERVER_DRAIN_SECONDS"]["value"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain


def test_schema_validation_rejects_a_misspelt_field() -> None:
    deployment = render_kustomization(DEPLOY / "k8s")[0]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)

