"""Stopping a service does not wait out the OTLP exporter's retries when the collector is down (issue 31): shutdown
and force_flush return within ``SHUTDOWN_TIMEOUT_S``; with the collector up, every span is exported."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvbridge_services.common.telemetry import SHUTDOWN_TIMEOUT_S, Telemetry
from tests.fixtures.common import free_port
from tests.fixtures.otlp_receiver import running_receiver


def _spans(telemetry: Telemetry, count: int) -> None:
    for n in range(count):
        with telemetry.tracer.start_as_current_span(f"span-{n}"):
            pass


@pytest.mark.serial
async def test_shutdown_is_bounded_when_the_collector_is_down() -> None:
    telemetry = Telemetry.from_env(
        "kvbridge-test",
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"},  # nobody listens
    )
    assert telemetry.exporting
    _spans(telemetry, 20)
    started = time.monotonic()
    assert not await asyncio.to_thread(telemetry.force_flush, 500)
    flushed_s = time.monotonic() - started
    started = time.monotonic()
    await asyncio.to_thread(telemetry.shutdown)
    took = time.monotonic() - started
    print(
        f"\ncollector down: force_flush(0.5 s) {flushed_s:.2f} s, shutdown {took:.2f} s (bound {SHUTDOWN_TIMEOUT_S} s)"
    )
    assert flushed_s < 0.5 + 1.0
    # Without the bound: ~10-15 s (OTEL_EXPORTER_OTLP_TIMEOUT 10 s of retries with backoff).
    assert took < SHUTDOWN_TIMEOUT_S + 1.0


async def test_shutdown_exports_every_span_when_the_collector_is_up() -> None:
    async with running_receiver() as receiver:
        telemetry = Telemetry.from_env("kvbridge-test", {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        _spans(telemetry, 5)
        await asyncio.to_thread(telemetry.shutdown)
        spans = await receiver.wait_for(lambda ss: len(ss) >= 5)
        assert sorted(s.name for s in spans) == [f"span-{n}" for n in range(5)]
