"""The shipped etcd's space settings (docs/etcd-space.md): compose and Kubernetes agree, the quota holds the history
periodic compaction keeps at the documented turn rate, and the k8s volume holds a defragmentation's copy."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]

from kvbridge_services.registry.config import RegistrySettings

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
GIB = 1024**3
_UNITS = {"s": 1, "m": 60, "h": 3600}
_SIZES = {"Gi": GIB, "Mi": 1024**2}


def _compose_env() -> dict[str, str]:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return {k: str(v) for k, v in compose["x-etcd-env"].items()}


def _k8s_etcd() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "etcd.yaml").read_text()) if d]
    found: dict[str, Any] = next(d for d in docs if d["kind"] == "StatefulSet")
    return found


def _k8s_env() -> dict[str, str]:
    container = _k8s_etcd()["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: str(e["value"]) for e in container["env"] if "value" in e}


def _seconds(retention: str) -> int:
    m = re.fullmatch(r"(\d+)([smh])", retention)
    assert m, f"retention {retention!r}: give it as a duration (5m)"
    return int(m[1]) * _UNITS[m[2]]


def test_compose_and_kubernetes_ship_the_same_space_settings() -> None:
    names = ("ETCD_AUTO_COMPACTION_MODE", "ETCD_AUTO_COMPACTION_RETENTION", "ETCD_QUOTA_BACKEND_BYTES")
    compose, k8s = _compose_env(), _k8s_env()
    assert {n: compose[n] for n in names} == {n: k8s[n] for n in names}
    assert compose["ETCD_AUTO_COMPACTION_MODE"] == "periodic"


def test_the_quota_holds_the_documented_rate() -> None:
    """Periodic compaction keeps up to 2R of writes and the registry's idempotency records (half of a turn's bytes)
    live T/2 to T more: at 227 turns/s of 30.2 KB (24K tokens, block 16) beside 100k live conversations of 15.5 KB,
    with 10 % headroom, the quota is not reached (docs/etcd-space.md's table)."""
    env = _compose_env()
    quota = int(env["ETCD_QUOTA_BACKEND_BYTES"])
    idempotency_ttl_s = RegistrySettings().idempotency_ttl_s
    held_s = idempotency_ttl_s / 2 + 2 * _seconds(env["ETCD_AUTO_COMPACTION_RETENTION"])
    assert quota <= 8 * GIB, "etcd warns above 8 GiB"
    needed = 100_000 * 15.5e3 + held_s * 227 * 30.2e3
    assert needed <= 0.9 * quota, f"{needed / GIB:.2f} GiB of live data and history in a {quota / GIB:.0f} GiB quota"


def test_the_kubernetes_volume_holds_a_defragmentation_copy() -> None:
    env = _k8s_env()
    quota = int(env["ETCD_QUOTA_BACKEND_BYTES"])
    claim = _k8s_etcd()["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    m = re.fullmatch(r"(\d+)(Gi|Mi)", claim)
    assert m, claim
    assert int(m[1]) * _SIZES[m[2]] >= 2 * quota, f"{claim}: a defragmentation writes a copy of the database"
