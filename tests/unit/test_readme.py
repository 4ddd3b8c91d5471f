"""README.md (issue 31): the charts it shows exist, its vLLM support matrix is docs/connector.md's and the connector's
supported versions, and it links the migration guide and the comparison page."""

from __future__ import annotations

import re
from pathlib import Path

from kvbridge_connector import compat

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _matrix(text: str) -> list[str]:
    """The rows of the table under the '## Supported vLLM versions' heading."""
    section = text.split("## Supported vLLM versions", 1)[1]
    rows: list[str] = []
    for line in section.lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_every_image_the_readme_shows_exists_and_has_a_line() -> None:
    images = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", README)
    assert len(images) >= 3
    for image in images:
        assert (ROOT / image).is_file(), image
        follows = README.split(f"({image})", 1)[1].lstrip("\n").split("\n", 1)[0]
        assert follows.strip() and not follows.startswith(("!", "#")), f"{image} has no line under it"


def test_support_matrix_is_connector_md_s_and_the_supported_versions() -> None:
    readme_rows = _matrix(README)
    assert readme_rows == _matrix((ROOT / "docs" / "connector.md").read_text())
    versions = {row.split("|")[1].strip() for row in readme_rows[2:]}
    assert versions == set(compat.SUPPORTED_VLLM_VERSIONS)


def test_migration_guide_and_comparison_are_linked() -> None:
    for page in ("docs/migrating-from-vllm-proxy.md", "docs/comparison.md"):
        assert (ROOT / page).is_file() and f"`{page}`" in README, page
