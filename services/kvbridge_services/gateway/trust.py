"""Does an engine hold this gateway's deployment secret? (kvbridge.secret's canary in its registration)

A kvbridge connector announces ``kvbridge-secret:<canary>`` among its engine capabilities. A decode engine
with another secret hashes its entries under another chain (no lookup would ever match: 0 % reuse and no
error) and cannot verify the gateway's signed ``kvbridge_*`` fields, so the gateway refuses reuse with it
(``declined:secret_mismatch``), logs it at ERROR once per engine and counts every refusal
(``kvbridge_gateway_secret_mismatch_total{engine}``). Stock vLLM engines (no connector capability) announce
nothing: the gateway itself hashes for them (compatibility mode).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from kvbridge import secret as kvsecret
from kvbridge.types.v1 import types_pb2

from .reuse import CONNECTOR_CAPABILITY

log = logging.getLogger(__name__)
_MAX_REPORTED = 4096  # bound on the (engine, canary) pairs already logged


def secret_mismatch(capabilities: list[str] | tuple[str, ...], canary: str) -> bool:
    """True when an engine with a kvbridge connector announces no canary or another one than ``canary``."""
    caps = list(capabilities)
    if CONNECTOR_CAPABILITY not in caps:
        return False
    return kvsecret.canary_of(caps) != canary


class SecretCanary:
    """This gateway's canary, the check against an engine record, and the loud report of a mismatch."""

    def __init__(self, secret: bytes, counter: Counter) -> None:
        self.canary = kvsecret.canary(secret)
        self._counter = counter
        self._reported: set[tuple[str, str | None]] = set()

    def mismatch(self, record: types_pb2.Engine | None) -> bool:
        """For a turn routed to this decode engine: True (counted, logged once) when reuse must be refused."""
        if not self.check(record):
            return False
        assert record is not None
        self._counter.labels(record.engine_id).inc()
        return True

    def check(self, record: types_pb2.Engine | None) -> bool:
        """The same test, not counted: logs at ERROR the first time an engine (with its canary) mismatches."""
        if record is None or not secret_mismatch(tuple(record.capabilities), self.canary):
            return False
        theirs = kvsecret.canary_of(record.capabilities)
        if (record.engine_id, theirs) not in self._reported and len(self._reported) < _MAX_REPORTED:
            self._reported.add((record.engine_id, theirs))
            log.error(
                "engine %s holds another deployment secret than this gateway (its canary %s, ours %s): no "
                "reuse with it until KVBRIDGE_HASH_SECRET is the same hex value on both",
                record.engine_id,
                theirs or "absent",
                self.canary,
            )
        return True
