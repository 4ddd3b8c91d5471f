"""The blocking SDK (kvbridge.sdk.sync) against a live stack, and retries of a server that starts late.

Blocking calls run in a worker thread (``asyncio.to_thread``): the stack serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvbridge.errors import InvalidArgument, NotFound, Reason, Unavailable
from kvbridge.sdk import ClientOptions, Sampling
from kvbridge.sdk import RegistryClient as AsyncRegistryClient
from kvbridge.sdk.sync import GatewayClient, LeaseClient, RegistryClient
from kvbridge_services.common.config import ServerSettings
from kvbridge_services.common.store.memory import MemoryStore
from kvbridge_services.registry.app import RegistryApp
from kvbridge_services.registry.config import RegistrySettings
from tests.fixtures.common import free_port
from tests.fixtures.gateway_stack import LONG, MODEL, OPERATOR_KEY, Stack, turn

from .conftest import ACME_KEY, ENTRY_LEASE_TTL_S

ACME = ClientOptions(api_key=ACME_KEY)
OPERATOR = ClientOptions(api_key=OPERATOR_KEY)  # inspects entries and leases (tenants may not)


def _sdk_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("kvbridge-"))


async def test_sync_clients_chat_stream_conversation_and_errors(sdk_stack: Stack) -> None:
    assert sdk_stack.lease is not None and sdk_stack.registry is not None
    gateway, lease, registry = sdk_stack.gateway.grpc_address, sdk_stack.lease.address, sdk_stack.registry.address
    msgs = [{"role": "user", "content": LONG}]
    answer, _ = await turn(sdk_stack, msgs, "sync-1", max_tokens=6)
    history = [*msgs, {"role": "assistant", "content": answer}]
    threads_before = _sdk_threads()

    def scenario() -> None:
        with (
            GatewayClient(gateway, ACME, lease_target=lease, heartbeat_interval_s=ENTRY_LEASE_TTL_S / 4) as gw,
            RegistryClient(registry, OPERATOR) as reg,
            LeaseClient(lease, OPERATOR) as leases,
        ):
            assert [m.id for m in gw.list_models()] == [MODEL]
            whole = gw.chat([{"role": "user", "content": "w10 w11"}], model=MODEL, sampling=Sampling(max_tokens=4))
            chunks = list(
                gw.stream_chat([{"role": "user", "content": "w10 w11"}], model=MODEL, sampling=Sampling(max_tokens=4))
            )
            assert "".join(c.delta_content for c in chunks) == whole.text and len(chunks) > 1
            assert len(gw.complete("w10 w11", model=MODEL, sampling=Sampling(max_tokens=3)).token_ids) == 3
            lease_id = reg.get_entry("acme", MODEL, "sync-1").lease_id
            with gw.conversation(model=MODEL, key="sync-1", history=history, sampling=Sampling(max_tokens=5)) as conv:
                threading.Event().wait(ENTRY_LEASE_TTL_S * 3)  # heartbeats run on the client's loop thread
                assert leases.get(lease_id).lease_id == lease_id
                parts = [c.delta_content for c in conv.stream("go on")]
                assert conv.messages[-1] == {"role": "assistant", "content": "".join(parts)}
            with pytest.raises(InvalidArgument) as bad:
                gw.chat([], model=MODEL)
            assert bad.value.reason == Reason.INVALID_FIELD
            with pytest.raises(NotFound) as gone:
                leases.get(lease_id)
            assert gone.value.reason == Reason.LEASE_NOT_FOUND
            # Breaking out of a stream early cancels it; the client stays usable.
            for _ in gw.stream_chat(
                [{"role": "user", "content": "w12"}], model=MODEL, sampling=Sampling(max_tokens=50)
            ):
                break
            assert gw.list_models()

    await asyncio.to_thread(scenario)
    assert _sdk_threads() == threads_before  # every client's loop thread ended with its `with`


async def test_unavailable_is_retried_until_the_server_is_up() -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    patient = ClientOptions(max_attempts=40, backoff_initial_s=0.05, backoff_max_s=0.2)
    async with AsyncRegistryClient(target, ClientOptions(max_attempts=2, backoff_initial_s=0.01)) as impatient:
        with pytest.raises(Unavailable):
            await impatient.list_engines()
    store = MemoryStore()
    app = RegistryApp(store, settings=RegistrySettings(port=port), server_settings=ServerSettings(shutdown_grace_s=0.1))
    async with AsyncRegistryClient(target, patient) as client:
        call = asyncio.create_task(client.list_engines())
        await asyncio.sleep(0.5)
        assert not call.done()  # still retrying: nothing listens yet
        await app.start()
        try:
            assert list((await asyncio.wait_for(call, 30)).engines) == []
            # The blocking client shares the same retry loop.
            with RegistryClient(target, patient) as sync_client:
                assert list((await asyncio.to_thread(sync_client.list_engines)).engines) == []
        finally:
            await app.stop(0.1)
            await store.close()
