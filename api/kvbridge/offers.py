"""The read deadline of a pull offer (ARCHITECTURE invariant 6), shared by the gateway and the connector.

A NIXL READ is one-sided: D cannot refuse it. D promises instead (its engine record's
``offer_window``) to keep an entry's blocks at least that long, plus the index lag bound, after the
entry stops being offered. The gateway hands P what is left of that window when it sends the offer
(``kvbridge_offer_ttl_ms``: the window less the time since its lookup); P measures the rest on its
own clock from the request's arrival and declines (recomputes) a READ that would start later. Only
durations cross hosts, so no two clocks need to agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

KV_PARAMS_OFFER_TTL_MS = "kvbridge_offer_ttl_ms"
# The source engine's incarnation (its node lease id in the registry): a decode engine restarted under the same
# engine id has new NIXL memory registrations, so P drops what it cached of the old process (its handshake) when
# an offer names another incarnation of an engine id it has read from.
KV_PARAMS_SOURCE_INCARNATION = "kvbridge_source_incarnation"
# P starts no READ this close to its deadline: the READ itself must end before D may free the blocks
# (D's grace exceeds offer window + index lag by at least 1 s).
READ_START_MARGIN_S = 0.25
# Longest window an offer may carry (a bad value must not turn into an unbounded one).
MAX_OFFER_TTL_MS = 300_000


def offer_ttl_ms(window_s: float, looked_up_s_ago: float) -> int:
    """What the gateway sends P: the engine's offer window less the age of the lookup (<= 0: too late)."""
    return math.floor((window_s - max(0.0, looked_up_s_ago)) * 1000)


def read_deadline(params: Mapping[str, Any], arrival_time: float) -> float | None:
    """P's deadline (same clock as ``arrival_time``, Unix seconds) to start the READ; None when the offer
    carries no valid deadline."""
    ttl = params.get(KV_PARAMS_OFFER_TTL_MS)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= MAX_OFFER_TTL_MS:
        return None
    return arrival_time + ttl / 1000


def too_late(deadline: float, now: float) -> bool:
    """Whether a READ starting ``now`` could outlive D's promise."""
    return now + READ_START_MARGIN_S >= deadline
