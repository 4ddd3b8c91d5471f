"""Step 3 of a turn: the decode on D, with P's returned params (signed, with the turn's conversation and
epoch), non-streaming or as D's SSE stream forwarded frame by frame. A non-streaming turn on a stock D asks
for token ids so that the gateway can register what D retained (compatibility mode) once the client has
its answer."""

from __future__ import annotations

import contextvars
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry import trace

from kvbridge import telemetry as tel
from kvbridge_services.common.telemetry import gen_ai_request, gen_ai_usage

from . import kvparams
from .answers import SseRewriter, error_frame, reused_tokens, set_cached_tokens
from .enginecalls import (
    EngineAccess,
    EngineStep,
    call_timeout_s,
    client_cut_short,
    completion_path,
    upstream_failure,
)
from .engines import EngineState
from .posturn import PostTurnWork
from .registration import CompatRegistrar, connector_registers
from .reuse import ReuseVerdict
from .turn import Turn
from .turnstate import TurnPlan, TurnResult
from .upstream import TRANSPORT_ERRORS, UpstreamError, UpstreamStream
from .verdict import ttft_label

log = logging.getLogger(__name__)


class Decoder(EngineStep):
    def __init__(
        self,
        access: EngineAccess,
        secret: bytes,
        registrar: CompatRegistrar,
        post_turn: PostTurnWork,
        *,
        registers: Callable[[], bool],
        block_size: Callable[[EngineState], int],
    ) -> None:
        """``registers``: whether compatibility-mode registration is on now (the control plane may be off).
        ``block_size``: an engine's KV block size."""
        super().__init__(access)
        self._secret = secret
        self._registrar = registrar
        self._post_turn = post_turn
        self._registers = registers
        self._block_size = block_size

    async def run(
        self, turn: Turn, plan: TurnPlan, engine: EngineState, p_params: dict[str, Any], verdict: ReuseVerdict
    ) -> TurnResult:
        """``verdict``: the turn's, as the client gets it with the answer (made by verdict.verdict_of)."""
        body = dict(turn.body)
        turn_span = trace.get_current_span()  # the turn's span: gen_ai.* beside kvbridge's own attributes
        turn_span.set_attributes(gen_ai_request(turn.kind, turn.model))
        if verdict.prompt_tokens:
            turn_span.set_attribute("gen_ai.usage.input_tokens", verdict.prompt_tokens)
        # A turn whose KV the chain does not cover (multimodal, LoRA) gives D no conversation: a connector there
        # registers nothing, and neither does the gateway.
        covered = plan.features.covered
        plan.sent_epoch = plan.epoch
        plan.connector_registers = connector_registers(engine, None)
        body["kv_transfer_params"] = kvparams.decode_params(
            p_params,
            tenant=turn.tenant,
            conversation_key=turn.conversation_key if covered else "",
            epoch=plan.sent_epoch,
            secret=self._secret,
        )
        # A connector D registers its own entry: asking it for the sequence's ids would only cost a write, a
        # parse and a registration task that skips (tens of KB at agent context lengths).
        register = (
            self._registers()
            and bool(turn.conversation_key)
            and not turn.stream
            and covered
            and not plan.connector_registers
        )
        if register:
            body["return_token_ids"] = True
        self._metrics.router_overhead.observe(max(0.0, time.perf_counter() - plan.started - plan.engine_seconds))
        if turn.stream:
            return await self._stream(turn, plan, engine, body, verdict, reused_tokens(p_params, verdict.pulled_tokens))
        with self._calls.span("kvbridge.gateway.decode", engine):
            async with self._pool.using(engine):
                plan.decode_sent_s = time.time()
                try:
                    data = await self._http.post_json(
                        engine.url + completion_path(turn),
                        body,
                        timeout_s=call_timeout_s(turn, self._s.decode_timeout_s),
                        headers=tel.trace_headers(),
                    )
                except UpstreamError as exc:
                    self._calls.failed(engine, exc, client_deadline=client_cut_short(turn, self._s.decode_timeout_s))
                    raise upstream_failure("decode", exc) from exc
                plan.decode_answered_s = time.time()
        self._pool.answered(engine)
        self._metrics.ttft.labels(ttft_label(verdict)).observe(time.perf_counter() - plan.started)
        retained_params = data.pop("kv_transfer_params", None)
        if plan.connector_registers and not connector_registers(engine, retained_params, record=False):
            # D's connector kept nothing of this turn (under memory pressure it frees a finished request at once):
            # no registration is coming, so the conversation's next turn must not wait for one (freshness.py).
            plan.connector_registers = False
        set_cached_tokens(data, reused_tokens(p_params, verdict.pulled_tokens))
        turn_span.set_attributes(gen_ai_usage(data.get("usage")))
        result = TurnResult(verdict, body=data)
        if register:
            seq = sequence_of(turn, data)
            if seq is not None:
                # Started after the response, in this turn's context: the registration stays in the turn's trace.
                turn_context = contextvars.copy_context()
                conversation = turn.conversation
                d_block_size = self._block_size(engine)
                result.after.append(
                    lambda: turn_context.run(
                        self._post_turn.spawn,
                        self._registrar.register(
                            turn, engine, retained_params, seq, block_size=d_block_size, turn_plan=plan
                        ),
                        conversation,
                    )
                )
        if not turn.client_wants_token_ids:
            drop_token_ids(data)
        return result

    async def _stream(
        self,
        turn: Turn,
        plan: TurnPlan,
        engine: EngineState,
        body: dict[str, Any],
        verdict: ReuseVerdict,
        cached: int | None,
    ) -> TurnResult:
        engine.outstanding += 1
        try:
            with self._calls.span("kvbridge.gateway.decode", engine):  # until D's response headers
                upstream = await self._http.open_stream(
                    engine.url + completion_path(turn),
                    body,
                    connect_timeout_s=self._s.connect_timeout_s,
                    read_timeout_s=call_timeout_s(turn, self._s.decode_timeout_s),
                    headers=tel.trace_headers(),
                )
        except UpstreamError as exc:
            engine.outstanding -= 1
            self._calls.failed(engine, exc, client_deadline=client_cut_short(turn, self._s.decode_timeout_s))
            raise upstream_failure("decode", exc) from exc
        except BaseException:
            engine.outstanding -= 1
            raise
        ttft = self._metrics.ttft.labels(ttft_label(verdict))
        return TurnResult(
            verdict,
            stream=forward(upstream, engine, lambda: ttft.observe(time.perf_counter() - plan.started), cached),
        )


