"""Offline checks of deploy/: YAML lint, Envoy config against Envoy's own API protos, k8s manifests
against Kubernetes JSON schemas plus cross-references, compose wiring, and the generated artefacts.

No Envoy, kubectl or docker binary is needed: Envoy's schema comes from ``xds-protos`` (typed_config
``Any`` values are resolved and parsed too, so a misspelt field anywhere fails), Kubernetes schemas
from ``kubernetes-validate``.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from google.protobuf import descriptor_pb2, json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from tests.fixtures.common import DEV_HINT, missing, require

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
ENVOY_YAML = DEPLOY / "envoy" / "envoy.yaml"
DESCRIPTOR = DEPLOY / "envoy" / "kvbridge.pb"
GATEWAY_SERVICE = "kvbridge.gateway.v1.GatewayService"
K8S_VERSION = "1.33.0"
YAML_FILES = sorted(p for p in DEPLOY.rglob("*.yaml") if "secrets" not in p.parts)

Doc = dict[str, Any]


def load_all(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def envoy_config() -> Doc:
    doc = yaml.safe_load(ENVOY_YAML.read_text())
    assert isinstance(doc, dict)
    return doc


def walk(node: object) -> Iterator[Doc]:
    """Every mapping in a parsed YAML tree."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# ---------------------------------------------------------------- YAML


def test_every_yaml_parses() -> None:
    assert len(YAML_FILES) >= 10
    for path in YAML_FILES:
        assert load_all(path), f"{path} is empty"


def test_yamllint_clean() -> None:
    require("yamllint", DEV_HINT)
    from yamllint import config, linter  # type: ignore[import-untyped,unused-ignore]

    conf = config.YamlLintConfig(file=str(ROOT / ".yamllint"))
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}:{p.column} {p.rule} {p.message}"
        for path in [*YAML_FILES, ROOT / ".yamllint"]
        for p in linter.run(path.read_text(), conf, str(path))
    ]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- Envoy: schema


def _import_proto_package(type_name: str) -> None:
    """Imports every *_pb2 module of the proto package that defines ``type_name``."""
    package = type_name.rsplit(".", 1)[0]
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__):
        if info.name.endswith("_pb2"):
            importlib.import_module(f"{package}.{info.name}")


def _check_pgv(msg: Message, path: str, problems: list[str]) -> None:
    """Applies the protoc-gen-validate rules Envoy enforces at load (required, min_len, enum, deprecated)."""
    from validate import validate_pb2  # type: ignore[import-untyped,unused-ignore]

    for group in msg.DESCRIPTOR.oneofs:
        if group.GetOptions().Extensions[validate_pb2.required] and msg.WhichOneof(group.name) is None:
            problems.append(f"{path}: one of {group.name} is required")
    for field in msg.DESCRIPTOR.fields:
        here = f"{path}.{field.name}"
        oneof = field.containing_oneof
        if oneof is not None and msg.WhichOneof(oneof.name) != field.name:
            continue  # PGV applies a oneof member's rules only when that member is the one set.
        opts = field.GetOptions()
        is_repeated = field.is_repeated
        present = (
            len(getattr(msg, field.name)) > 0
            if is_repeated
            else (msg.HasField(field.name) if field.has_presence else getattr(msg, field.name) != field.default_value)
        )
        if opts.deprecated and present:
            problems.append(f"{here}: deprecated field")
        rules = opts.Extensions[validate_pb2.rules]
        kind = rules.WhichOneof("type")
        typed_required = kind in ("duration", "timestamp", "any") and getattr(rules, kind).required
        required = rules.message.required or typed_required
        if required and not present:
            problems.append(f"{here}: required")
        if kind == "string" and not is_repeated:
            value = getattr(msg, field.name)
            if len(value) < rules.string.min_len or len(value.encode()) < rules.string.min_bytes:
                problems.append(f"{here}: too short")
        if kind == "repeated" and len(getattr(msg, field.name)) < rules.repeated.min_items:
            problems.append(f"{here}: needs at least {rules.repeated.min_items} items")
        enum_type = field.enum_type
        checks_enum = kind == "enum" and rules.enum.defined_only and not is_repeated
        if checks_enum and enum_type is not None and enum_type.values_by_number.get(getattr(msg, field.name)) is None:
            problems.append(f"{here}: undefined enum value")
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type is None:
            continue
        children = list(getattr(msg, field.name)) if is_repeated else ([getattr(msg, field.name)] if present else [])
        if field.message_type.GetOptions().map_entry:
            children = [v for v in getattr(msg, field.name).values() if isinstance(v, Message)]
        for i, child in enumerate(children):
            if child.DESCRIPTOR.full_name == "google.protobuf.Any":
                _import_proto_package(child.TypeName())
                from google.protobuf import symbol_database

                inner = symbol_database.Default().GetSymbol(child.TypeName())()
                child.Unpack(inner)
                _check_pgv(inner, f"{here}[{i}]<{child.TypeName()}>", problems)
            else:
                _check_pgv(child, f"{here}[{i}]", problems)


