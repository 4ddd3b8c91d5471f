"""kvbridge connector on real engines: lease-held decode KV, multi-turn pulls, registry entries."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from typing import Any

import grpc
import pytest

from kvbridge import hashchain
from kvbridge.lease.v1 import lease_pb2, lease_pb2_grpc
from kvbridge.registry.v1 import registry_pb2, registry_pb2_grpc
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.auth import Authenticator, Principal
from tests.e2e.conftest import ENTRY_LEASE_TTL_S, HASH_SECRET, OLD_TTL_S
from tests.e2e.gateway_turns import conversation, prefix_cache_hits, registry_routed_gateway
from tests.e2e.pd_client import completion, pd_turn, prefill_params_for, random_tokens
from tests.fixtures.control_plane_procs import ControlPlaneProcs
from tests.fixtures.vllm_engines import BLOCK_SIZE, Engine, EnginePool, PDEngines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TENANT = "acme"


def kvbridge_fields(conversation: str, epoch: int) -> dict[str, Any]:
    """D's kvbridge fields; pd_turn signs them with the deployment secret as the gateway does."""
    return {"kvbridge_conversation_key": conversation, "kvbridge_tenant": TENANT, "kvbridge_epoch": epoch}


def get_entry(procs: ControlPlaneProcs, conversation: str) -> registry_pb2.Entry:
    with grpc.insecure_channel(procs.registry_target) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        key = registry_pb2.EntryKey(tenant=TENANT, model="tiny", conversation_key=conversation)
        response = stub.GetEntry(registry_pb2.GetEntryRequest(key=key), timeout=5)
        return response.entry


def get_engine(procs: ControlPlaneProcs, engine_id: str) -> types_pb2.Engine:
    with grpc.insecure_channel(procs.registry_target) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return stub.GetEngine(registry_pb2.GetEngineRequest(engine_id=engine_id), timeout=5).engine


def wait_for_entry(procs: ControlPlaneProcs, conversation: str, epoch: int, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            entry = get_entry(procs, conversation)
            if entry.epoch == epoch:
                return entry
        except grpc.RpcError as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"entry {conversation}@{epoch} not registered: {last}")


class Heartbeater:
    """Renews leases every second on a thread, as the gateway (each turn) or an agent SDK would."""

    def __init__(self, lease_target: str) -> None:
        self._channel = grpc.insecure_channel(lease_target)
        self._stub = lease_pb2_grpc.LeaseServiceStub(self._channel)
        self.lease_ids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Heartbeater:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._channel.close()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if self.lease_ids:
                with contextlib.suppress(grpc.RpcError):
                    request = lease_pb2.KeepAliveRequest(lease_ids=sorted(self.lease_ids))
                    list(self._stub.KeepAlive(iter([request]), timeout=5))


def test_four_turns_pull_decode_kv_and_match_no_reuse(kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs) -> None:
    with Heartbeater(control_plane.lease_target) as heartbeater:
        four_turns(kvbridge_pd, control_plane, heartbeater)


