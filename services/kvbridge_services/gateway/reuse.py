"""The reuse decision: may this turn's prefill pull D's KV, and which? One pure function and one reason enum.

:func:`decide` takes everything the decision depends on (the request's features, the prompt length,
the lookup answer, the gateway's state of the source engine, whether a pull of it is in flight,
the thresholds, the clock) and returns a :class:`ReusePlan` or a :class:`NoReuse` reason. It does no
I/O. The router gathers the inputs (tokenize, lookup), calls it, and does what the plan says (the
registry consume of a single-use entry, the prefill); the outcomes of those steps are reasons of the
same enum. The ``x-kvbridge-reuse`` header, the ``kvbridge_gateway_reuse_total`` metric and the turn
span's attributes all come from :class:`ReuseVerdict`, which holds a member of it (or a hit).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge import offers
from kvbridge.registry.v1 import registry_pb2

from . import kvparams
from .requests import CHAT_TEMPLATE_FIELDS

# Engines running the kvbridge connector register with it (kvbridge_connector.scheduler): their D holds an
# entry's blocks for its lease, for any number of reads. Without it (stock vLLM, registered by the gateway)
# D frees the blocks on P's first read notification: each entry serves one pull (compatibility mode).
CONNECTOR_CAPABILITY = "kvbridge_connector"


class NoReuse(enum.Enum):
    """Why a turn's prefill pulls no KV (docs/gateway.md, "Reuse verdicts", documents every member).

    The value is the reason in the verdict header (``declined:<value>``), the metric's ``reason`` label
    and the span's ``kvbridge.reuse.reason``. The three misses report as plain ``miss`` in the header and
    metric (reason ""); the span carries their value too.
    """

    # -- misses: nothing to reuse ---------------------------------------------------------------
    NOT_REQUESTED = "not_requested"  # reuse off, no control plane, or no conversation key (content lookup off)
    SHORT_PROMPT = "short_prompt"  # the prompt is not longer than reuse_threshold_tokens
    NOT_FOUND = "not_found"  # the registry has no entry that shares a block with the prompt
    # -- the request: its KV is shaped by more than the hashed tokens -----------------------------
    MULTIMODAL_INPUT = "multimodal_input"  # image/audio/video/file content parts (placeholders hash alike)
    LORA_ADAPTER = "lora_adapter"  # the model name is a LoRA adapter (or alias), not the engines' base model
    UNSUPPORTED_FIELD = "unsupported_field"  # a body field outside the allow-list (it may change P's prompt)
    SECRET_MISMATCH = "secret_mismatch"  # the decode engine holds another deployment secret (gateway/trust.py)
    # -- the gateway could not ask ---------------------------------------------------------------
    TOKENIZE_FAILED = "tokenize_failed"  # P's /tokenize failed
    REGISTRY_UNAVAILABLE = "registry_unavailable"  # the lookup (or the consume) call failed
    # -- the lookup's own verdicts ----------------------------------------------------------------
    EXPIRED = "expired"  # the entry's deadline passed, or is within the margin
    MISMATCH = "mismatch"  # the entry's chain diverges from the prompt's in its first block
    BELOW_THRESHOLD = "below_threshold"  # the verified prefix (floored to a block) is below the threshold
    ENGINE_GONE = "engine_gone"  # the entry's engine is not registered
    ENGINE_RESTARTED = "engine_restarted"  # the entry's engine registered again since (a new process)
    INDEX_STALE = "index_stale"  # the answering index lags the store by more than its bound
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"  # the entry's (or engine's) block size differs from P's
    LOOKUP = "lookup"  # a lookup verdict this gateway does not know
    # -- the source engine and its entry ----------------------------------------------------------
    NO_KV_ENDPOINT = "no_kv_endpoint"  # the engine record has no NIXL side-channel host/port
    NO_OFFER_WINDOW = "no_offer_window"  # a connector engine that promises no offer window (older connector)
    OFFER_EXPIRED = "offer_expired"  # the lookup is older than the engine's offer window (or P said so)
    ENGINE_UNHEALTHY = "engine_unhealthy"  # the gateway's health checks say the source D is down
    BUSY = "busy"  # this gateway is pulling the same blocks for another turn now
    BAD_LOCATION = "bad_location"  # the location's block ids do not cover the verified prefix
    CONSUMED = "consumed"  # a single-use entry another turn (any replica) already took from the registry
    # -- the prefill with D's params --------------------------------------------------------------
    RECOMPUTED = "recomputed"  # P answered but pulled nothing (it recomputed)
    PREFILL_FAILED = "prefill_failed"  # the prefill with D's params failed; retried without them
    PREFILL_TIMEOUT = "prefill_timeout"  # ... timed out; retried without them
    # -- the placement cost model (placement.py; only with placement on) -------------------------
    RECOMPUTE_CHEAPER = "recompute_cheaper"  # estimated faster to recompute the verified history on P than pull it
    LOCAL_PREFILL_FAILED = "local_prefill_failed"  # the holder's local prefill failed; recomputed through P and D

    @property
    def is_miss(self) -> bool:
        return self in _MISSES

    @property
    def verdict(self) -> str:
        return "miss" if self.is_miss else "declined"

    @property
    def label(self) -> str:
        """``miss`` or ``declined:<value>``: the verdict header's first part."""
        return "miss" if self.is_miss else f"declined:{self.value}"

    @property
    def metric_reason(self) -> str:
        return "" if self.is_miss else self.value