def test_envoy_config_matches_envoy_api_schema() -> None:
    require("envoy.config.bootstrap.v3.bootstrap_pb2", DEV_HINT)
    from envoy.config.bootstrap.v3 import bootstrap_pb2  # type: ignore[import-untyped,unused-ignore]

    config = envoy_config()
    for node in walk(config):
        if "@type" in node:
            _import_proto_package(node["@type"].split("/", 1)[1])
    # Strict: unknown fields, wrong types and bad enum names all raise here.
    bootstrap = json_format.ParseDict(config, bootstrap_pb2.Bootstrap())
    problems: list[str] = []
    _check_pgv(bootstrap, "bootstrap", problems)
    assert not problems, "\n".join(problems)


def test_envoy_schema_check_catches_a_typo() -> None:
    require("envoy.config.bootstrap.v3.bootstrap_pb2", DEV_HINT)
    from envoy.config.bootstrap.v3 import bootstrap_pb2  # type: ignore[import-untyped,unused-ignore]

    config = envoy_config()
    for node in walk(config):
        if "@type" in node:
            _import_proto_package(node["@type"].split("/", 1)[1])
    config["static_resources"]["clusters"][0]["conect_timeout"] = "5s"
    with pytest.raises(json_format.ParseError):
        json_format.ParseDict(config, bootstrap_pb2.Bootstrap())


# ---------------------------------------------------------------- Envoy: structure


def _hcm(listener: Doc) -> Doc:
    filters = listener["filter_chains"][0]["filters"]
    hcm = next(f for f in filters if f["name"] == "envoy.filters.network.http_connection_manager")
    config = hcm["typed_config"]
    assert isinstance(config, dict)
    return config


def _listener(name: str) -> Doc:
    listeners = envoy_config()["static_resources"]["listeners"]
    found = next(entry for entry in listeners if entry["name"] == name)
    assert isinstance(found, dict)
    return found


def test_envoy_routes_and_health_filter_reference_existing_clusters() -> None:
    config = envoy_config()
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    used: set[str] = set()
    for node in walk(config["static_resources"]["listeners"]):
        if isinstance(node.get("cluster"), str):
            used.add(node["cluster"])
        if isinstance(node.get("cluster_name"), str):
            used.add(node["cluster_name"])
        used.update(node.get("cluster_min_healthy_percentages", {}))
    assert used and used <= clusters.keys(), used - clusters.keys()
    for name, cluster in clusters.items():
        assert cluster["load_assignment"]["cluster_name"] == name
    for name in ("gateway_http", "gateway_grpc"):
        assert clusters[name]["health_checks"], f"{name} has no active health check"
    assert clusters["gateway_grpc"]["health_checks"][0]["grpc_health_check"]["service_name"] == GATEWAY_SERVICE
    grpc_opts = clusters["gateway_grpc"]["typed_extension_protocol_options"]
    assert "http2_protocol_options" in next(iter(grpc_opts.values()))["explicit_http_config"]


def test_envoy_ingress_routes_v1_and_gateway_api_with_stream_friendly_timeouts() -> None:
    hcm = _hcm(_listener("ingress_https"))
    assert hcm["request_timeout"] == "0s"
    assert int(hcm["stream_idle_timeout"].rstrip("s")) >= 300
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    by_prefix = {r["match"]["prefix"]: r for r in routes}
    v1 = by_prefix["/v1/"]["route"]
    assert v1["cluster"] == "gateway_http"
    assert v1["timeout"] == "0s" and int(v1["idle_timeout"].rstrip("s")) >= 300
    assert "retry_policy" not in v1, "streamed POSTs must not be retried"
    grpc = by_prefix[f"/{GATEWAY_SERVICE}/"]["route"]
    assert grpc["cluster"] == "gateway_grpc" and grpc["timeout"] == "0s"
    names = [f["name"] for f in hcm["http_filters"]]
    assert names[-1] == "envoy.filters.http.router"
    assert "envoy.filters.http.buffer" not in names, "buffering breaks SSE"
    assert hcm["access_log"], "access log missing"
    log_fields = str(hcm["access_log"]).lower()
    assert "authorization" not in log_fields, "API keys must never be logged"


