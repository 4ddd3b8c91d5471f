"""Property-based bad input over every gateway HTTP endpoint.

Wrong JSON types on every field, malformed JSON, invalid UTF-8, oversized bodies, hostile headers, negative
and huge numbers, forged ``kv_transfer_params``: every answer is 2xx or a 4xx whose JSON error names a
reason, never a 5xx; the gateway's in-flight count returns to zero (nothing leaked).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import ACME_KEY, GLOBEX_KEY, MODEL, SERVICE_KEY, SecureStack

HTTP_FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, 16, 2**31, 2**63, -(2**63)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.sampled_from([MODEL, "user", "", "x" * 300, "\u0000", "😀"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
messages_values = st.one_of(
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "system", "tool", "bogus", 7]),
                "content": st.one_of(st.text(max_size=60), json_values),
            }
        ),
        max_size=5,
    ),
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just(MODEL), json_values),
    "messages": messages_values,
    "prompt": st.one_of(st.text(max_size=50), st.lists(st.integers(-(2**40), 2**40), max_size=20), json_values),
    "max_tokens": st.one_of(st.integers(-5, 40), json_values),
    "max_completion_tokens": json_values,
    "temperature": json_values,
    "top_p": json_values,
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": json_values,
    "n": json_values,
    "conversation_id": st.one_of(st.text(max_size=300), json_values),
    "session_id": json_values,
    "cache_salt": st.one_of(st.text(max_size=300), json_values),
    "kv_transfer_params": st.one_of(
        json_values,
        st.fixed_dictionaries(
            {
                "do_remote_prefill": st.booleans(),
                "remote_host": st.sampled_from(["169.254.169.254", "10.0.0.1", "x"]),
                "remote_port": st.integers(-1, 70000),
                "remote_block_ids": json_values,
            }
        ),
    ),
    "return_token_ids": json_values,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)
raw_bodies = st.one_of(
    st.binary(max_size=80),
    st.sampled_from(
        [
            b"",
            b"{",
            b"[]",
            b"null",
            b'"str"',
            b'{"model": "\xff\xfe"}',
            b"\xef\xbb\xbf{}",
            b'{"model": 1e999}',
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": NaN}}',
            b'{"a":' * 5000,
            b'{"model": "sim-model", "messages": [' + b'{"role":"user","content":"x"},' * 3000 + b'{"role":"user"}]}',
        ]
    ),
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-session-id": st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300).map(
            lambda s: s.strip() or "x"
        ),
        "x-kvbridge-tenant": st.sampled_from(["globex", "acme", "unknown", "x" * 200]),
        "content-type": st.sampled_from(["text/plain", "application/json", "multipart/form-data"]),
    },
)
PATHS = ["/v1/chat/completions", "/v1/completions"]


async def _send(client: httpx.AsyncClient, path: str, content: bytes, hdrs: dict[str, str]) -> httpx.Response:
    async with client.stream("POST", path, content=content, headers=hdrs) as resp:
        await resp.aread()
        return resp


def assert_clean_http(resp: httpx.Response) -> None:
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400 and resp.status_code != 499:
        err = resp.json()["error"]
        assert err.get("code"), f"error without a reason: {resp.text[:300]}"
        assert err.get("message")
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-200:]


@HTTP_FUZZ
@given(
    path=st.sampled_from(PATHS),
    body=st.one_of(bodies.map(lambda b: json.dumps(b).encode()), raw_bodies),
    hdrs=headers,
    key=st.sampled_from([ACME_KEY, GLOBEX_KEY, SERVICE_KEY]),
)
async def test_completions_reject_hostile_bodies(
    secure: SecureStack, path: str, body: bytes, hdrs: dict[str, str], key: str
) -> None:
    async with secure.http(key) as client:
        resp = await _send(client, path, body, hdrs)
    assert_clean_http(resp)
    await secure.settle()
    assert secure.gateway.core.inflight == 0


async def test_oversized_body_is_413(secure: SecureStack) -> None:
    limit = secure.gateway.settings.max_body_bytes
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w" * (limit + 10)}]}).encode()
    async with secure.http() as client:
        resp = await _send(client, "/v1/chat/completions", big, {})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large"

        async def chunks() -> Any:  # no content-length: the limit holds while streaming the body in
            for _ in range(limit // 65536 + 2):
                yield b"w" * 65536

        resp = await client.post("/v1/chat/completions", content=chunks())
        assert resp.status_code == 413
    assert secure.gateway.core.inflight == 0


async def test_other_endpoints_and_methods(secure: SecureStack) -> None:
    async with secure.http() as client:
        for method, path in (("GET", "/v1/models"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")):
            resp = await client.request(method, path)
            assert resp.status_code == 200, path
        for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/v1/models"), ("DELETE", "/v1/completions")):
            resp = await client.request(method, path)
            assert resp.status_code == 405, (method, path)
        resp = await client.get("/v1/../../etc/passwd")
        assert resp.status_code == 404
        resp = await client.get("/v1/models", headers={"x-kvbridge-tenant": "globex"})
        assert resp.status_code == 200