_MISSES = frozenset({NoReuse.NOT_REQUESTED, NoReuse.SHORT_PROMPT, NoReuse.NOT_FOUND})

LOOKUP_REASONS: Mapping[int, NoReuse] = {
    registry_pb2.LOOKUP_VERDICT_NOT_FOUND: NoReuse.NOT_FOUND,
    registry_pb2.LOOKUP_VERDICT_EXPIRED: NoReuse.EXPIRED,
    registry_pb2.LOOKUP_VERDICT_MISMATCH: NoReuse.MISMATCH,
    registry_pb2.LOOKUP_VERDICT_BELOW_THRESHOLD: NoReuse.BELOW_THRESHOLD,
    registry_pb2.LOOKUP_VERDICT_ENGINE_GONE: NoReuse.ENGINE_GONE,
    registry_pb2.LOOKUP_VERDICT_BLOCK_SIZE_MISMATCH: NoReuse.BLOCK_SIZE_MISMATCH,
    **{
        getattr(registry_pb2, name): reason
        for name, reason in (
            ("LOOKUP_VERDICT_ENGINE_RESTARTED", NoReuse.ENGINE_RESTARTED),
            ("LOOKUP_VERDICT_INDEX_STALE", NoReuse.INDEX_STALE),
        )
        if hasattr(registry_pb2, name)
    },
}


@dataclass(slots=True)
class ReuseVerdict:
    """A turn's verdict: a hit (``outcome`` None) or a :class:`NoReuse` reason, and its token counts."""

    outcome: NoReuse | None = NoReuse.NOT_REQUESTED
    tokens: int = 0  # verified tokens (hit: those P pulled, or those the holder's prefix cache served)
    prompt_tokens: int = 0
    # A hit served in place: the holder D's own prefix cache held the history, nothing was pulled (placement).
    in_place: bool = False
    # The placement's ``<choice>;reason=<why>`` (the x-kvbridge-placement header); "" with placement off.
    placement: str = ""

    @property
    def hit(self) -> bool:
        return self.outcome is None

    @property
    def pulled_tokens(self) -> int:
        """Tokens whose KV P pulled from D (0 unless a hit that was not served in place)."""
        return self.tokens if self.outcome is None and not self.in_place else 0

    @property
    def verdict(self) -> str:
        return "hit" if self.outcome is None else self.outcome.verdict

    @property
    def label(self) -> str:
        """``hit``, ``miss`` or ``declined:<reason>``."""
        return "hit" if self.outcome is None else self.outcome.label

    @property
    def metric_reason(self) -> str:
        return "" if self.outcome is None else self.outcome.metric_reason

    @property
    def span_reason(self) -> str:
        return "" if self.outcome is None else self.outcome.value

    def header(self) -> str:
        return f"{self.label};tokens={self.tokens}"


