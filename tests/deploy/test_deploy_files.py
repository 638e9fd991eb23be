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
    rendered = yaml.safe_load(run(*cmd, "-f", str(DEPLOY / "docker-compose.yml"), "--profile", "epd", "config"))
    server = rendered["services"]["encode-server"]
    env = server["environment"]
    assert re.fullmatch(r"redis://encode-server:[^@]+@redis:6379/0", env["ENCODE_SERVER_REDIS_URL"])
    redis_cmd = rendered["services"]["redis"]["command"]
    assert "allkeys-lru" in redis_cmd and "--maxmemory" in redis_cmd
    assert {"prometheus", "grafana"} <= set(rendered["services"])
    grace = int(str(server["stop_grace_period"]).rstrip("s"))
    assert grace > float(env["ENCODE_SERVER_DRAIN_SECONDS"])


def _networks(service: dict[str, Any]) -> set[str]:
    networks = service.get("networks") or {}
    return set(networks) if isinstance(networks, (dict, list)) else set()


def test_compose_lets_only_the_proxy_reach_vllm_and_sets_redis_users() -> None:
    """vLLM publishes nothing and shares a network only with the proxy and the two backends it
    reads (encode-server, Redis): no client container or host port reaches it. Redis loads the
    ACL file that tests/integration/test_redis_acl.py checks."""
    has_v2 = shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True, timeout=60
    ).returncode == 0
    cmd = ["docker", "compose"] if has_v2 else [require_tool("docker-compose")]
    rendered = yaml.safe_load(run(*cmd, "-f", str(DEPLOY / "docker-compose.yml"), "--profile", "epd", "config"))
    services, networks = rendered["services"], rendered["networks"]
    vllm = services["vllm"]
    assert not vllm.get("ports") and not vllm.get("expose")
    members = {n: {name for name, svc in services.items() if n in _networks(svc)} for n in networks}
    assert members["prefill"] == {"vllm", "epd-proxy"} and networks["prefill"].get("internal") is True
    assert members["vllm-egress"] == {"vllm"}, "vLLM's way out is its own"
    neighbours = set().union(*(members[n] for n in _networks(vllm))) - {"vllm"}
    assert neighbours == {"epd-proxy", "encode-server", "redis"}
    for n in _networks(vllm) - {"vllm-egress"}:
        assert networks[n].get("internal") is True, n
    assert _networks(services["redis"]) == {"store"} and not services["redis"].get("ports")
    assert services["epd-proxy"]["ports"] and "--vllm" in services["epd-proxy"]["command"]
    redis_cmd = services["redis"]["command"]
    acl = redis_cmd[redis_cmd.index("--aclfile") + 1]
    mounts = {}  # Compose v2 renders mappings, docker-compose 1.29 "source:target:mode" strings
    for v in services["redis"]["volumes"]:
        source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
        mounts[target] = source
    assert Path(mounts[acl]) == DEPLOY / "redis" / "users.acl"
    ec = json.loads(vllm["command"][vllm["command"].index("--ec-transfer-config") + 1])
    assert re.fullmatch(r"redis://vllm-connector:[^@]+@redis:6379/0", ec["ec_connector_extra_config"]["redis_url"])


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "extend _selects first"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_network_policies_admit_only_the_proxy_to_vllm_and_the_backends_to_redis() -> None:
    objects = render_kustomization(DEPLOY / "k8s")
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] == "Deployment"}
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}

    def admitted(policy: dict[str, Any]) -> tuple[set[str], set[str], set[int]]:
        selected = {name for name, pod in pods.items() if _selects(policy["podSelector"], pod["metadata"]["labels"])}
        assert policy["policyTypes"] == ["Ingress"]
        peers, ports = set(), set()
        for rule in policy["ingress"]:
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, "only pods of this namespace, by label"
                peers |= {n for n, pod in pods.items() if _selects(peer["podSelector"], pod["metadata"]["labels"])}
            ports |= {p["port"] for p in rule["ports"]}
        return selected, peers, ports

    def container_port(name: str) -> int:
        return pods[name]["spec"]["containers"][0]["ports"][0]["containerPort"]

    assert admitted(policies["encode-server-vllm"]) == (
        {"encode-server-vllm"}, {"encode-epd-proxy"}, {container_port("encode-server-vllm")}
    )
    assert admitted(policies["encode-server-redis"]) == (
        {"encode-server-redis"}, {"encode-server", "encode-server-vllm"}, {container_port("encode-server-redis")}
    )
    proxy_args = pods["encode-epd-proxy"]["spec"]["containers"][0]["args"]
    assert "--vllm=http://encode-server-vllm:8000" in proxy_args


def test_kubernetes_redis_users_come_from_the_acl_secret() -> None:
    objects = render_kustomization(DEPLOY / "k8s")
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"}
    redis_pod = pods["encode-server-redis"]
    args = redis_pod["containers"][0]["args"]
    acl = Path(args[args.index("--aclfile") + 1])
    mount = next(m for m in redis_pod["containers"][0]["volumeMounts"] if m["mountPath"] == str(acl.parent))
    volume = next(v for v in redis_pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["items"] == [{"key": "users.acl", "path": acl.name}]
    env = {e["name"]: e for e in pods["encode-server"]["containers"][0]["env"]}
    assert env["ENCODE_SERVER_REDIS_URL"]["value"] == "redis://encode-server:$(REDIS_PASSWORD)@encode-server-redis:6379/0"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "encode-server-password"
    vllm = pods["encode-server-vllm"]["containers"][0]
    ec = json.loads(vllm["args"][vllm["args"].index("--ec-transfer-config") + 1])
    assert ec["ec_connector_extra_config"]["redis_url"].startswith("redis://vllm-connector:$(REDIS_PASSWORD)@")
    vllm_env = {e["name"]: e for e in vllm["env"]}
    assert vllm_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "vllm-connector-password"


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
            ("Service", "encode-server-redis"), ("Deployment", "encode-server-vllm"), ("Service", "encode-server-vllm"),
            ("Deployment", "encode-epd-proxy"), ("Service", "encode-epd-proxy"),
            ("NetworkPolicy", "encode-server-vllm"), ("NetworkPolicy", "encode-server-redis")} == kinds
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
    assert "@encode-server-redis:" in env["ENCODE_SERVER_REDIS_URL"]["value"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(env["ENCODE_SERVER_DRAIN_SECONDS"]["value"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain


def test_schema_validation_rejects_a_misspelt_field() -> None:
    deployment = render_kustomization(DEPLOY / "k8s")[0]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)

