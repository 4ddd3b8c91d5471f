"""The one rule per identifier kind, used by every service, the gateway, the keys-file loader and the connector.

Each rule is an alphabet and a length. The same string is accepted or refused everywhere: a tenant
``acme corp`` is refused by the gateway's HTTP front door, the lease manager and the registry alike,
with INVALID_ARGUMENT / INVALID_FIELD naming the field, never accepted by one and refused by the next
(which used to surface as ``declined:registry_unavailable``).

==================  =========================  ======  ==========================================
kind                alphabet                   length  examples
==================  =========================  ======  ==========================================
tenant              ``[A-Za-z0-9._:-]``        1..128  ``acme``, ``team-7.eu``
engine id           ``[A-Za-z0-9._:-]``        1..128  ``decode-0``, ``10.0.0.5:8100``
request id          ``[A-Za-z0-9._:-]``        1..128  idempotency keys (``gw-<uuid hex>``)
capability          ``[A-Za-z0-9._:-]``        1..128  ``kvbridge-secret:3f9a...``
model               printable ASCII, no space  1..256  ``Qwen/Qwen3-0.6B``, ``org/model@rev``
engine request id   printable ASCII, no space  1..256  vLLM's ``cmpl-...-0``
conversation key    printable ASCII            1..256  ``chat 42``
==================  =========================  ======  ==========================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from kvbridge.errors import invalid_field

_NAME = "A-Za-z0-9._:-"


@dataclass(frozen=True, slots=True)
class IdRule:
    """One identifier kind: a full-match pattern and the sentence that describes it in errors and docs."""

    kind: str
    pattern: re.Pattern[str]
    description: str
    max_len: int

    def valid(self, value: object) -> TypeGuard[str]:
        """True when ``value`` is a string of this kind (no exception: for hot paths and untrusted input)."""
        return isinstance(value, str) and self.pattern.fullmatch(value) is not None

    def check(self, field: str, value: object) -> str:
        """``value`` if valid; else INVALID_ARGUMENT / INVALID_FIELD naming ``field``."""
        if not isinstance(value, str) or self.pattern.fullmatch(value) is None:
            raise invalid_field(field, f"{self.kind} must be {self.description}")
        return value

    def check_optional(self, field: str, value: str) -> str:
        """Empty (meaning "the default", e.g. the caller's own tenant) or valid."""
        return self.check(field, value) if value else value


def _name_rule(kind: str) -> IdRule:
    return IdRule(kind, re.compile(f"[{_NAME}]{{1,128}}"), f"1..128 characters of [{_NAME}]", 128)


TENANT = _name_rule("tenant")
ENGINE_ID = _name_rule("engine id")
REQUEST_ID = _name_rule("request id")
CAPABILITY = _name_rule("capability")
MODEL = IdRule("model", re.compile(r"[!-~]{1,256}"), "1..256 printable ASCII characters without spaces", 256)
ENGINE_REQUEST_ID = IdRule(
    "engine request id", re.compile(r"[!-~]{1,256}"), "1..256 printable ASCII characters without spaces", 256
)
CONVERSATION_KEY = IdRule("conversation key", re.compile(r"[ -~]{1,256}"), "1..256 printable ASCII characters", 256)

ALL: tuple[IdRule, ...] = (TENANT, ENGINE_ID, REQUEST_ID, CAPABILITY, MODEL, ENGINE_REQUEST_ID, CONVERSATION_KEY)

__all__ = [
    "ALL",
    "CAPABILITY",
    "CONVERSATION_KEY",
    "ENGINE_ID",
    "ENGINE_REQUEST_ID",
    "IdRule",
    "MODEL",
    "REQUEST_ID",
    "TENANT",
]
