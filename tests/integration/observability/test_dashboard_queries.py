"""deploy/grafana/kvbridge.json asks only for metrics the services export (issue 31): each service's /metrics is
rendered in-process (registry, lease manager, gateway, with API keys so that the per-principal limits' metrics
exist too) and every metric name in every panel's PromQL must be one of their series."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from kvbridge_services.common.auth import Authenticator, Principal
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.common.telemetry import Telemetry
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.policy import LeasePolicy
from kvbridge_services.registry.config import RegistrySettings
from kvbridge_services.stack import ServiceStack

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "kvbridge.json"
# PromQL words that are not metric names (functions are recognised by their "(").
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"})
_SERIES_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: strings, label matchers, ranges and by/without/on(...)
    label lists removed, then every identifier that is not a function call, a keyword or part of a number."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() in _KEYWORDS or e[m.end() :].lstrip().startswith("("):
            continue
        names.add(m.group())
    return names


def exported_series(exposition: str) -> set[str]:
    """Every series name a /metrics text can hold, from its TYPE lines (a histogram's _bucket, _sum, _count)."""
    out: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out.update(name + suffix for suffix in _SERIES_SUFFIXES.get(kind, ("",)))
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel (rows' nested panels too)."""
    out: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    return out


def missing_metrics(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    return [
        f"{title}: {name}"
        for title, expr in dashboard_queries(dashboard)
        for name in sorted(metric_names(expr))
        if name not in exported
    ]


@pytest.fixture
async def exported() -> AsyncIterator[dict[str, set[str]]]:
    store = MemoryStore()
    auth = Authenticator({"key-acme": Principal("acme-app", "acme")})
    gateway = GatewaySettings(host="127.0.0.1", http_port=0, grpc_port=0, hash_secret_hex="00" * 16)
    async with ServiceStack(
        store,
        lease_policy=LeasePolicy(port=0),
        registry=RegistrySettings(port=0),
        gateway=gateway,
        auth=auth,
        gateway_auth=auth,
        telemetry=Telemetry.disabled,
        stop_grace_s=0.1,
    ) as services:
        assert services.registry is not None and services.lease is not None and services.gateway is not None
        registries = {
            "registry": services.registry.telemetry.registry,
            "lease": services.lease.telemetry.registry,
            "gateway": services.gateway.telemetry.registry,
        }
        yield {name: exported_series(generate_latest(r).decode()) for name, r in registries.items()}
    await store.close()


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, reuse) (rate(kvbridge_gateway_ttft_seconds_bucket{reuse!="x"}[5m])))'
        " / clamp_min(sum without (job) (rate(a_total[$__rate_interval])), 1e-9) and on(instance) up"
    )
    assert metric_names(expr) == {"kvbridge_gateway_ttft_seconds_bucket", "a_total", "up"}
    assert exported_series("# TYPE x histogram\n# TYPE y_total counter\n") == {
        "x_bucket",
        "x_sum",
        "x_count",
        "y_total",
    }


def test_every_dashboard_query_names_an_exported_metric(exported: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    every = set().union(*exported.values())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 30
    assert missing_metrics(dashboard, every) == []
    # What the dashboard is for: each service's own metrics are asked for.
    asked = set().union(*(metric_names(expr) for _, expr in queries))
    for service, prefix in (
        ("gateway", "kvbridge_gateway_"),
        ("registry", "kvbridge_registry_"),
        ("lease", "kvbridge_lease_"),
    ):
        assert {n for n in asked if n.startswith(prefix)} <= exported[service], service
    for needed in (
        "kvbridge_gateway_reuse_total",
        "kvbridge_gateway_pulled_tokens_total",
        "kvbridge_gateway_ttft_seconds_bucket",
        "kvbridge_lease_is_leader",
        "kvbridge_registry_lookups_total",
        "kvbridge_store_request_seconds_bucket",
        "process_cpu_seconds_total",
    ):
        assert needed in asked, needed
    # The check itself catches a misspelt metric.
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["targets"][0]["expr"] = "sum(rate(kvbridge_gateway_reuse_totl[5m]))"
    assert missing_metrics(broken, every) == [f"{broken['panels'][1]['title']}: kvbridge_gateway_reuse_totl"]


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "kvbridge"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
