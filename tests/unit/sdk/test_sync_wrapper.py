"""The blocking clients: one loop thread per client, typed errors, iterators, clean shutdown."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

import pytest

from kvbridge import sdk
from kvbridge.errors import NotFound, Reason, Unavailable
from kvbridge.sdk import ClientOptions, sync
from kvbridge.sdk.sync import GatewayClient, LoopThread

from .conftest import ScriptedGateway, Step, serve

FAST = ClientOptions(max_attempts=3, backoff_initial_s=0.001, backoff_max_s=0.002)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvbridge-GatewayClient"]


def test_loop_thread_runs_coroutines_and_stops() -> None:
    runner = LoopThread("kvbridge-test")

    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert runner.run(where()) == "kvbridge-test"

    async def boom() -> None:
        raise NotFound(Reason.ENTRY_NOT_FOUND, "none")

    with pytest.raises(NotFound):
        runner.run(boom())

    async def reenter() -> None:
        runner.run(where())

    with pytest.raises(RuntimeError, match="own event loop thread"):
        runner.run(reenter())
    runner.stop()
    assert not runner.alive
    runner.stop()  # idempotent


def _in_server_thread(servicer: ScriptedGateway) -> tuple[str, threading.Event, threading.Thread]:
    """The scripted server on its own loop thread, so the test body can block like a sync user."""
    ready, done = threading.Event(), threading.Event()
    address: list[str] = []

    def main() -> None:
        async def run() -> None:
            server, addr = await serve(servicer)
            address.append(addr)
            ready.set()
            while not done.is_set():  # noqa: ASYNC110 - a test server's lifetime
                await asyncio.sleep(0.01)
            await server.stop(0)

        asyncio.run(run())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10)
    return address[0], done, thread


def test_sync_client_calls_streams_errors_and_closes() -> None:
    servicer = ScriptedGateway()
    address, done, server_thread = _in_server_thread(servicer)
    try:
        before = len(_loop_threads())
        with GatewayClient(address, FAST) as gw:
            assert len(_loop_threads()) == before + 1
            assert [m.id for m in gw.list_models()] == ["m"]
            servicer.script = [Step(chunks=0, error=Unavailable(Reason.OVERLOADED, "busy")), Step(chunks=3)]
            chunks = list(gw.stream_chat([{"role": "user", "content": "hi"}], model="m"))
            assert [c.delta_content for c in chunks] == ["t0 ", "t1 ", "t2 "]
            servicer.script = [Step(error=NotFound(Reason.MODEL_NOT_FOUND, "no"))]
            with pytest.raises(NotFound) as exc:
                gw.list_models()
            assert exc.value.reason == Reason.MODEL_NOT_FOUND

            # Leaving a stream early cancels the call on the server.
            servicer.script = [Step(chunks=1000, pause_s=0.01)]
            stream = gw.stream_chat([{"role": "user", "content": "hi"}], model="m")
            assert next(stream).delta_content == "t0 "
            stream.close()
            deadline = time.monotonic() + 10
            while not servicer.cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
            assert servicer.cancelled == 1
            assert gw.list_models()  # still usable after a cancelled stream
        assert len(_loop_threads()) == before  # the loop thread ended with the `with` block
        gw.close()  # closing twice is harmless
    finally:
        done.set()
        server_thread.join(10)


def test_constructor_failure_stops_the_thread() -> None:
    before = len(_loop_threads())
    with pytest.raises(ValueError, match="client certificate"):
        GatewayClient("127.0.0.1:1", ClientOptions(client_certificate_chain=b"x", client_private_key=b"y"))
    assert len(_loop_threads()) == before


# For services that keep their own streams on the async client's stub (the gateway, the connector): no
# blocking caller has a stream of its own to report on.
STREAM_OWNER_ONLY = {"LeaseClient": {"note_failure"}}


def test_every_async_method_has_a_blocking_twin() -> None:
    for name in ("GatewayClient", "RegistryClient", "LeaseClient", "Conversation"):
        aio_cls, sync_cls = getattr(sdk, name), getattr(sync, name)
        public = {
            n for n, f in inspect.getmembers(aio_cls, inspect.isfunction) if not n.startswith("_")
        } - STREAM_OWNER_ONLY.get(name, set())
        missing = {n for n in public if not hasattr(sync_cls, n)}
        assert not missing, f"sync.{name} lacks {sorted(missing)}"