def test_envoy_ingress_terminates_tls_with_mounted_cert_paths() -> None:
    chain = _listener("ingress_https")["filter_chains"][0]
    tls = chain["transport_socket"]["typed_config"]
    assert tls["@type"].endswith("DownstreamTlsContext")
    cert = tls["common_tls_context"]["tls_certificates"][0]
    assert cert["certificate_chain"]["filename"] == "/etc/envoy/tls/tls.crt"
    assert cert["private_key"]["filename"] == "/etc/envoy/tls/tls.key"
    assert "h2" in tls["common_tls_context"]["alpn_protocols"]
    assert envoy_config()["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_envoy_transcoder_descriptor_names_the_gateway_service() -> None:
    hcm = _hcm(_listener("ingress_https"))
    transcoder = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.grpc_json_transcoder")
    config = transcoder["typed_config"]
    assert config["services"] == [GATEWAY_SERVICE]
    assert config["proto_descriptor"] == "/etc/envoy/" + DESCRIPTOR.name
    fds = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR.read_bytes())
    services = {f"{f.package}.{s.name}": s for f in fds.file for s in f.service}
    assert GATEWAY_SERVICE in services
    methods = {m.name for m in services[GATEWAY_SERVICE].method}
    assert {"CreateChatCompletion", "CreateCompletion", "ListModels", "CloseConversation"} <= methods
    # Every import must be in the set, or Envoy refuses to load it.
    names = {f.name for f in fds.file}
    assert all(dep in names for f in fds.file for dep in f.dependency)
    # No google.api.http options: the transcoder needs auto_mapping to expose the methods.
    assert config["auto_mapping"] is True


def test_descriptor_set_is_up_to_date(tmp_path: Path) -> None:
    if not (ROOT / ".venv" / "bin" / "buf").exists() and shutil.which("buf") is None:
        missing("buf", DEV_HINT)
    out = tmp_path / "kvbridge.pb"
    env_buf = {} if (ROOT / ".venv" / "bin" / "buf").exists() else {"BUF": "buf"}
    subprocess.run(
        [str(DEPLOY / "envoy" / "build-descriptor.sh"), str(out)],
        check=True,
        capture_output=True,
        env={**_base_env(), **env_buf},
    )
    assert out.read_bytes() == DESCRIPTOR.read_bytes(), "stale: run deploy/envoy/build-descriptor.sh"


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG")}


# ---------------------------------------------------------------- Kubernetes


def kustomization() -> Doc:
    doc = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def manifests() -> list[Doc]:
    return [d for res in kustomization()["resources"] for d in load_all(DEPLOY / res)]


def _by_kind(kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def _workloads() -> list[Doc]:
    return [d for d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]


def test_kustomization_lists_every_manifest() -> None:
    listed = {DEPLOY / r for r in kustomization()["resources"]}
    assert listed == set((DEPLOY / "k8s").glob("*.yaml"))


def test_manifests_match_kubernetes_schemas() -> None:
    kv = require("kubernetes_validate", DEV_HINT)
    for doc in manifests():
        kv.validate(doc, K8S_VERSION, strict=True)


def test_manifests_have_required_fields() -> None:
    for doc in manifests():
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), where
        if doc["kind"] in ("Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "PersistentVolumeClaim"):
            assert doc.get("spec"), where
        if doc["kind"] == "StatefulSet":
            assert doc["spec"]["serviceName"] in _by_kind("Service"), where


def test_selectors_match_pod_labels_and_services_find_pods() -> None:
    pods = []
    for w in _workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), w["metadata"]["name"]
        pods.append((labels, w))
    for kind, key in (("Service", None), ("PodDisruptionBudget", "matchLabels")):
        for name, doc in _by_kind(kind).items():
            selector = doc["spec"]["selector"] if key is None else doc["spec"]["selector"][key]
            matches = [w for labels, w in pods if selector.items() <= labels.items()]
            assert matches, f"{kind}/{name} selects no pod"
            if kind == "Service":
                port_names = {
                    p.get("name")
                    for w in matches
                    for c in w["spec"]["template"]["spec"]["containers"]
                    for p in c.get("ports", [])
                }
                for port in doc["spec"]["ports"]:
                    target = port.get("targetPort", port["port"])
                    assert not isinstance(target, str) or target in port_names, f"{name}: port {target}"


