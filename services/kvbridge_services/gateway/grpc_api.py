"""gRPC front door ``kvbridge.gateway.v1.GatewayService`` on the same core as HTTP."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc

from kvbridge import ids
from kvbridge.errors import KvbridgeError, Reason, Unavailable, invalid_field
from kvbridge.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvbridge_services.common.authz import caller
from kvbridge_services.common.boundary import rpc_boundary, stream_boundary

from .control import ControlPlaneError
from .http_api import TenantSlots
from .requests import conversation_key_of, parse_turn
from .reuse import ReuseVerdict
from .service import TENANT_HEADER, GatewayCore
from .turn import Turn, TurnKind
from .upstream import ClientError, sse_events

Ctx = grpc.aio.ServicerContext[Any, Any]
_Chunk = TypeVar("_Chunk", gateway_pb2.CreateChatCompletionResponse, gateway_pb2.CreateCompletionResponse)


def _sampling(sp: gateway_pb2.SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if sp.max_tokens:
        out["max_tokens"] = sp.max_tokens
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        if sp.HasField(name):
            out[name] = getattr(sp, name)
    if sp.stop:
        out["stop"] = list(sp.stop)
    return out


def _report(v: ReuseVerdict) -> gateway_pb2.ReuseReport:
    return gateway_pb2.ReuseReport(
        verdict=v.label, verified_tokens=v.tokens, pulled_tokens=v.pulled_tokens, prompt_tokens=v.prompt_tokens
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self._core = core
        self._slots = TenantSlots(core)

    def _tenant(self, context: Ctx) -> str:
        principal = caller()
        requested = None
        for key, val in context.invocation_metadata() or ():
            if key == TENANT_HEADER:
                requested = val if isinstance(val, str) else val.decode()
        return self._core.tenant_of(principal, requested)

    async def _run(
        self, kind: TurnKind, body: dict[str, Any], request: Any, context: Ctx
    ) -> AsyncIterator[tuple[ReuseVerdict, dict[str, Any], bool]]:
        tenant = self._tenant(context)
        turn: Turn = parse_turn(kind, body, tenant=tenant, session_header=None, limits=self._core.limits)
        timeout_s = _timeout_s(request)
        if timeout_s is not None:
            turn = dataclasses.replace(turn, timeout_s=timeout_s)
        # The HTTP door's slots: a gRPC turn counts against max_concurrency (the gateway's one count of turns in
        # flight, shared with HTTP) and max_tenant_concurrency (per tenant, counted over this door's turns).
        self._slots.take(tenant)
        try:
            try:
                result = await self._core.router.run(turn)
            except ClientError as exc:
                error = exc.body.get("error") if isinstance(exc.body, dict) else None
                message = str(error.get("message")) if isinstance(error, dict) else str(exc)
                raise invalid_field("request", f"engine rejected the request: {message}") from exc
            stream = result.stream
            assert stream is not None
            first = True
            try:
                async for event in sse_events(stream):
                    if event is None:
                        break
                    if "error" in event:
                        raise Unavailable(Reason.UPSTREAM_FAILED, "decode stream failed")
                    yield result.verdict, event, first
                    first = False
            finally:  # the caller went away or the stream ended: close the upstream request now
                close = getattr(stream, "aclose", None)
                if close is not None:
                    await close()
                result.finish()
        finally:
            self._slots.release(tenant)

    @stream_boundary
    async def CreateChatCompletion(
        self, request: gateway_pb2.CreateChatCompletionRequest, context: Ctx
    ) -> AsyncIterator[gateway_pb2.CreateChatCompletionResponse]:
        messages = [
            {
                k: v
                for k, v in (
                    ("role", m.role),
                    ("content", m.content),
                    ("name", m.name),
                    ("tool_call_id", m.tool_call_id),
                )
                if v
            }
            for m in request.messages
        ]
        for m in messages:
            m.setdefault("content", "")
        body = _streaming_body(request, messages=messages)
        async for verdict, ev, first in self._run("chat", body, request, context):
            yield _chunk(gateway_pb2.CreateChatCompletionResponse(), verdict, ev, first)

    @stream_boundary
    async def CreateCompletion(
        self, request: gateway_pb2.CreateCompletionRequest, context: Ctx
    ) -> AsyncIterator[gateway_pb2.CreateCompletionResponse]:
        if request.prompt and request.prompt_token_ids:
            raise invalid_field("prompt", "give either prompt or prompt_token_ids")
        prompt: Any = list(request.prompt_token_ids) if request.prompt_token_ids else request.prompt
        body = _streaming_body(request, prompt=prompt)
        async for verdict, ev, first in self._run("completion", body, request, context):
            yield _chunk(gateway_pb2.CreateCompletionResponse(), verdict, ev, first)

    @rpc_boundary
    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context: Ctx) -> gateway_pb2.ListModelsResponse:
        caller()
        pool = self._core.pool
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.Model(
                    id=m, prefill_engines=pool.count(m, "prefill"), decode_engines=pool.count(m, "decode")
                )
                for m in sorted(self._core.models())
            ]
        )

    @rpc_boundary
    async def CloseConversation(
        self, request: gateway_pb2.CloseConversationRequest, context: Ctx
    ) -> gateway_pb2.CloseConversationResponse:
        tenant = self._tenant(context)
        if not request.model or not request.conversation_id:
            raise invalid_field("conversation_id", "model and conversation_id are required")
        # Checked here so a bad value is the caller's INVALID_ARGUMENT, not a registry failure (UNAVAILABLE).
        conversation_key_of({"conversation_id": request.conversation_id}, None)
        model = ids.MODEL.check("model", request.model)
        await self._core.router.settle_conversation(
            tenant, model, request.conversation_id, timeout_s=self._core.settings.control_timeout_s
        )
        try:
            epoch = await self._core.control.entry_epoch(
                tenant=tenant, model=request.model, conversation_key=request.conversation_id
            )
            # Deleted even with no entry yet: the registry's close tombstone refuses the registration of a turn
            # that began before the close (D's connector may register it after this answer; issue 30).
            await self._core.control.delete_entry(
                tenant=tenant, model=request.model, conversation_key=request.conversation_id
            )
        except ControlPlaneError as exc:
            raise Unavailable(Reason.STORE_UNAVAILABLE, f"registry unavailable: {exc}") from exc
        return gateway_pb2.CloseConversationResponse(released=bool(epoch))


def _timeout_s(request: Any) -> float | None:
    """The request's ``timeout`` in seconds: None when unset or zero (the server's deadlines), INVALID_ARGUMENT
    when negative. A positive one shortens the engine calls' deadlines (never extends them); its expiry is the
    client's choice, not an engine failure (gateway/enginecalls.py)."""
    if not request.HasField("timeout"):
        return None
    seconds = request.timeout.ToNanoseconds() / 1e9
    if seconds < 0:
        raise invalid_field("timeout", "must not be negative (unset or zero: the server's deadlines)")
    return seconds or None


