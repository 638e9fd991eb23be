"""docs/metrics.md names every metric the server defines, with its type and labels, and explains
every alert and dashboard panel that deploy/ ships."""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client import Counter

from encode_server.metrics import NAMESPACE, Metrics
from tests.docs.markdown import ROOT, tables

DOC = (ROOT / "docs" / "metrics.md").read_text()


def exposed() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every metric of a fresh ``Metrics``: its exposed name -> (type, label names)."""
    out = {}
    for attr in vars(Metrics()).values():
        if attr.__class__.__module__.startswith("prometheus_client.metrics"):
            name = attr._name + ("_total" if isinstance(attr, Counter) else "")
            out[name] = (attr._type, tuple(attr._labelnames))
    return out


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The metric tables of docs/metrics.md: name -> (type, label names)."""
    out = {}
    for table in tables(DOC):
        if table[0][:3] != ["metric", "type", "labels"]:
            continue
        for row in table[1:]:
            name = row[0].strip("`")
            labels = tuple(re.findall(r"`([a-z_]+)`", row[2]))
            out[name] = (row[1], labels)
    return out


def test_the_metric_reader_sees_them_all() -> None:
    metrics = exposed()
    assert len(metrics) >= 20
    assert metrics["encode_server_requests_total"] == ("counter", ("route", "code"))
    assert all(name.startswith(NAMESPACE + "_") for name in metrics)


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    metrics, rows = exposed(), documented()
    assert sorted(set(metrics) - set(rows)) == [], "metrics missing from docs/metrics.md"
    assert sorted(set(rows) - set(metrics)) == [], "docs/metrics.md lists metrics the server does not define"
    wrong = {name: (rows[name], kind) for name, kind in metrics.items() if rows[name] != kind}
    assert wrong == {}


def test_every_alert_is_explained() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    assert alerts
    assert [a for a in alerts if f"**{a}**" not in DOC] == []


def test_every_dashboard_panel_is_explained() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/encode-server.json").read_text())
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert titles
    assert [t for t in titles if f"**{t}**" not in DOC] == []


def test_every_reject_reason_is_documented() -> None:
    """``rejected_total``'s closed set of reasons (each exposed at 0 from the start) is the one
    docs/metrics.md explains."""
    from encode_server.metrics import REJECT_REASONS

    bullet = re.search(r"^- `reason`: (.*?)(?=^\S|^$)", DOC, re.M | re.S)
    assert bullet, "docs/metrics.md has no `reason` bullet"
    named = set(re.findall(r"`([a-z_]+)` \(", bullet.group(1)))
    assert named == set(REJECT_REASONS)


def test_every_proxy_metric_is_documented_with_its_type_and_labels() -> None:
    """The proxy's table (``proxy metric``) is its metrics module, no more, no less."""
    from encode_client._proxy_metrics import NAMESPACE as PROXY
    from encode_client._proxy_metrics import ProxyMetrics

    exposed_proxy = {}
    for attr in vars(ProxyMetrics()).values():
        if attr.__class__.__module__.startswith("prometheus_client.metrics"):
            exposed_proxy[attr._name + ("_total" if isinstance(attr, Counter) else "")] = (
                attr._type, tuple(attr._labelnames)
            )
    rows = {}
    for table in tables(DOC):
        if table[0][:3] == ["proxy metric", "type", "labels"]:
            for row in table[1:]:
                rows[row[0].strip("`")] = (row[1], tuple(re.findall(r"`([a-z_]+)`", row[2])))
    assert len(exposed_proxy) >= 10 and all(n.startswith(PROXY + "_") for n in exposed_proxy)
    assert rows == exposed_proxy
