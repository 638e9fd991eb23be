"""README.md is what an operator reads: it must explain every dashboard panel and alert that
deploy/ ships, and show the two commands, the client, the CLI and a gRPC call."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_dashboard_panel_is_explained() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/encode-server.json").read_text())
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert titles
    assert [t for t in titles if t not in README] == []


def test_every_alert_is_explained() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    assert alerts
    assert [a for a in alerts if a not in README] == []


def test_the_commands_the_client_the_cli_and_grpc_are_shown() -> None:
    for needle in ("make serve", "make test", "make bench", "from encode_client import", "encode-client warm",
                   "encode-client hash", "grpcurl", "/v1/tokens", "--redis-url", "StoreReader"):
        assert needle in README, needle
