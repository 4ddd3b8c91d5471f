"""The reuse decision (kvbridge_services.gateway.reuse): one case per reason it gives, the plan of a hit, and the
reasons the router gives from the outcome of its own steps, each named with the test that produces it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypedDict

import pytest

from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.gateway import reuse
from kvbridge_services.gateway.reuse import NoReuse, ReusePlan, ReuseVerdict

B = 16
NOW = 1_000_000.0
POLICY = reuse.Policy(threshold_tokens=64, single_use_entries=True, expiry_margin_s=5.0)
PLAIN = reuse.RequestFeatures()
ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "gateway.md"


def hit(
    verified: int = 128,
    *,
    blocks: int = 8,
    connector: bool = False,
    kv_port: int = 5600,
    engine_block: int = B,
    expire_s: float | None = NOW + 300,
    epoch: int = 7,
    offer_window_s: float | None = 5.0,
) -> registry_pb2.LookupEntryResponse:
    caps = ["bidirectional_kv_xfer", *(["kvbridge_connector"] if connector else [])]
    engine = types_pb2.Engine(
        engine_id="d0", kv_host="10.0.0.2", kv_port=kv_port, block_size=engine_block, tp_size=1, capabilities=caps
    )
    if connector and offer_window_s is not None:
        engine.offer_window.FromNanoseconds(int(offer_window_s * 1e9))
    loc = registry_pb2.Location(
        engine=engine,
        engine_request_id="req-1",
        epoch=epoch,
        conversation_key="c1",
        block_ids=[types_pb2.BlockIds(ids=list(range(blocks)))],
    )
    if expire_s is not None:
        loc.expire_time.FromNanoseconds(int(expire_s * 1e9))
    return registry_pb2.LookupEntryResponse(
        verdict=registry_pb2.LOOKUP_VERDICT_HIT, verified_tokens=verified, location=loc
    )


def verdict_only(v: registry_pb2.LookupVerdict.ValueType) -> registry_pb2.LookupEntryResponse:
    return registry_pb2.LookupEntryResponse(verdict=v)


def decide(
    lookup: registry_pb2.LookupEntryResponse | None = None,
    *,
    features: reuse.RequestFeatures = PLAIN,
    wants_reuse: bool = True,
    prompt_tokens: int = 200,
    source: reuse.SourceState | None = None,
    policy: reuse.Policy = POLICY,
    lookup_age_s: float = 0.0,
) -> ReusePlan | NoReuse:
    return reuse.decide(
        features,
        wants_reuse=wants_reuse,
        prompt_tokens=prompt_tokens,
        lookup=hit() if lookup is None else lookup,
        block_size=B,
        source=source or reuse.SourceState(healthy=True),
        policy=policy,
        now_s=NOW,
        looked_up_at=100.0,
        now_mono=100.0 + lookup_age_s,
    )


class Inputs(TypedDict, total=False):
    """Arguments of :func:`decide` (the lookup defaults to :func:`hit`)."""

    lookup: registry_pb2.LookupEntryResponse
    features: reuse.RequestFeatures
    wants_reuse: bool
    prompt_tokens: int
    source: reuse.SourceState
    lookup_age_s: float


# Every reason decide() gives, with inputs that give it (and would give a hit otherwise).
DECIDED: dict[NoReuse, Inputs] = {
    NoReuse.NOT_REQUESTED: {"wants_reuse": False},
    NoReuse.MULTIMODAL_INPUT: {"features": reuse.RequestFeatures(multimodal=True)},
    NoReuse.LORA_ADAPTER: {"features": reuse.RequestFeatures(lora_adapter=True)},
    NoReuse.SECRET_MISMATCH: {"features": reuse.RequestFeatures(secret_mismatch=True)},
    NoReuse.UNSUPPORTED_FIELD: {"features": reuse.RequestFeatures(unsupported_field="truncate_prompt_tokens")},
    NoReuse.SHORT_PROMPT: {"prompt_tokens": 64},
    NoReuse.NOT_FOUND: {"lookup": verdict_only(registry_pb2.LOOKUP_VERDICT_NOT_FOUND)},
    NoReuse.EXPIRED: {"lookup": hit(expire_s=NOW + 4.0)},  # within the 5 s margin
    NoReuse.MISMATCH: {"lookup": verdict_only(registry_pb2.LOOKUP_VERDICT_MISMATCH)},
    NoReuse.BELOW_THRESHOLD: {"lookup": hit(verified=48)},
    NoReuse.ENGINE_GONE: {"lookup": verdict_only(registry_pb2.LOOKUP_VERDICT_ENGINE_GONE)},
    NoReuse.ENGINE_RESTARTED: {"lookup": verdict_only(registry_pb2.LOOKUP_VERDICT_ENGINE_RESTARTED)},
    NoReuse.INDEX_STALE: {"lookup": verdict_only(registry_pb2.LOOKUP_VERDICT_INDEX_STALE)},
    NoReuse.BLOCK_SIZE_MISMATCH: {"lookup": hit(engine_block=32)},
    NoReuse.LOOKUP: {"lookup": verdict_only(registry_pb2.LOOKUP_VERDICT_UNSPECIFIED)},
    NoReuse.NO_KV_ENDPOINT: {"lookup": hit(kv_port=0)},
    NoReuse.NO_OFFER_WINDOW: {"lookup": hit(connector=True, offer_window_s=None)},
    NoReuse.OFFER_EXPIRED: {"lookup": hit(connector=True, offer_window_s=5.0), "lookup_age_s": 4.8},
    NoReuse.ENGINE_UNHEALTHY: {"source": reuse.SourceState(healthy=False)},
    NoReuse.BUSY: {"source": reuse.SourceState(healthy=True, pulling=True)},
    NoReuse.BAD_LOCATION: {"lookup": hit(blocks=3)},  # 128 verified tokens need 8 blocks
}

# Reasons the router gives from the outcome of a step decide() cannot see, and the test file that shows each.
SAFETY = "tests/integration/gateway/test_reuse_safety.py"
ROUTER_GIVEN = {
    NoReuse.TOKENIZE_FAILED: SAFETY,
    NoReuse.REGISTRY_UNAVAILABLE: "tests/reliability/test_service_mtls.py",
    NoReuse.CONSUMED: SAFETY,
    NoReuse.RECOMPUTED: SAFETY,
    NoReuse.PREFILL_FAILED: "tests/integration/gateway/test_gateway_reuse.py",
    NoReuse.PREFILL_TIMEOUT: "tests/e2e/test_gateway_vllm.py",
    NoReuse.RECOMPUTE_CHEAPER: "tests/integration/gateway/test_placement.py",
    NoReuse.LOCAL_PREFILL_FAILED: "tests/integration/gateway/test_placement.py",
}


def test_every_reason_is_decided_here_or_shown_by_a_named_test() -> None:
    assert set(DECIDED) | set(ROUTER_GIVEN) == set(NoReuse)
    assert not set(DECIDED) & set(ROUTER_GIVEN)
    for reason, path in ROUTER_GIVEN.items():
        assert reason.label in (ROOT / path).read_text(), (reason, path)


def test_the_base_case_is_a_hit() -> None:
    plan = decide(hit())
    assert isinstance(plan, ReusePlan)
    assert plan.tokens == 128 and plan.source.block_groups == [list(range(8))]
    assert (plan.source.engine_id, plan.source.request_id, plan.source.port) == ("d0", "req-1", 5600)


@pytest.mark.parametrize("reason", list(DECIDED), ids=lambda r: r.value)
def test_each_reason(reason: NoReuse) -> None:
    assert decide(**DECIDED[reason]) is reason


def test_screen_needs_no_lookup_and_agrees_with_decide() -> None:
    for reason in (NoReuse.NOT_REQUESTED, NoReuse.MULTIMODAL_INPUT, NoReuse.LORA_ADAPTER, NoReuse.UNSUPPORTED_FIELD):
        inputs = DECIDED[reason]
        assert (
            reuse.screen(
                inputs.get("features", PLAIN),
                wants_reuse=inputs.get("wants_reuse", True),
                prompt_tokens=None,
                policy=POLICY,
            )
            is reason
        )
    assert reuse.screen(PLAIN, wants_reuse=True, prompt_tokens=None, policy=POLICY) is None
    assert reuse.screen(PLAIN, wants_reuse=True, prompt_tokens=64, policy=POLICY) is NoReuse.SHORT_PROMPT


def test_request_reasons_come_before_the_lookup_answer() -> None:
    """A multimodal request is declined as such even when the lookup would hit or say mismatch."""
    features = reuse.RequestFeatures(multimodal=True, lora_adapter=True, unsupported_field="documents")
    assert decide(hit(), features=features) is NoReuse.MULTIMODAL_INPUT
    assert decide(verdict_only(registry_pb2.LOOKUP_VERDICT_MISMATCH), features=features) is NoReuse.MULTIMODAL_INPUT


def test_stock_engine_entries_are_consumed_connector_entries_are_not() -> None:
    stock = decide(hit(epoch=42))
    assert isinstance(stock, ReusePlan) and stock.consume and stock.epoch == 42 and stock.conversation_key == "c1"
    connector = decide(hit(connector=True))
    assert isinstance(connector, ReusePlan) and not connector.consume
    off = decide(hit(), policy=reuse.Policy(threshold_tokens=64, single_use_entries=False))
    assert isinstance(off, ReusePlan) and not off.consume


def test_d_deadline_goes_to_p_on_ds_clock_only_when_known() -> None:
    unknown = decide(hit(expire_s=NOW + 300))
    assert isinstance(unknown, ReusePlan) and unknown.source.expiry_time is None
    known = decide(hit(expire_s=NOW + 300), source=reuse.SourceState(healthy=True, clock_offset_s=-999_000.0))
    assert isinstance(known, ReusePlan) and known.source.expiry_time == pytest.approx(NOW + 300 - 999_000.0)
    # The connector's entries carry no fixed deadline for P (their lease bounds them).
    conn = decide(hit(connector=True), source=reuse.SourceState(healthy=True, clock_offset_s=0.0))
    assert isinstance(conn, ReusePlan) and conn.source.expiry_time is None


def test_a_connector_entry_carries_the_engines_offer_window_to_p() -> None:
    plan = decide(hit(connector=True, offer_window_s=5.0), lookup_age_s=1.0)
    assert isinstance(plan, ReusePlan)
    assert plan.source.offer_window_s == 5.0 and plan.source.looked_up_at == 100.0
    # Stock engines promise no window (their D frees on its own schedule; D's deadline goes to P instead).
    stock = decide(hit())
    assert isinstance(stock, ReusePlan) and stock.source.offer_window_s is None


def test_an_unknown_engine_health_does_not_decline() -> None:
    assert isinstance(decide(hit(), source=reuse.SourceState(healthy=None)), ReusePlan)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "messages": [], "max_tokens": 8, "temperature": 0, "conversation_id": "c"}, ""),
        ({"model": "m", "messages": [], "truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
        ({"model": "m", "messages": [], "documents": [{"text": "x"}]}, "documents"),
        ({"model": "m", "messages": [], "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ({"model": "m", "prompt": "x", "prompt_embeds": "..."}, "prompt_embeds"),
        ({"model": "m", "messages": [], "tools": [], "tool_choice": "none"}, "tool_choice"),
        ({"model": "m", "messages": [], "chat_template_kwargs": {"enable_thinking": False}, "tool_choice": "auto"}, ""),
    ],
)
def test_body_allow_list(body: dict[str, object], field: str) -> None:
    assert reuse.unsupported_field(body) == field


def test_multimodal_parts_are_detected() -> None:
    text = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert not reuse.has_multimodal_content(text)
    for part in (
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
        "not-a-dict",
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}
        assert reuse.has_multimodal_content(body), part
    features = reuse.request_features(text, lora_adapter=True)
    assert not features.covered and reuse.request_features(text, lora_adapter=False).covered


def test_header_metric_and_span_come_from_the_enum() -> None:
    assert ReuseVerdict(None, 96).header() == "hit;tokens=96"
    v = ReuseVerdict(NoReuse.CONSUMED, 64)
    assert (v.header(), v.verdict, v.metric_reason, v.span_reason) == (
        "declined:consumed;tokens=64",
        "declined",
        "consumed",
        "consumed",
    )
    m = ReuseVerdict(NoReuse.NOT_FOUND)
    assert (m.header(), m.verdict, m.metric_reason, m.span_reason) == ("miss;tokens=0", "miss", "", "not_found")
    for reason in NoReuse:
        assert re.fullmatch(r"[a-z_]+", reason.value)
        assert reason.label == ("miss" if reason.is_miss else f"declined:{reason.value}")


def test_every_reason_is_documented() -> None:
    text = DOCS.read_text()
    section = text.split("## Reuse verdicts", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))
    assert documented == {r.value for r in NoReuse}