UPSTREAM_FAILED_FRAME = error_frame("upstream stream failed", "upstream_failed")


async def forward(
    upstream: UpstreamStream, engine: EngineState, on_first_chunk: Callable[[], None], cached: int | None = None
) -> AsyncIterator[bytes]:
    """D's SSE bytes, forwarded as they arrive (its usage frame's ``cached_tokens`` set to ``cached`` unless None,
    its error frames in OpenAI's shape: answers.py); closing early (client gone) closes the upstream request."""
    started = time.monotonic()
    first = True
    frames = SseRewriter(cached)
    try:
        async for chunk in upstream.chunks():
            if first:
                on_first_chunk()
                first = False
            out = frames.feed(chunk)
            if out:
                yield out
        tail = frames.flush()
        if tail:
            yield tail
    except TRANSPORT_ERRORS as exc:
        log.warning("decode stream from %s broke after %.1fs: %s", engine.url, time.monotonic() - started, exc)
        yield UPSTREAM_FAILED_FRAME  # a frame cut short by the break (held, not sent) is dropped
    finally:
        engine.outstanding -= 1
        await upstream.aclose()


def sequence_of(turn: Turn, data: dict[str, Any]) -> array[int] | None:
    """Prompt + generated token ids from a non-streaming response with return_token_ids (None: absent or not
    all ids in 0..2^32-1). An array: converted in C, not one Python int() per token of a 128K-token prompt."""
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    prompt = data.get("prompt_token_ids") if turn.kind == "chat" else choice.get("prompt_token_ids")
    out = choice.get("token_ids")
    if not isinstance(prompt, list) or not isinstance(out, list):
        return None
    try:
        seq = array("I", prompt)
        seq.extend(out)
    except (TypeError, OverflowError):
        return None
    return seq


def drop_token_ids(data: dict[str, Any]) -> None:
    """Removes the token ids the gateway asked D for and the client did not."""
    data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
