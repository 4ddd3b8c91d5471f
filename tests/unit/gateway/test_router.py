"""TurnRouter, the turn's conductor, with fakes at its edges (issue 28): the engines' HTTP and the control plane are
fakes, the pool, the reuse decision, the verdict and the steps are the real ones. Each path's verdict and what it
commits (the entry consumed, the params P and D were sent)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from kvbridge import hashchain
from kvbridge import secret as kvsecret
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.gateway.config import GatewaySettings
from kvbridge_services.gateway.control import ControlPlaneError, KeyedLookup
from kvbridge_services.gateway.engines import DECODE, PREFILL, EnginePool
from kvbridge_services.gateway.kvparams import CONVERSATION_KEY_PARAM
from kvbridge_services.gateway.metrics import GatewayMetrics
from kvbridge_services.gateway.reuse import CONNECTOR_CAPABILITY
from kvbridge_services.gateway.router import TurnRouter
from kvbridge_services.gateway.threads import THREAD_KEY_PREFIX
from kvbridge_services.gateway.turn import Turn
from kvbridge_services.gateway.upstream import UpstreamError

SECRET = bytes(range(32))
MODEL, B = "m", 16
P_URL, D_URL = "http://p0", "http://d0"
PROMPT = list(range(10, 10 + 8 * B))  # 8 blocks


@dataclass
class FakeHttp:
    """The engines: P answers a prefill with its params (``cached``: the tokens it says it pulled), D a decode;
    ``fail_pulls``: P fails a prefill that was offered D's blocks."""

    cached: int | None = None
    fail_pulls: int = 0
    d_retains: bool = True  # D's connector marks its answer retained (kvbridge_retained)
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def post_json(self, url: str, body: dict[str, Any], *, timeout_s: float, headers: Any = None) -> Any:
        self.sent.append((url, body))
        if url.endswith("/tokenize"):
            return {"tokens": PROMPT}
        params = body.get("kv_transfer_params") or {}
        if url.startswith(P_URL):
            if params.get("remote_num_tokens") and self.fail_pulls:
                self.fail_pulls -= 1
                raise UpstreamError("the READ failed")
            offered = int(params.get("remote_num_tokens") or 0)
            returned = {
                "do_remote_prefill": True,
                "remote_engine_id": "p0",
                "remote_request_id": "p-req",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "remote_block_ids": [[1, 2, 3]],
                "remote_prefill_cached_tokens": offered if self.cached is None else self.cached,
            }
            return {"choices": [{"text": "x"}], "usage": {"prompt_tokens": len(PROMPT)}, "kv_transfer_params": returned}
        answer: dict[str, Any] = {
            "choices": [{"message": {"role": "assistant", "content": "answer"}}],
            "usage": {"prompt_tokens": 1},
        }
        if self.d_retains:
            answer["kv_transfer_params"] = {"remote_engine_id": "d0", "kvbridge_retained": True}
        return answer

    async def get(self, url: str, *, timeout_s: float) -> Any:
        raise AssertionError("no health checks in these tests")

    def prefills(self) -> list[dict[str, Any]]:
        return [b["kv_transfer_params"] for u, b in self.sent if u.startswith(P_URL) and "tokenize" not in u]

    def decodes(self) -> list[dict[str, Any]]:
        return [b["kv_transfer_params"] for u, b in self.sent if u.startswith(D_URL)]


class FakeKeepAlive:
    def __init__(self) -> None:
        self._answers: asyncio.Queue[lease_pb2.KeepAliveResponse] = asyncio.Queue()

    async def write(self, request: lease_pb2.KeepAliveRequest) -> None:
        await self._answers.put(lease_pb2.KeepAliveResponse())

    async def read(self) -> lease_pb2.KeepAliveResponse:
        return await self._answers.get()

    def cancel(self) -> bool:
        return True


