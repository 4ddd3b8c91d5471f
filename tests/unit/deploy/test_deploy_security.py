"""deploy/ is secure as shipped: every kvbridge service runs with the API keys file, services present their
keys and the gateway its deployment secret from Secrets (never literals), nothing sets KVBRIDGE_INSECURE, the
only Service reachable from outside the cluster is Envoy's and it terminates TLS, and NetworkPolicies keep
engines' HTTP to the gateway and NIXL to the engines (issue 15)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]

from .test_deploy_configs import DEPLOY, envoy_config, manifests, walk

Doc = dict[str, Any]
SERVICES = {
    "registry": "kvbridge_services.registry",
    "lease": "kvbridge_services.lease",
    "gateway": "kvbridge_services.gateway",
}
ENGINES = {"prefill", "decode"}
KEYS_FILE = "KVBRIDGE_API_KEYS_FILE"


def _kind(kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def _workloads() -> dict[str, Doc]:
    return {**_kind("Deployment"), **_kind("StatefulSet")}


def _container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    return dict(containers[0])


def _env(container: Doc) -> dict[str, Any]:
    """Name -> value or valueFrom, with the ConfigMaps of envFrom first (as Kubernetes merges them)."""
    config_maps = _kind("ConfigMap")
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def _service_workloads() -> dict[str, Doc]:
    found = {}
    for w in _workloads().values():
        command = " ".join(_container(w).get("command", []))
        for service, module in SERVICES.items():
            if module in command:
                found[service] = w
    assert set(found) == set(SERVICES), found.keys()
    return found


def test_every_service_runs_with_the_api_keys_file_mounted_from_a_secret() -> None:
    for service, w in _service_workloads().items():
        c = _container(w)
        path = _env(c).get(KEYS_FILE)
        assert isinstance(path, str) and path, f"{service}: no {KEYS_FILE} (it would run in insecure mode)"
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
        mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{service}: {path} is not on a mounted volume"
        assert volumes[mounts[0]["name"]]["secret"]["secretName"] == "kvbridge-api-keys", service


def test_keys_and_the_deployment_secret_come_from_secrets_never_literals() -> None:
    services = _service_workloads()
    gateway = _env(_container(services["gateway"]))
    for name in ("KVBRIDGE_HASH_SECRET", "KVBRIDGE_GATEWAY_CONTROL_API_KEY"):
        assert isinstance(gateway.get(name), dict) and "secretKeyRef" in gateway[name], name
    registry = _env(_container(services["registry"]))
    assert "secretKeyRef" in registry["KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY"]
    for w in _workloads().values():
        for name, value in _env(_container(w)).items():
            if name.endswith(("_API_KEY", "HASH_SECRET", "HASH_SECRET_HEX")):
                assert isinstance(value, dict), f"{w['metadata']['name']}: {name} is a literal"


def test_nothing_runs_insecure() -> None:
    for path in [*(DEPLOY / "k8s").glob("*.yaml"), DEPLOY / "compose.yaml"]:
        assert "KVBRIDGE_INSECURE" not in path.read_text(), path


def test_only_envoy_is_exposed_and_it_terminates_tls() -> None:
    exposed = {n for n, s in _kind("Service").items() if s["spec"].get("type", "ClusterIP") != "ClusterIP"}
    assert exposed == {"envoy"}
    envoy = _kind("Service")["envoy"]
    pod_labels = envoy["spec"]["selector"]
    envoy_pods = [
        w for w in _workloads().values() if pod_labels.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert envoy_pods
    listeners = envoy_config()["static_resources"]["listeners"]
    exposed_ports = {p.get("targetPort", p["port"]) for p in envoy["spec"]["ports"]}
    for listener in listeners:
        port = listener["address"]["socket_address"]["port_value"]
        if port in exposed_ports:
            sockets = [d for d in walk(listener) if "transport_socket" in d]
            assert sockets and all("tls" in d["transport_socket"]["name"] for d in sockets), f"port {port}: no TLS"


def _selects(policy: Doc, labels: dict[str, str]) -> bool:
    sel = policy.get("podSelector", policy)
    if not sel.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in sel.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_engines_http_only_from_the_gateway_and_nixl_only_from_engines() -> None:
    policies = [p for p in _kind("NetworkPolicy").values() if "Ingress" in p["spec"]["policyTypes"]]
    workloads = _workloads()
    labels = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads.items()}
    for engine in ENGINES:
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels[engine])]
        assert mine, f"no NetworkPolicy selects the {engine} pods: anyone in the cluster reaches them"
        ports = {p["name"]: p["containerPort"] for p in _container(workloads[engine])["ports"]}
        for source, allowed in labels.items():
            rules = [
                r
                for p in mine
                for r in p["spec"].get("ingress", [])
                if any(_selects(f, allowed) for f in r.get("from", []))
            ]
            reachable = (
                set()
                if not rules
                else (
                    set(ports.values())
                    if any("ports" not in r for r in rules)
                    else {p["port"] for r in rules for p in r["ports"]}
                )
            )
            if source == "gateway":
                assert ports["http"] in reachable and ports["nixl"] not in reachable, (engine, reachable)
            elif source in ENGINES:  # UCX's TCP transfers use ephemeral ports: engines reach each other on any
                assert ports["nixl"] in reachable, (engine, source, reachable)
            else:
                assert not reachable, f"{source} reaches {engine} on {reachable}"


def test_compose_services_run_with_keys_and_the_secret_env() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        command = " ".join(svc.get("command", []))
        if not any(module in command for module in SERVICES.values()):
            continue
        assert svc["environment"].get(KEYS_FILE), name
        assert "./secrets/service.env" in svc.get("env_file", []), name
        mounts = [v.split(":")[1] for v in svc.get("volumes", [])]
        assert str(Path(svc["environment"][KEYS_FILE])) in mounts, name


def _transfer_config(command: list[str] | str) -> Doc:
    """The --kv-transfer-config JSON of a vLLM command line (one folded YAML string in the manifests)."""
    import json

    text = " ".join(command) if isinstance(command, list) else command
    start = text.index("--kv-transfer-config=") + len("--kv-transfer-config=")
    config, _ = json.JSONDecoder().raw_decode(text[start:])
    return dict(config)


def _assert_connector_mode(name: str, config: Doc) -> None:
    assert config["kv_connector"] == "KvbridgeConnector", name
    assert config["kv_connector_module_path"] == "kvbridge_connector.connector", name
    extra = config["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True, name
    assert extra["kvbridge_registry"] == "registry:50051" and extra["kvbridge_lease"] == "lease:50052", name
    assert extra["kvbridge_http_url"].endswith(":8000"), name
    # Keys and the secret come from the environment (Secrets), never from the command line.
    assert not {"kvbridge_api_key", "kvbridge_hash_secret"} & set(extra), name


def test_engines_run_the_kvbridge_connector_with_its_key_and_the_secret_from_secrets() -> None:
    """Connector mode as shipped: every engine registers itself (engine role), D retains under leases, P pulls
    only signed offers; the gateway routes by the registry's engine list (stock engines would leave every
    turn unregistered: compatibility mode needs the gateway to register them, with the engine role)."""
    workloads = _workloads()
    for name in ENGINES:
        container = _container(workloads[name])
        _assert_connector_mode(name, _transfer_config(container["args"]))
        env = _env(container)
        for var, key in (("KVBRIDGE_API_KEY", "KVBRIDGE_CONNECTOR_API_KEY"), ("KVBRIDGE_HASH_SECRET", None)):
            ref = env[var]["secretKeyRef"]
            assert ref["name"] == "kvbridge-service-env" and ref["key"] == (key or var), (name, var)
    gateway_env = _env(_container(_service_workloads()["gateway"]))
    assert gateway_env["KVBRIDGE_GATEWAY_ENGINES_FROM_REGISTRY"] == "true"
    assert (
        "KVBRIDGE_GATEWAY_PREFILL_ENGINES" not in gateway_env and "KVBRIDGE_GATEWAY_DECODE_ENGINES" not in gateway_env
    )

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    for name in ENGINES:
        _assert_connector_mode(name, _transfer_config(compose[name]["command"]))
        assert "./secrets/engine.env" in compose[name]["env_file"], name
    assert compose["gateway"]["environment"]["KVBRIDGE_GATEWAY_ENGINES_FROM_REGISTRY"] == "true"