def _streaming_body(request: Any, **fields: Any) -> dict[str, Any]:
    """The OpenAI-style body both gRPC RPCs hand to the shared core: always streamed, with usage and
    token ids, plus the request's sampling, conversation id and cache salt when set."""
    body: dict[str, Any] = {
        "model": request.model,
        **fields,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **_sampling(request.sampling),
    }
    if request.conversation_id:
        body["conversation_id"] = request.conversation_id
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    return body


def _chunk(msg: _Chunk, verdict: ReuseVerdict, ev: dict[str, Any], first: bool) -> _Chunk:
    """``msg`` filled from one event of the decode stream: id and model, the reuse report (first event only),
    each choice's text, token ids and finish reason, and usage."""
    msg.id, msg.model = str(ev.get("id", "")), str(ev.get("model", ""))
    if first:
        msg.reuse.CopyFrom(_report(verdict))
    for choice in ev.get("choices") or []:
        if isinstance(msg, gateway_pb2.CreateChatCompletionResponse):
            msg.delta_content += str((choice.get("delta") or {}).get("content") or "")
        else:
            msg.delta_text += str(choice.get("text") or "")
        msg.delta_token_ids.extend(int(t) for t in choice.get("token_ids") or [])
        if choice.get("finish_reason"):
            msg.finish_reason = str(choice["finish_reason"])
    _usage(msg, ev)
    return msg


def _usage(msg: Any, ev: dict[str, Any]) -> None:
    usage = ev.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        msg.usage.CopyFrom(
            gateway_pb2.Usage(
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                cached_tokens=int(details.get("cached_tokens") or 0),
            )
        )


__all__ = ["GatewayServicer", "KvbridgeError"]