# -- request features ---------------------------------------------------------------------------------
# Body fields that do not change the prompt P computes beyond what the gateway tokenizes: the prompt
# itself and the fields the tokenization takes into account (local rendering handles or falls back to P's
# /tokenize for them, and /tokenize receives them), the gateway's own fields, and sampling and output
# options (they shape the answer, not the prompt's KV). Anything else declines reuse: for example
# truncate_prompt_tokens, documents, mm_processor_kwargs, prompt_embeds, reasoning_effort (some chat
# templates read it), suffix. Stock P (compatibility mode) has no prefix-digest check to catch a prompt
# that differs from the tokenized one, so the gateway must not guess.
TOKENIZED_FIELDS = frozenset({"model", "messages", "prompt", "cache_salt", *CHAT_TEMPLATE_FIELDS})
GATEWAY_FIELDS = frozenset({"conversation_id", "session_id", "kv_transfer_params", "stream", "stream_options"})
SAMPLING_FIELDS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "user",
        "response_format",
        "tool_choice",
        "parallel_tool_calls",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "return_token_ids",
        "echo",
        "bad_words",
        "allowed_token_ids",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "priority",
        "request_id",
        "metadata",
        "store",
        "service_tier",
        "logits_processors",
        "return_tokens_as_token_ids",
    }
)
ALLOWED_FIELDS = TOKENIZED_FIELDS | GATEWAY_FIELDS | SAMPLING_FIELDS


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What of the request, beyond its tokens, shapes P's prompt KV."""

    multimodal: bool = False
    unsupported_field: str = ""  # the first body field outside ALLOWED_FIELDS ("" when none)
    lora_adapter: bool = False
    secret_mismatch: bool = False  # D's connector announced another deployment secret's canary

    @property
    def covered(self) -> bool:
        """Whether the hash chain covers everything that shapes this turn's KV (so it may also be registered)."""
        return not (self.multimodal or self.lora_adapter)


def unsupported_field(body: Mapping[str, Any]) -> str:
    """The first body field outside the allow-list, or ""."""
    for name in body:
        if name not in ALLOWED_FIELDS:
            return str(name)
    if body.get("tool_choice") == "none":  # vLLM may drop the tools from the prompt then (a server option)
        return "tool_choice"
    return ""