def test_every_container_has_probes_and_resources() -> None:
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            where = f"{w['metadata']['name']}/{c['name']}"
            assert "readinessProbe" in c and "livenessProbe" in c, where
            assert c["resources"]["requests"].keys() >= {"cpu", "memory"}, where
            assert "memory" in c["resources"].get("limits", {}), where


def test_grpc_servers_use_grpc_probes() -> None:
    for name, port in (("registry", 50051), ("lease", 50052)):
        c = _by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"][0]
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert c["livenessProbe"]["grpc"]["port"] == port


def test_replicas_and_disruption_budgets() -> None:
    deployments = _by_kind("Deployment")
    for name, replicas in (("registry", 2), ("lease", 2), ("gateway", 2)):
        assert deployments[name]["spec"]["replicas"] >= replicas
    assert _by_kind("StatefulSet")["etcd"]["spec"]["replicas"] == 3
    pdbs = _by_kind("PodDisruptionBudget")
    assert pdbs["etcd"]["spec"]["minAvailable"] == 2, "etcd keeps quorum during voluntary disruption"
    assert {"registry", "lease", "gateway", "envoy"} <= pdbs.keys()


def _generated() -> dict[str, set[str]]:
    """Names of the ConfigMaps/Secrets kustomize generates, each with its keys."""
    out: dict[str, set[str]] = {}
    for gen in [*kustomization().get("configMapGenerator", []), *kustomization().get("secretGenerator", [])]:
        keys = {f.split("=", 1)[0] if "=" in f else Path(f).name for f in gen.get("files", [])}
        for env_file in gen.get("envs", []):
            keys |= _secret_env_keys(Path(env_file).name)
        out[gen["name"]] = keys
    return out


_SECRETS_CACHE: dict[str, Path] = {}


def _generated_secrets() -> Path:
    """Runs the real secret generator once into a temp dir (needs openssl)."""
    if "dir" not in _SECRETS_CACHE:
        if shutil.which("openssl") is None:
            missing("openssl", "apt-get install openssl")
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="kvbridge-secrets-")) / "secrets"
        subprocess.run([str(DEPLOY / "scripts" / "gen-secrets.sh"), str(out)], check=True, capture_output=True)
        _SECRETS_CACHE["dir"] = out
    return _SECRETS_CACHE["dir"]


def _secret_env_keys(name: str) -> set[str]:
    lines = (_generated_secrets() / name).read_text().splitlines()
    return {line.split("=", 1)[0] for line in lines if "=" in line}


def test_referenced_configmaps_secrets_services_and_claims_exist() -> None:
    generated = _generated()
    plain = {d["metadata"]["name"]: d for d in manifests() if d["kind"] in ("ConfigMap", "Secret")}
    services = _by_kind("Service")
    claims = _by_kind("PersistentVolumeClaim")

    def has_key(name: str, key: str) -> bool:
        if name in generated:
            return key in generated[name]
        doc = plain[name]
        return key in {**doc.get("data", {}), **doc.get("stringData", {})}

    for w in _workloads():
        spec = w["spec"]["template"]["spec"]
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                assert vol["configMap"]["name"] in generated | plain
            if "secret" in vol:
                assert vol["secret"]["secretName"] in generated | plain
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims
        for c in spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {
                t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])
            }
            for src in c.get("envFrom", []):
                ref = src.get("configMapRef") or src.get("secretRef")
                assert ref["name"] in generated | plain
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef") or env.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert has_key(ref["name"], ref["key"]), f"{ref} in {w['metadata']['name']}"
                # host:port addresses of in-cluster peers must name a Service exposing that port.
                for host, port in re.findall(r"(?:^|[/,])([a-z][a-z0-9-]*):(\d+)", str(env.get("value", ""))):
                    if host in ("localhost",):
                        continue
                    svc_name = host if host in services else host.split(".")[-1] if "." in host else host
                    assert svc_name in services, f"{host} in {w['metadata']['name']} is no Service"
                    assert int(port) in {p["port"] for p in services[svc_name]["spec"]["ports"]}, host


def test_config_map_peers_resolve_to_services() -> None:
    services = _by_kind("Service")
    data = _by_kind("ConfigMap")["kvbridge-config"]["data"]
    for ep in data["KVBRIDGE_ETCD_ENDPOINTS"].split(","):
        pod, svc = ep.split(":")[0].split(".")
        assert svc in services and pod.startswith(services[svc]["metadata"]["name"] + "-")
    assert "jaeger" in services


