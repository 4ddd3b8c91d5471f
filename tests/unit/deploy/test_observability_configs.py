"""Offline checks of the monitoring configs (issue 31): deploy/prometheus/prometheus.yml scrapes the compose
services on the ports they serve /metrics on, and deploy/k8s/monitoring/servicemonitor.yaml (a Prometheus Operator
CRD, which kubernetes-validate has no schema for) matches a schema of the fields it uses and names Services, ports
and a namespace that deploy/ defines. The Grafana dashboard's queries are checked against the services' own
/metrics in tests/integration/observability/test_dashboard_queries.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped,unused-ignore]  # kubernetes-validate's dependency (requirements/dev.txt)
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.lease.__main__ import DEFAULT_METRICS_PORT as LEASE_METRICS_PORT
from kvbridge_services.registry.__main__ import DEFAULT_METRICS_PORT as REGISTRY_METRICS_PORT
from tests.fixtures.common import DEV_HINT, require

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
SERVICE_MONITOR = DEPLOY / "k8s" / "monitoring" / "servicemonitor.yaml"
JOBS = {"kvbridge-gateway", "kvbridge-registry", "kvbridge-lease"}

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}
# The part of monitoring.coreos.com/v1 ServiceMonitor (prometheus-operator's CRD) these manifests use; anything
# else is refused, so a misspelt field fails here rather than being dropped by the API server's pruning.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "additionalProperties": False,
            "properties": {"name": _NAME, "namespace": _NAME, "labels": _LABELS},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _NAME}},
                },
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop"]},
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "targetLabel": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "separator": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def _yaml_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _k8s_manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [d for res in kustomization["resources"] for d in _yaml_all(DEPLOY / res)]


def test_monitoring_files_are_yamllint_clean() -> None:
    require("yamllint", DEV_HINT)
    from yamllint import config, linter  # type: ignore[import-untyped,unused-ignore]

    conf = config.YamlLintConfig(file=str(ROOT / ".yamllint"))
    for path in (PROMETHEUS, SERVICE_MONITOR):
        problems = [f"{path.name}:{p.line} {p.message}" for p in linter.run(path.read_text(), conf, str(path))]
        assert problems == []


def test_prometheus_scrapes_every_compose_service_where_it_serves_metrics() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs.keys() >= JOBS
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    expected_ports = {
        "kvbridge-gateway": GatewaySettings.model_fields["http_port"].default,
        "kvbridge-registry": REGISTRY_METRICS_PORT,
        "kvbridge-lease": LEASE_METRICS_PORT,
        "vllm": 8000,
    }
    for name, job in jobs.items():
        assert job.get("metrics_path", "/metrics") == "/metrics", name
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        assert targets, name
        for target in targets:
            host, port = target.rsplit(":", 1)
            assert host in compose, f"{name}: {host} is not a compose service"
            assert int(port) == expected_ports[name], target
    # Every lease replica is scraped (each says whether it leads).
    lease_hosts = {t.split(":")[0] for sc in jobs["kvbridge-lease"]["static_configs"] for t in sc["targets"]}
    assert lease_hosts == {n for n in compose if n.startswith("lease-")}


def test_service_monitors_match_their_schema_and_the_manifests() -> None:
    monitors = _yaml_all(SERVICE_MONITOR)
    assert len(monitors) == 3
    for doc in monitors:
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    manifests = _k8s_manifests()
    services = [d for d in manifests if d["kind"] == "Service"]
    workloads = [d for d in manifests if d["kind"] in ("Deployment", "StatefulSet")]
    jobs = set()
    for doc in monitors:
        name = doc["metadata"]["name"]
        assert doc["metadata"]["namespace"] == namespace and doc["spec"]["namespaceSelector"]["matchNames"] == [
            namespace
        ]
        wanted = doc["spec"]["selector"]["matchLabels"]
        selected = [s for s in services if wanted.items() <= s["metadata"].get("labels", {}).items()]
        assert len(selected) == 1, f"{name} selects {[s['metadata']['name'] for s in selected]}"
        service = selected[0]
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        pods = [
            w
            for w in workloads
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        container_ports = {
            p["name"]: p["containerPort"]
            for w in pods
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for endpoint in doc["spec"]["endpoints"]:
            port = ports.get(endpoint["port"])
            assert port is not None, f"{name}: Service {service['metadata']['name']} has no port {endpoint['port']}"
            assert port["targetPort"] in container_ports, f"{name}: no container port {port['targetPort']}"
            assert endpoint["path"] == "/metrics"
            jobs |= {r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"}
    assert jobs == JOBS  # the job names the dashboard's process panels and prometheus.yml use
    # The registry's and lease manager's metrics ports are the ports their processes serve /metrics on.
    by_name = {s["metadata"]["name"]: s for s in services}
    assert {p["name"]: p["port"] for p in by_name["registry"]["spec"]["ports"]}["metrics"] == REGISTRY_METRICS_PORT
    assert {p["name"]: p["port"] for p in by_name["lease"]["spec"]["ports"]}["metrics"] == LEASE_METRICS_PORT


def test_the_service_monitor_schema_catches_a_typo() -> None:
    doc = _yaml_all(SERVICE_MONITOR)[0]
    doc["spec"]["endpoints"][0]["intreval"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)


def test_compose_monitoring_profile_provisions_prometheus_and_the_dashboard() -> None:
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]  # off unless asked for
    mounts = {
        target: DEPLOY / source.removeprefix("./")
        for svc in (prometheus, grafana)
        for source, target, *_ in (v.split(":") for v in svc["volumes"])
    }
    for target, source in mounts.items():
        assert source.exists(), f"{target}: {source} is missing"
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert datasource["isDefault"] is True  # the dashboard's datasource variable picks it
    provider = yaml.safe_load((provisioning / "dashboards" / "kvbridge.yaml").read_text())["providers"][0]
    dashboards = provider["options"]["path"]
    assert mounts[f"{dashboards}/kvbridge.json"] == DEPLOY / "grafana" / "kvbridge.json"