def has_multimodal_content(body: Mapping[str, Any]) -> bool:
    """Whether a chat message has a content part other than text (image, audio, video, file, embeds)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type", "text") != "text":
                    return True
    return False


def request_features(body: Mapping[str, Any], *, lora_adapter: bool, secret_mismatch: bool = False) -> RequestFeatures:
    return RequestFeatures(
        multimodal=has_multimodal_content(body),
        unsupported_field=unsupported_field(body),
        lora_adapter=lora_adapter,
        secret_mismatch=secret_mismatch,
    )


# -- the decision ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Policy:
    threshold_tokens: int
    # Stock D's entries serve one pull: the plan then asks the router to consume the entry in the registry.
    single_use_entries: bool = True
    # A deadline closer than this (seconds) counts as passed: the pull must start before it.
    expiry_margin_s: float = 5.0


@dataclass(frozen=True, slots=True)
class SourceState:
    """The gateway's own view of the entry's engine (None fields: the gateway has no record of it)."""

    healthy: bool | None = None
    pulling: bool = False  # this gateway is pulling the same (engine, request) now
    # The engine's clock minus wall time, as learned from its responses (compatibility mode), or None.
    clock_offset_s: float | None = None


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """A hit: what P pulls, and whether the entry must be consumed in the registry first."""

    source: kvparams.PullSource
    tokens: int
    key: tuple[str, str]  # (engine_id, engine_request_id)
    consume: bool  # single-use (stock D): only the caller whose consume succeeds may pull
    epoch: int  # the entry's epoch the consume must find
    conversation_key: str  # the entry's conversation (differs from the turn's for content hits)


def screen(
    features: RequestFeatures, *, wants_reuse: bool, prompt_tokens: int | None, policy: Policy
) -> NoReuse | None:
    """The part of :func:`decide` that needs no lookup (the router calls it first to skip the lookup)."""
    if not wants_reuse:
        return NoReuse.NOT_REQUESTED
    if features.secret_mismatch:
        return NoReuse.SECRET_MISMATCH
    if features.multimodal:
        return NoReuse.MULTIMODAL_INPUT
    if features.lora_adapter:
        return NoReuse.LORA_ADAPTER
    if features.unsupported_field:
        return NoReuse.UNSUPPORTED_FIELD
    if prompt_tokens is not None and prompt_tokens <= policy.threshold_tokens:
        return NoReuse.SHORT_PROMPT
    return None


def decide(
    features: RequestFeatures,
    *,
    wants_reuse: bool,
    prompt_tokens: int,
    lookup: registry_pb2.LookupEntryResponse,
    block_size: int,
    source: SourceState,
    policy: Policy,
    now_s: float,
    looked_up_at: float = 0.0,
    now_mono: float = 0.0,
) -> ReusePlan | NoReuse:
    """Whether this turn's prefill pulls KV: the plan, or the reason it does not.

    ``looked_up_at`` and ``now_mono`` (``time.monotonic()``): when the lookup was sent, and now; P gets what
    is left of the engine's offer window since the lookup to start its READ (kvbridge.offers)."""
    early = screen(features, wants_reuse=wants_reuse, prompt_tokens=prompt_tokens, policy=policy)
    if early is not None:
        return early
    if lookup.verdict != registry_pb2.LOOKUP_VERDICT_HIT:
        return LOOKUP_REASONS.get(lookup.verdict, NoReuse.LOOKUP)
    loc = lookup.location
    engine = loc.engine
    k = kvparams.reusable_tokens(int(lookup.verified_tokens), prompt_tokens, block_size)
    if k < policy.threshold_tokens:
        return NoReuse.BELOW_THRESHOLD
    if int(engine.block_size or block_size) != block_size:
        return NoReuse.BLOCK_SIZE_MISMATCH
    if not engine.kv_host or not engine.kv_port:
        return NoReuse.NO_KV_ENDPOINT
    if source.healthy is False:
        return NoReuse.ENGINE_UNHEALTHY
    expire_s: float | None = None
    if loc.HasField("expire_time"):
        expire_s = loc.expire_time.seconds + loc.expire_time.nanos / 1e9
        if expire_s <= now_s + policy.expiry_margin_s:
            return NoReuse.EXPIRED
    if source.pulling:
        return NoReuse.BUSY
    try:
        groups = kvparams.truncate_groups([list(g.ids) for g in loc.block_ids], k, block_size)
    except ValueError:
        return NoReuse.BAD_LOCATION
    single_use = policy.single_use_entries and CONNECTOR_CAPABILITY not in engine.capabilities
    # The connector frees a withdrawn entry's blocks only its offer window (plus the index lag bound) after the
    # withdrawal: P must start its READ within that window of this lookup (ARCHITECTURE invariant 6).
    offer_window_s: float | None = None
    if CONNECTOR_CAPABILITY in engine.capabilities:
        if not engine.HasField("offer_window") or engine.offer_window.ToNanoseconds() <= 0:
            return NoReuse.NO_OFFER_WINDOW
        offer_window_s = engine.offer_window.ToNanoseconds() / 1e9
    # P declines a read that would start after D's deadline, on D's clock (vLLM's remote_blocks_expiry_time):
    # known for stock D once this gateway learned D's clock from its responses. The connector's entries carry
    # none (their lease bounds them).
    engine_expiry = (
        expire_s + source.clock_offset_s
        if single_use and expire_s is not None and source.clock_offset_s is not None
        else None
    )
    pull = kvparams.PullSource(
        engine_id=engine.engine_id,
        request_id=loc.engine_request_id,
        host=engine.kv_host,
        port=int(engine.kv_port),
        block_groups=groups,
        tp_size=int(engine.tp_size or 1),
        pp_size=int(engine.pp_size or 1),
        dcp_size=int(engine.dcp_size or 1),
        expiry_time=engine_expiry,
        offer_window_s=offer_window_s,
        looked_up_at=looked_up_at,
        incarnation=int(engine.node_lease_id),
    )
    if (
        offer_window_s is not None
        and offers.offer_ttl_ms(offer_window_s, now_mono - looked_up_at) <= 1000 * offers.READ_START_MARGIN_S
    ):
        return NoReuse.OFFER_EXPIRED
    return ReusePlan(
        source=pull,
        tokens=k,
        key=(engine.engine_id, loc.engine_request_id),
        consume=single_use,
        epoch=int(loc.epoch),
        conversation_key=loc.conversation_key,
    )