@dataclass
class FakeControl:
    """The registry and lease manager: ``answer`` is every lookup's answer (None: the registry is down),
    ``consumed`` whether a consume finds the entry still there."""

    answer: registry_pb2.LookupEntryResponse | None
    consumed: bool = True
    lookups: list[KeyedLookup] = field(default_factory=list)
    consumes: list[tuple[str, int]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return True

    async def lookup(self, query: KeyedLookup) -> registry_pb2.LookupEntryResponse:
        self.lookups.append(query)
        if self.answer is None:
            raise ControlPlaneError("registry down")
        return self.answer

    async def consume_entry(self, *, tenant: str, model: str, conversation_key: str, epoch: int) -> bool:
        self.consumes.append((conversation_key, epoch))
        return self.consumed

    def open_keep_alive(self, *, timeout_s: float) -> FakeKeepAlive:
        return FakeKeepAlive()

    def lease_stream_failed(self, exc: BaseException) -> None:
        pass


def _engine(engine_id: str, role: types_pb2.EngineRole.ValueType, *, connector: bool = False) -> types_pb2.Engine:
    """An engine record; ``connector``: a kvbridge-connector engine under this deployment's secret (connector mode:
    D registers its own entries)."""
    caps = [CONNECTOR_CAPABILITY, kvsecret.canary_capability(SECRET)] if connector else []
    return types_pb2.Engine(
        engine_id=engine_id,
        role=role,
        model=MODEL,
        block_size=B,
        kv_host="127.0.0.1",
        kv_port=5601,
        capabilities=caps,
    )


def hit(blocks: int = 6, key: str = "conv") -> registry_pb2.LookupEntryResponse:
    """A registry hit on D's entry verifying ``blocks`` blocks of the prompt."""
    answer = registry_pb2.LookupEntryResponse(
        verdict=registry_pb2.LOOKUP_VERDICT_HIT, verified_tokens=blocks * B, prompt_block_tokens=len(PROMPT)
    )
    loc = answer.location
    loc.engine.CopyFrom(_engine("d0", types_pb2.ENGINE_ROLE_DECODE))
    loc.engine_request_id = "d-req"
    loc.block_ids.add().ids.extend(range(100, 100 + blocks))
    loc.epoch, loc.conversation_key, loc.entry_token_count = 7, key, blocks * B
    expire = Timestamp()
    expire.FromNanoseconds(time.time_ns() + 60 * 10**9)
    loc.expire_time.CopyFrom(expire)
    return answer


@pytest.fixture
def settings() -> GatewaySettings:
    return GatewaySettings(
        http_port=0, grpc_port=0, compat_registration=False, entry_mirror=False, registration_wait_s=0
    )


async def _router(
    settings: GatewaySettings, control: FakeControl, http: FakeHttp, *, connector: bool = False
) -> AsyncIterator[TurnRouter]:
    pool = EnginePool(http, health_timeout_s=1, kv_usage_weight=0)  # type: ignore[arg-type]
    for url, role, record in (
        (P_URL, PREFILL, _engine("p0", types_pb2.ENGINE_ROLE_PREFILL)),
        (D_URL, DECODE, _engine("d0", types_pb2.ENGINE_ROLE_DECODE, connector=connector)),
    ):
        state = pool.add_static(url, role, model=MODEL, engine_id=record.engine_id)
        state.record, state.healthy = record, True
    router = TurnRouter(settings, pool, control, http, GatewayMetrics(), SECRET)  # type: ignore[arg-type]
    try:
        yield router
    finally:
        await router.close()


def chat(key: str = "conv") -> Turn:
    return Turn(
        kind="chat",
        tenant="acme",
        model=MODEL,
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        conversation_key=key,
    )


async def run(settings: GatewaySettings, control: FakeControl, http: FakeHttp, turn: Turn) -> str:
    header, _ = await run_and_remember(settings, control, http, turn)
    return header


async def run_and_remember(
    settings: GatewaySettings, control: FakeControl, http: FakeHttp, turn: Turn, *, connector: bool = False
) -> tuple[str, bool]:
    """The turn's verdict header, and whether the router expects D to register the turn (its next turn then
    waits for that registration)."""
    async for router in _router(settings, control, http, connector=connector):
        result = await router.run(turn)
        result.finish()
        await router.drain()
        return result.verdict.header(), router._recent.last(turn.conversation) is not None
    raise AssertionError("unreachable")


async def test_a_hit_consumes_the_single_use_entry_and_offers_p_exactly_the_verified_blocks(
    settings: GatewaySettings,
) -> None:
    control, http = FakeControl(hit(blocks=6)), FakeHttp()
    assert await run(settings, control, http, chat()) == f"hit;tokens={6 * B}"
    assert control.consumes == [("conv", 7)]  # committed before P may read
    (offer,) = http.prefills()
    assert offer["remote_num_tokens"] == 6 * B and offer["remote_block_ids"] == [list(range(100, 106))]
    (decode,) = http.decodes()
    assert decode[CONVERSATION_KEY_PARAM] == "conv"
    query = control.lookups[0]
    assert query.block_hashes == hashchain.chain(SECRET, "acme", MODEL, "", B, PROMPT)  # the turn's scope


async def test_a_miss_prefills_plainly(settings: GatewaySettings) -> None:
    answer = registry_pb2.LookupEntryResponse(verdict=registry_pb2.LOOKUP_VERDICT_NOT_FOUND)
    control, http = FakeControl(answer), FakeHttp()
    assert await run(settings, control, http, chat()) == "miss;tokens=0"
    assert control.consumes == [] and "remote_num_tokens" not in http.prefills()[0]


@pytest.mark.parametrize(
    ("make_control", "header"),
    [
        (lambda: FakeControl(None), "declined:registry_unavailable;tokens=0"),
        (lambda: FakeControl(hit(), consumed=False), f"declined:consumed;tokens={6 * B}"),
        (lambda: FakeControl(hit(blocks=3)), f"declined:below_threshold;tokens={3 * B}"),
    ],
    ids=["registry-down", "consumed-by-another-turn", "below-threshold"],
)
async def test_each_decline_prefills_plainly_with_its_reason(
    settings: GatewaySettings, make_control: Callable[[], FakeControl], header: str
) -> None:
    """(Each answer is made when the test runs: its entry's deadline is a minute from then.)"""
    http = FakeHttp()
    assert await run(settings, make_control(), http, chat()) == header
    assert all("remote_num_tokens" not in p for p in http.prefills())


async def test_a_failed_pull_is_retried_without_ds_params(settings: GatewaySettings) -> None:
    control, http = FakeControl(hit()), FakeHttp(fail_pulls=1)
    assert await run(settings, control, http, chat()) == f"declined:prefill_failed;tokens={6 * B}"
    first, retry = http.prefills()
    assert first["remote_num_tokens"] == 6 * B and "remote_num_tokens" not in retry


async def test_p_that_read_nothing_makes_the_verdict_recomputed(settings: GatewaySettings) -> None:
    control, http = FakeControl(hit()), FakeHttp(cached=0)
    assert await run(settings, control, http, chat()) == f"declined:recomputed;tokens={6 * B}"


async def test_a_keyless_turn_looks_up_by_content_and_registers_under_a_thread_key(
    settings: GatewaySettings,
) -> None:
    control, http = FakeControl(hit(key="someone-keyed")), FakeHttp()
    assert await run(settings, control, http, chat(key="")) == f"hit;tokens={6 * B}"
    assert control.lookups[0].conversation_key == ""  # a new thread: found by content
    (decode,) = http.decodes()
    assert decode[CONVERSATION_KEY_PARAM].startswith(THREAD_KEY_PREFIX)  # never the keyed conversation's key


@pytest.mark.parametrize("retains", [True, False])
async def test_a_turn_d_did_not_retain_is_not_awaited_by_the_next_one(settings: GatewaySettings, retains: bool) -> None:
    """Under memory pressure D's connector frees a finished request at once and says nothing of it retained: the
    next turn must not wait registration_wait_s for an entry that is not coming."""
    answer = registry_pb2.LookupEntryResponse(verdict=registry_pb2.LOOKUP_VERDICT_NOT_FOUND)
    control, http = FakeControl(answer), FakeHttp(d_retains=retains)
    _, awaited = await run_and_remember(settings, control, http, chat(), connector=True)
    assert awaited is retains
