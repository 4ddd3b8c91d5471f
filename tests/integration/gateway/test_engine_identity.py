"""Engines' addresses are not for tenants (issue 30, item 8): a 502/504's message names the failed step, never the
engine's URL, host or port (they are in the gateway's log), and /metrics, served without a key on the public
HTTP port, labels engines by id, not by URL."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest

from kvbridge_services.gateway.metrics import engine_label
from kvbridge_services.gateway.upstream import EngineHttp, UpstreamError
from tests.fixtures.common import free_port
from tests.fixtures.gateway_stack import Stack, chat, running_stack
from tests.tools.engine_sim import SimServer


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as s:
        yield s


def _addresses(*sims: SimServer) -> list[str]:
    """Every spelling of the engines' addresses that must not reach a tenant."""
    out: list[str] = []
    for sim in sims:
        parts = urlsplit(sim.url)
        out += [sim.url, parts.netloc, f":{parts.port}", f"{sim.cfg.port}"]
    return out


async def _control(sim: SimServer, **body: object) -> None:
    async with httpx.AsyncClient() as c:
        assert (await c.post(sim.url + "/sim/control", json=body)).status_code == 200


def _assert_no_address(text: str, stack: Stack) -> None:
    for address in _addresses(stack.prefill, stack.decode):
        assert address not in text, (address, text)


async def test_a_failed_decode_answers_502_without_the_engines_address(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    await _control(stack.decode, fail_next=1)
    with caplog.at_level(logging.WARNING):
        r = await stack.client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}]))
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("decode failed: the engine answered HTTP 500"), message
    _assert_no_address(r.text, stack)
    assert stack.decode.url in caplog.text  # the operator's log keeps it


async def test_a_stalled_prefill_answers_504_without_the_engines_address(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    stack.gateway.core.settings.prefill_timeout_s = 0.3
    await _control(stack.prefill, stall_s=5, stall_after_tokens=0)
    with caplog.at_level(logging.WARNING):
        r = await stack.client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}]))
    await _control(stack.prefill, stall_s=0)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["message"].startswith("prefill timed out: the engine did not answer in time")
    _assert_no_address(r.text, stack)
    assert stack.prefill.url in caplog.text


async def test_a_refused_connection_names_no_address_but_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/completions"
    http = EngineHttp(connect_timeout_s=1)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(UpstreamError) as err:
            await http.post_json(url, {}, timeout_s=2)
    finally:
        await http.aclose()
    port = url.split(":")[2].split("/")[0]
    assert str(err.value) == "the engine could not be reached" and err.value.transport
    assert port not in str(err.value) and url in err.value.detail and url in caplog.text


async def test_metrics_label_engines_by_id_not_url(stack: Stack) -> None:
    text = (await stack.client.get("/metrics")).text  # a tenant's key; Prometheus needs none
    _assert_no_address(text, stack)
    healthy = [line for line in text.splitlines() if line.startswith("kvbridge_gateway_engine_healthy{")]
    assert sorted(healthy) == [
        'kvbridge_gateway_engine_healthy{engine="d0",role="decode"} 1.0',
        'kvbridge_gateway_engine_healthy{engine="p0",role="prefill"} 1.0',
    ]
    # An engine configured by URL alone is named by a digest of it.
    label = engine_label("", "http://10.0.0.7:8000")
    assert label.startswith("url-") and "10.0.0.7" not in label and len(label) == 16