def test_envoy_upstreams_exist_in_k8s_and_compose() -> None:
    services = _by_kind("Service")
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    for cluster in envoy_config()["static_resources"]["clusters"]:
        for ep in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
            addr = ep["endpoint"]["address"]["socket_address"]
            host, port = addr["address"], addr["port_value"]
            assert port in {p["port"] for p in services[host]["spec"]["ports"]}, f"k8s {host}:{port}"
            assert host in compose, f"compose has no {host}"
    assert services["gateway"]["spec"]["clusterIP"] == "None", "Envoy must see every gateway pod"


def test_envoy_deployment_mounts_descriptor_and_tls() -> None:
    generated = _generated()
    assert {"envoy.yaml", "kvbridge.pb"} <= generated["envoy-config"]
    assert {"tls.crt", "tls.key"} <= generated["envoy-tls"]
    spec = _by_kind("Deployment")["envoy"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {"/etc/envoy", "/etc/envoy/tls"} <= mounts


# ---------------------------------------------------------------- compose and secrets


def test_compose_wiring() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {
        "etcd-1",
        "etcd-2",
        "etcd-3",
        "registry",
        "lease-1",
        "lease-2",
        "gateway",
        "envoy",
        "jaeger",
        "prefill",
        "decode",
    } <= services.keys()
    endpoints = services["registry"]["environment"]["KVBRIDGE_ETCD_ENDPOINTS"].split(",")
    assert {e.split(":")[0] for e in endpoints} == {"etcd-1", "etcd-2", "etcd-3"}
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./envoy/"):
                assert (DEPLOY / source).exists(), source
        if name not in ("envoy", "jaeger"):
            assert "healthcheck" in svc, f"{name} has no healthcheck"
    kv = {k: str(v) for k, v in services["prefill"].items() if k == "command"}
    assert "kv_producer" in kv["command"] and "bidirectional_kv_xfer" in kv["command"]
    assert "kv_consumer" in str(services["decode"]["command"])
    leases = {services[n]["environment"]["KVBRIDGE_LEASE_ADVERTISE_ADDRESS"] for n in ("lease-1", "lease-2")}
    assert len(leases) == 2, "each lease replica must advertise its own address"


def test_generated_secrets_are_usable() -> None:
    import json

    out = _generated_secrets()
    from kvbridge_services.common.auth import Authenticator, Role

    auth = Authenticator.from_file(out / "api-keys.json")  # the services' own parser accepts the file
    keys = json.loads((out / "api-keys.json").read_text())
    principals = {auth.authenticate_key(k).name: auth.authenticate_key(k) for k in keys}
    assert principals["gateway"].roles == {Role.GATEWAY} and principals["connector"].roles == {Role.ENGINE}
    assert principals["registry"].roles == {Role.OPERATOR}
    assert principals["demo-client"].tenant == "demo" and principals["demo-client"].roles == {Role.TENANT}
    env = _secret_env_keys("service.env")
    assert {"KVBRIDGE_GATEWAY_CONTROL_API_KEY", "KVBRIDGE_CONNECTOR_API_KEY", "KVBRIDGE_HASH_SECRET"} <= env
    # The engines' env file: the connector's key under the connector's setting name, the same secret.
    values = dict(line.split("=", 1) for line in (out / "service.env").read_text().splitlines() if "=" in line)
    engine = dict(line.split("=", 1) for line in (out / "engine.env").read_text().splitlines() if "=" in line)
    assert engine == {
        "KVBRIDGE_API_KEY": values["KVBRIDGE_CONNECTOR_API_KEY"],
        "KVBRIDGE_HASH_SECRET": values["KVBRIDGE_HASH_SECRET"],
    }
    assert principals["connector"] == auth.authenticate_key(engine["KVBRIDGE_API_KEY"])
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "tls.crt")], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stderr


def test_validators_reject_broken_configs() -> None:
    """The schema checks above are only worth something if they fail on bad input."""
    require("envoy.config.bootstrap.v3.bootstrap_pb2", DEV_HINT)
    kv = require("kubernetes_validate", DEV_HINT)
    from envoy.config.bootstrap.v3 import bootstrap_pb2  # type: ignore[import-untyped,unused-ignore]

    config = envoy_config()
    for node in walk(config):
        if "@type" in node:
            _import_proto_package(node["@type"].split("/", 1)[1])
    del config["static_resources"]["clusters"][0]["health_checks"][0]["timeout"]
    problems: list[str] = []
    _check_pgv(json_format.ParseDict(config, bootstrap_pb2.Bootstrap()), "bootstrap", problems)
    assert any(p.endswith("health_checks[0].timeout: required") for p in problems), problems

    deployment = _by_kind("Deployment")["registry"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSION, strict=True)