def four_turns(kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs, heartbeater: Heartbeater) -> None:
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(23)
    conversation = "conv-4turns"
    prompt = random_tokens(rng, 150)
    previous = None
    for epoch in range(1, 5):
        turn = pd_turn(
            prefill,
            decode,
            prompt,
            24,
            reuse=previous.decode_params if previous else None,
            decode_extra=kvbridge_fields(conversation, epoch),
        )
        entry = wait_for_entry(control_plane, conversation, epoch)
        heartbeater.lease_ids = {entry.lease_id}
        if epoch == 1:  # both engines registered themselves, with their NIXL side channels
            for engine, role in ((prefill, types_pb2.ENGINE_ROLE_PREFILL), (decode, types_pb2.ENGINE_ROLE_DECODE)):
                record = get_engine(control_plane, engine.engine_id)
                assert (record.role, record.kv_port, record.block_size) == (role, engine.side_channel_port, BLOCK_SIZE)
        # The chain the connector registered matches one computed independently (as the gateway does).
        hit = lookup(control_plane, conversation, prompt + turn.output_ids)
        assert hit.verdict == registry_pb2.LOOKUP_VERDICT_HIT
        assert hit.verified_tokens == turn.decode_params["remote_num_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        fresh = pd_turn(prefill, decode, prompt, 24)
        assert turn.output_ids == fresh.output_ids, f"turn {epoch}: reuse changed the answer"
        assert fresh.pulled_tokens == 0
        if previous is None:
            assert turn.pulled_tokens == 0
        else:
            assert turn.pulled_tokens == previous.decode_params["remote_num_tokens"], f"turn {epoch} did not pull"
        params = turn.decode_params
        assert params.get("kvbridge_retained") is True
        assert entry.engine_id == decode.engine_id
        assert entry.engine_request_id == params["remote_request_id"]
        assert entry.token_count == params["remote_num_tokens"]
        assert [list(g.ids) for g in entry.block_ids] == params["remote_block_ids"]
        assert entry.lease_id > 0
        previous = turn
        prompt = prompt + turn.output_ids + random_tokens(rng, 40)


def test_read_notification_does_not_free_lease_held_blocks(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    """Stock D frees its blocks after the first prefill read; under a lease they serve every read."""
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(5)
    prompt = random_tokens(rng, 130)
    with Heartbeater(control_plane.lease_target) as heartbeater:
        first = pd_turn(prefill, decode, prompt, 20, decode_extra=kvbridge_fields("conv-reread", 1))
        heartbeater.lease_ids = {wait_for_entry(control_plane, "conv-reread", 1).lease_id}
        follow_up = prompt + first.output_ids + random_tokens(rng, 20)
        expected = pd_turn(prefill, decode, follow_up, 10).output_ids
        for _ in range(3):
            again = pd_turn(prefill, decode, follow_up, 10, reuse=first.decode_params)
            assert again.pulled_tokens == first.decode_params["remote_num_tokens"]
            assert again.output_ids == expected


def kv_cache_usage(engine: Engine) -> float:
    for line in engine.get_text("/metrics").splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:kv_cache_usage_perc not in /metrics")


def test_heartbeats_hold_blocks_past_twice_the_old_ttl_and_revoke_frees_them(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(99)
    prompt = random_tokens(rng, 300)
    first = pd_turn(prefill, decode, prompt, 20, decode_extra=kvbridge_fields("conv-heartbeat", 1))
    lease_id = wait_for_entry(control_plane, "conv-heartbeat", 1).lease_id

    with Heartbeater(control_plane.lease_target) as heartbeater:
        # Heartbeat (as an agent's SDK would) past twice the old fixed TTL and past the lease TTL:
        # everything else on D (stock retention, unrenewed entries of other tests) is gone by then.
        heartbeater.lease_ids = {lease_id}
        assert 2 * OLD_TTL_S + 5 > ENTRY_LEASE_TTL_S
        time.sleep(2 * OLD_TTL_S + 5)
        assert lease_alive(control_plane, lease_id)
        assert kv_cache_usage(decode) > 0, "D freed the lease-held blocks"

        follow_up = prompt + first.output_ids + random_tokens(rng, 30)
        reused = pd_turn(prefill, decode, follow_up, 10, reuse=first.decode_params)
        assert reused.pulled_tokens == first.decode_params["remote_num_tokens"]
        assert reused.output_ids == pd_turn(prefill, decode, follow_up, 10).output_ids

        time.sleep(OLD_TTL_S + 3)  # the follow-up turns' stock retention expires meanwhile
        assert lease_alive(control_plane, lease_id)
        usage_held = kv_cache_usage(decode)
        assert usage_held > 0
        with grpc.insecure_channel(control_plane.lease_target) as channel:
            lease_pb2_grpc.LeaseServiceStub(channel).RevokeLease(
                lease_pb2.RevokeLeaseRequest(lease_id=lease_id, reason=types_pb2.REVOKE_REASON_CLIENT_CLOSED), timeout=5
            )
    # D holds retained blocks by reference and goes idle between turns: it drops a released hold at its
    # first engine step after the free grace (kvbridge_free_grace_s, 10 s: a pull sent just before the revoke
    # may still be reading), the first moment anything could need the memory. Small requests make the steps.
    deadline = time.monotonic() + 45
    while kv_cache_usage(decode) >= usage_held and time.monotonic() < deadline:
        completion(decode, random_tokens(rng, 8), 1, None)
        time.sleep(0.5)
    assert kv_cache_usage(decode) < usage_held, "revoking the lease did not free D's blocks"


def lease_alive(procs: ControlPlaneProcs, lease_id: int) -> bool:
    with grpc.insecure_channel(procs.lease_target) as channel:
        stub = lease_pb2_grpc.LeaseServiceStub(channel)
        responses = list(stub.KeepAlive(iter([lease_pb2.KeepAliveRequest(lease_ids=[lease_id])]), timeout=5))
        return bool(responses and responses[0].statuses and responses[0].statuses[0].alive)


def lookup(procs: ControlPlaneProcs, conversation: str, token_ids: list[int]) -> registry_pb2.LookupEntryResponse:
    """What the gateway asks: the verified prefix of a new prompt (hash chain computed independently)."""
    chain = hashchain.chain(bytes.fromhex(HASH_SECRET), TENANT, "tiny", "", BLOCK_SIZE, token_ids)
    with grpc.insecure_channel(procs.registry_target) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return stub.LookupEntry(
            registry_pb2.LookupEntryRequest(
                tenant=TENANT,
                model="tiny",
                conversation_key=conversation,
                block_hashes=chain,
                block_size=BLOCK_SIZE,
            ),
            timeout=5,
        )


def test_prefill_declines_a_pull_verified_for_other_tokens(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    """P checks the verified prefix's digest against its own prompt: if a router verified other tokens
    (a tokenizer disagreement, a bug), P recomputes instead of loading KV that belongs to other text."""
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(31)
    prompt = random_tokens(rng, 130)
    with Heartbeater(control_plane.lease_target) as heartbeater:
        first = pd_turn(prefill, decode, prompt, 20, decode_extra=kvbridge_fields("conv-digest", 1))
        heartbeater.lease_ids = {wait_for_entry(control_plane, "conv-digest", 1).lease_id}
        verified = prompt + first.output_ids + random_tokens(rng, 20)
        edited = list(verified)
        edited[40] = 8 if edited[40] != 8 else 9  # what P actually got differs inside the pulled prefix
        expected = pd_turn(prefill, decode, edited, 10).output_ids
        mismatched = pd_turn(prefill, decode, edited, 10, reuse=first.decode_params, verified=verified)
        assert mismatched.pulled_tokens == 0, "P loaded KV verified for other tokens"
        assert mismatched.output_ids == expected
        # The same offer for the tokens P really has is pulled (the lease still holds D's blocks).
        matching = pd_turn(prefill, decode, verified, 10, reuse=first.decode_params)
        assert matching.pulled_tokens == first.decode_params["remote_num_tokens"]


def test_prefill_declines_an_offer_whose_read_window_has_passed(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    """A READ is one-sided: D frees a withdrawn entry's blocks once the offer window has passed, so P must not
    start a READ after it (a long P queue, a slow gateway). P recomputes and the answer is still right."""
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(47)
    prompt = random_tokens(rng, 130)
    with Heartbeater(control_plane.lease_target) as heartbeater:
        first = pd_turn(prefill, decode, prompt, 20, decode_extra=kvbridge_fields("conv-window", 1))
        heartbeater.lease_ids = {wait_for_entry(control_plane, "conv-window", 1).lease_id}
        follow_up = prompt + first.output_ids + random_tokens(rng, 20)
        expected = pd_turn(prefill, decode, follow_up, 10).output_ids
        # 100 ms left of the window when P receives it: less than P's read-start margin (0.25 s).
        late = pd_turn(prefill, decode, follow_up, 10, reuse=first.decode_params, offer_ttl_ms=100)
        assert late.pulled_tokens == 0, "P read D's blocks after the offer's deadline"
        assert late.output_ids == expected
        in_time = pd_turn(prefill, decode, follow_up, 10, reuse=first.decode_params)
        assert in_time.pulled_tokens == first.decode_params["remote_num_tokens"]
        assert in_time.output_ids == expected


def test_prefill_pulls_only_offers_a_gateway_signed(kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs) -> None:
    """Any HTTP caller of P can put vLLM's remote_* fields in kv_transfer_params: P pulls only an offer signed
    with the deployment secret, so nobody else makes it READ D's blocks (another tenant's KV) or stretch the read
    window. Unsigned, signed with another secret, or altered after signing (other block ids): declined, recomputed,
    the right answer; the same offer signed by the gateway's secret is pulled."""
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(53)
    prompt = random_tokens(rng, 130)
    with Heartbeater(control_plane.lease_target) as heartbeater:
        first = pd_turn(prefill, decode, prompt, 20, decode_extra=kvbridge_fields("conv-signed", 1))
        heartbeater.lease_ids = {wait_for_entry(control_plane, "conv-signed", 1).lease_id}
        follow_up = prompt + first.output_ids + random_tokens(rng, 20)
        expected = pd_turn(prefill, decode, follow_up, 10).output_ids
        offer = first.decode_params
        unsigned = pd_turn(prefill, decode, follow_up, 10, reuse=offer, offer_secret=None)
        foreign = pd_turn(prefill, decode, follow_up, 10, reuse=offer, offer_secret=b"another-secret-0123456789abcdef!")
        altered = prefill_params_for(follow_up, offer)
        altered["remote_block_ids"] = [list(reversed(g)) for g in altered["remote_block_ids"]]
        tampered = completion(prefill, follow_up, 1, altered)["kv_transfer_params"]
        for name, pulled in (
            ("unsigned", unsigned.pulled_tokens),
            ("another secret", foreign.pulled_tokens),
            ("altered after signing", int(tampered.get("remote_prefill_cached_tokens") or 0)),
        ):
            assert pulled == 0, f"P pulled an offer no gateway signed ({name})"
        assert unsigned.output_ids == expected and foreign.output_ids == expected
        signed = pd_turn(prefill, decode, follow_up, 10, reuse=offer)
        assert signed.pulled_tokens == offer["remote_num_tokens"]
        assert signed.output_ids == expected
    log = prefill.log_path.read_text(errors="replace")
    assert "unsigned_offer" in log and "forged_offer" in log


def acme_auth() -> Authenticator:
    """The tenant's one API key (``Bearer key-acme``)."""
    return Authenticator({"key-acme": Principal("acme-app", TENANT)})


async def test_connector_mode_gateway_prefills_on_the_holder_d_and_answers_equal(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs
) -> None:
    """Placement's local prefill with the kvbridge connector on real vLLM (ADR 0020): the gateway learns both
    engines from the registry; turns 2+ go straight to the holder D, whose prefix cache serves every verified
    token; D's connector registers each turn's state itself (the next turn hits on it); answers equal no reuse."""
    key = {"authorization": "Bearer key-acme"}
    placements: list[str] = []
    hits_before = await prefix_cache_hits(kvbridge_pd.decode.url)
    async with registry_routed_gateway(control_plane, reuse=True, placement=True, auth=acme_auth()) as gw:
        # The pause lets D's connector register a turn before the next looks it up (its own schedule).
        local = await conversation(gw, "conv-connector-local", 3, placements, headers=key, settle_s=1.0)
        entry = get_entry(control_plane, "conv-connector-local")  # while this gateway still renews its lease
    hits = await prefix_cache_hits(kvbridge_pd.decode.url) - hits_before
    async with registry_routed_gateway(control_plane, reuse=False, auth=acme_auth()) as gw:
        without = await conversation(gw, "conv-connector-none", 3, headers=key)
    assert [ids for _, ids in local] == [ids for _, ids in without]
    assert local[0][0].startswith("miss"), local
    assert placements[1:] == ["prefill_on_holder;reason=cheapest"] * 2, placements
    assert all(v.startswith("hit;") for v, _ in local[1:]), local
    verified = [int(v.split("tokens=")[1]) for v, _ in local[1:]]
    assert hits >= sum(verified), (hits, verified)  # D computed none of the verified history again
    # D's connector registered turn 3's state: its sequence holds turn 3's whole prompt (200 tokens, then 24
    # answer and 20 new tokens per turn), which turn 2's does not.
    assert entry.engine_id == kvbridge_pd.decode.engine_id and entry.token_count >= 200 + 2 * (24 + 20), entry


def test_killed_decode_ends_its_leases_and_prefill_recomputes(
    kvbridge_pd: PDEngines, control_plane: ControlPlaneProcs, engine_pool: EnginePool
) -> None:
    """Runs last in this module: it kills D (the pool restarts engines for later tests)."""
    prefill, decode = kvbridge_pd.prefill, kvbridge_pd.decode
    rng = random.Random(77)
    prompt = random_tokens(rng, 200)
    try:
        first = pd_turn(prefill, decode, prompt, 20, decode_extra=kvbridge_fields("conv-killed", 1))
        wait_for_entry(control_plane, "conv-killed", 1)
        follow_up = prompt + first.output_ids + random_tokens(rng, 40)
        hit = lookup(control_plane, "conv-killed", follow_up)
        assert hit.verdict == registry_pb2.LOOKUP_VERDICT_HIT
        assert hit.verified_tokens == first.decode_params["remote_num_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert hit.location.engine.engine_id == decode.engine_id

        os.killpg(decode.process.pid, signal.SIGKILL)  # a crash, not a clean shutdown
        deadline = time.monotonic() + 90
        verdict = hit.verdict
        while verdict == registry_pb2.LOOKUP_VERDICT_HIT and time.monotonic() < deadline:
            time.sleep(1)
            verdict = lookup(control_plane, "conv-killed", follow_up).verdict
        assert verdict != registry_pb2.LOOKUP_VERDICT_HIT, "the dead engine's entry is still offered"

        # A router holding stale params anyway: P's pull fails and it recomputes, correctly.
        stale = completion(prefill, follow_up, 1, prefill_params_for(follow_up, first.decode_params))
        fresh = completion(prefill, follow_up, 1, prefill_params_for(follow_up, None))
        assert stale["kv_transfer_params"].get("remote_prefill_cached_tokens", 0) == 0
        assert stale["choices"][0]["token_ids"] == fresh["choices"][0]["token_ids"]
    finally:
        engine_pool.close()
