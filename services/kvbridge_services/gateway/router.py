"""One turn through P/D with verified reuse: the core both front doors share.

tokens → hash chain → registry lookup → prefill on P (with D's params cut to the verified prefix K,
or plain) → decode on D → (compatibility mode) register the new state under a fresh lease.
Any failure on the reuse path retries the prefill once without D params: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from kvbridge import hashchain
from kvbridge import telemetry as tel
from kvbridge.errors import DeadlineExceeded, KvbridgeError, NotFound, Reason, Unavailable
from kvbridge.lease.v1 import lease_pb2
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.telemetry import Telemetry

from . import kvparams, reuse
from .chaincache import ChainCache, Scope
from .config import GatewaySettings
from .control import ControlPlane, ControlPlaneError
from .engines import DECODE, PREFILL, EnginePool, EngineState
from .metrics import GatewayMetrics
from .mirror import EntryMirror
from .renewer import ConversationRenewer
from .requests import Turn
from .reuse import NoReuse, ReusePlan, ReuseVerdict
from .tokenizer import ATTR_TOKENIZE_PATH, LocalTokenizers
from .trust import SecretCanary
from .upstream import TRANSPORT_ERRORS, ClientError, EngineHttp, UpstreamError, UpstreamStream

log = logging.getLogger(__name__)

__all__ = ["ReuseVerdict", "TurnResult", "TurnRouter"]

_MAX_BACKGROUND = 10_000  # cap of pending post-turn tasks (registrations beyond it are skipped)
_MAX_CLOCKS = 10_000  # cap of the engine clock table (one row per decode engine)
# A deadline closer than this counts as passed (vLLM's P uses the same slack on D's expiry).
_EXPIRY_MARGIN_S = 5.0
_EXPIRY_PARAM = "remote_blocks_expiry_time"
# The kvbridge connector marks D's returned params when it retains the blocks under its own lease
# (kvbridge_connector.params.RETAINED).
RETAINED_PARAM = "kvbridge_retained"


@dataclass(slots=True)
class TurnResult:
    verdict: ReuseVerdict
    # Non-streaming: D's response (internal fields removed). Streaming: D's SSE bytes as they arrive.
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None
    after: list[Callable[[], None]] = field(default_factory=list)

    def finish(self) -> None:
        """Starts the post-turn work (the renewal's write, compatibility-mode registration, the turn's log line).
        Front doors call it once the client has its answer (or the stream ended), so none of that work
        runs between D's answer and the client's."""
        after, self.after = self.after, []
        for step in after:
            step()


@dataclass(slots=True)
class _Plan:
    """What the turn decided before prefill."""

    prompt_ids: list[int] | None = None
    block_size: int = 16
    verdict: ReuseVerdict = field(default_factory=ReuseVerdict)
    features: reuse.RequestFeatures = field(default_factory=reuse.RequestFeatures)
    pull: ReusePlan | None = None  # what P pulls (a hit), single-use entries already consumed
    next_epoch: int | None = None
    verified_tokens: int = 0  # what the registry verified (before flooring / declining)
    started: float = field(default_factory=time.perf_counter)
    engine_seconds: float = 0.0  # time inside prefill calls (excluded from router overhead)
    decode_sent_s: float = 0.0  # wall time the decode request went out / its response came back
    decode_answered_s: float = 0.0


class TurnRouter:
    def __init__(
        self,
        settings: GatewaySettings,
        pool: EnginePool,
        control: ControlPlane,
        http: EngineHttp,
        metrics: GatewayMetrics,
        secret: bytes,
        *,
        telemetry: Telemetry | None = None,
        tokenizers: LocalTokenizers | None = None,
        mirror: EntryMirror | None = None,
    ) -> None:
        """``tokenizers``: the gateway's own tokenizers (None: every turn is tokenized by P's /tokenize).
        ``mirror``: the gateway's copy of the registry's entries (None: every lookup is a registry call)."""
        self._mirror = mirror
        self._s = settings
        self._tokenizers = tokenizers
        self._telemetry = telemetry or Telemetry.disabled("kvbridge-gateway")
        self._tracer = self._telemetry.tracer
        self._pool = pool
        self._control = control
        self._http = http
        self._metrics = metrics
        self._secret = hashchain.check_secret(secret)
        self._chains = ChainCache(self._secret, max_bytes=settings.chain_cache_mb * 1024 * 1024)
        self.canary = SecretCanary(self._secret, metrics.secret_mismatch)
        self._pulling: set[tuple[str, str]] = set()
        self._policy = reuse.Policy(
            threshold_tokens=settings.reuse_threshold_tokens,
            single_use_entries=settings.single_use_entries,
            expiry_margin_s=_EXPIRY_MARGIN_S,
        )
        # Stock D's clock minus wall time, a lower bound learned from its responses (compatibility mode): turns
        # an entry's deadline into the remote_blocks_expiry_time P checks on D's clock.
        self._clock_offsets: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._renewer = ConversationRenewer(control)
        self._pending_by_conversation: dict[tuple[str, str, str], set[asyncio.Task[None]]] = {}

    # -- public ------------------------------------------------------------------------
    async def run(self, turn: Turn) -> TurnResult:
        if turn.model not in self._pool.models():
            raise NotFound(Reason.MODEL_NOT_FOUND, f"model {turn.model!r} is not served", metadata={"field": "model"})
        attrs: dict[str, str | bool] = {
            tel.ATTR_MODEL: turn.model,
            "kvbridge.stream": turn.stream,
            **self._telemetry.identity(tenant=turn.tenant, conversation_key=turn.conversation_key),
        }
        with self._tracer.start_as_current_span("kvbridge.gateway.turn", attributes=attrs) as span:
            plan = _Plan()
            prefill = await self._pool.choose_live(turn.model, PREFILL)
            decode = await self._pool.choose_live(turn.model, DECODE)
            plan = await self._plan(turn, prefill, decode, plan)
            if turn.conversation_key and self._control.enabled:
                # Renewed before P may pull the conversation's blocks (an entry near its deadline must outlive
                # the pull); the renewer writes it once the turn ends, or within 0.5 s of a long turn.
                self._renewer.touch(turn.tenant, turn.model, turn.conversation_key)
            p_params = await self._prefill(turn, plan, prefill)
            self._record_verdict(span, plan, prefill, decode)
            result = await self._decode(turn, plan, decode, p_params)
            result.after.insert(0, lambda: self._after_turn(turn, plan))
            return result

    def _after_turn(self, turn: Turn, plan: _Plan) -> None:
        self._renewer.flush_soon()  # the renewal touched before the prefill goes out now
        log.info(
            "turn tenant=%s model=%s key=%r reuse=%s",
            turn.tenant,
            turn.model,
            turn.conversation_key,
            plan.verdict.header(),
        )

    def _record_verdict(self, span: trace.Span, plan: _Plan, prefill: EngineState, decode: EngineState) -> None:
        v = plan.verdict
        pulled = v.tokens if v.hit else 0
        span.set_attributes(
            {
                tel.ATTR_VERDICT: v.verdict,
                tel.ATTR_REASON: v.span_reason,
                tel.ATTR_VERIFIED_TOKENS: plan.verified_tokens,
                tel.ATTR_PULLED_TOKENS: pulled,
                "kvbridge.prompt_tokens": plan.verdict.prompt_tokens,
                "kvbridge.prefill.engine_id": prefill.engine_id or prefill.url,
                "kvbridge.decode.engine_id": decode.engine_id or decode.url,
            }
        )
        if plan.pull is not None:
            span.set_attribute("kvbridge.source.engine_id", plan.pull.source.engine_id)
        self._metrics.reuse.labels(v.verdict, v.metric_reason).inc()
        self._metrics.verified_tokens.inc(plan.verified_tokens)
        self._metrics.pulled_tokens.inc(pulled)
        self._metrics.prompt_tokens.inc(plan.verdict.prompt_tokens)

    async def drain(self) -> None:
        """Waits for post-turn work (registrations, renewals); for tests and shutdown."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self._renewer.flush()

    async def close(self) -> None:
        await self.drain()
        await self._renewer.stop()

    # -- step 1: tokens, hashes, lookup --------------------------------------------------
    def _block_size(self, engine: EngineState) -> int:
        if engine.record is not None and engine.record.block_size:
            return int(engine.record.block_size)
        return self._s.default_block_size

    async def _tokenize(self, turn: Turn, engine: EngineState) -> list[int]:
        """The prompt's token ids: the client's, the gateway's own tokenizer's, else P's /tokenize."""
        if turn.prompt_token_ids is not None:
            self._metrics.tokenize.labels("request").inc()
            return turn.prompt_token_ids
        if self._tokenizers is not None:
            local = await self._tokenizers.ids(
                turn.model,
                turn.kind,
                turn.body,
                (turn.tenant, turn.conversation_key) if turn.conversation_key else None,
            )
            if local is not None:
                self._metrics.tokenize.labels("local").inc()
                trace.get_current_span().set_attribute(ATTR_TOKENIZE_PATH, "local")
                return local
        self._metrics.tokenize.labels("engine").inc()
        trace.get_current_span().set_attribute(ATTR_TOKENIZE_PATH, "engine")
        if turn.kind == "chat":
            req: dict[str, Any] = {"model": turn.model, "messages": turn.body["messages"]}
            for k in (
                "add_generation_prompt",
                "continue_final_message",
                "tools",
                "chat_template",
                "chat_template_kwargs",
                "add_special_tokens",
            ):
                if k in turn.body:
                    req[k] = turn.body[k]
        else:
            req = {
                "model": turn.model,
                "prompt": turn.body["prompt"],
                "add_special_tokens": turn.body.get("add_special_tokens", True),
            }
        with self._engine_span("kvbridge.gateway.tokenize", engine) as span:
            async with self._pool.using(engine):
                data = await self._http.post_json(
                    f"{engine.url}/tokenize", req, timeout_s=self._s.tokenize_timeout_s, headers=tel.trace_headers()
                )
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise UpstreamError("tokenize answered without token ids")
            span.set_attribute("kvbridge.prompt_tokens", len(tokens))
        return tokens

    def _engine_span(self, name: str, engine: EngineState) -> Any:
        """A CLIENT span around one HTTP call to an engine (its traceparent goes into the request headers)."""
        return self._tracer.start_as_current_span(
            name,
            kind=trace.SpanKind.CLIENT,
            attributes={tel.ATTR_ENGINE: engine.engine_id or engine.url, "server.address": engine.url},
        )

    def _is_adapter(self, model: str, *engines: EngineState) -> bool:
        """Whether ``model`` names a LoRA adapter (or alias) of the engines rather than the model they register
        under: the kvbridge connector registers (and hashes) under the engine's model name, so the chain would
        not tell the adapter's KV from the base model's."""
        for e in engines:
            if model in e.adapters or (e.record is not None and e.record.model and e.record.model != model):
                return True
        return False

    async def _plan(self, turn: Turn, prefill: EngineState, decode: EngineState, plan: _Plan) -> _Plan:
        plan.block_size = self._block_size(prefill)
        plan.features = reuse.request_features(
            turn.body,
            lora_adapter=self._is_adapter(turn.model, prefill, decode),
            secret_mismatch=self.canary.mismatch(decode.record),
        )
        wants_reuse = bool(
            self._s.reuse_enabled and self._control.enabled and (turn.conversation_key or self._s.content_lookup)
        )
        early = reuse.screen(plan.features, wants_reuse=wants_reuse, prompt_tokens=None, policy=self._policy)
        if early is not None:
            plan.verdict.outcome = early
        register = self._s.compat_registration and bool(turn.conversation_key) and plan.features.covered
        if early is not None and not register:
            return plan
        try:
            plan.prompt_ids = await self._tokenize(turn, prefill)
        except ClientError:
            raise
        except UpstreamError as exc:
            if early is None:
                plan.verdict.outcome = NoReuse.TOKENIZE_FAILED
            log.warning("tokenize failed, no reuse this turn: %s", exc)
            return plan
        plan.verdict.prompt_tokens = len(plan.prompt_ids)
        if early is not None:
            return plan
        short = reuse.screen(plan.features, wants_reuse=True, prompt_tokens=len(plan.prompt_ids), policy=self._policy)
        if short is not None:
            plan.verdict.outcome = short
            return plan
        await self._lookup(turn, plan)
        return plan

    async def _lookup(self, turn: Turn, plan: _Plan) -> None:
        assert plan.prompt_ids is not None
        b, threshold = plan.block_size, self._s.reuse_threshold_tokens
        hashes = self._chains.chain(
            Scope(turn.tenant, turn.model, turn.cache_salt, b), turn.conversation_key, plan.prompt_ids
        )
        if self._mirror is not None:
            asked_at = time.monotonic()
            found = self._mirror.lookup(
                tenant=turn.tenant,
                model=turn.model,
                conversation_key=turn.conversation_key,
                block_hashes=hashes,
                block_size=b,
                min_tokens=threshold,
                engine_record=self._engine_record,
            )
            if found is not None:
                self._metrics.lookups.labels("mirror").inc()
                await self._apply_lookup(turn, plan, found, asked_at)
                if plan.verdict.hit:
                    trace.get_current_span().set_attribute(tel.ATTR_LOOKUP_SOURCE, "mirror")
                    return
                # Declined here (consumed, busy, ...): the registry may hold a newer entry than the copy.
                plan.verdict = ReuseVerdict(prompt_tokens=plan.verdict.prompt_tokens)
                plan.next_epoch, plan.verified_tokens = None, 0
        asked_at = time.monotonic()
        try:
            found = await self._control.lookup(
                tenant=turn.tenant,
                model=turn.model,
                conversation_key=turn.conversation_key,
                block_hashes=hashes,
                block_size=b,
                min_tokens=threshold,
            )
        except ControlPlaneError as exc:
            log.warning("registry lookup failed, no reuse this turn: %s", exc)
            plan.verdict.outcome = NoReuse.REGISTRY_UNAVAILABLE
            return
        self._metrics.lookups.labels("registry").inc()
        trace.get_current_span().set_attribute(tel.ATTR_LOOKUP_SOURCE, "registry")
        await self._apply_lookup(turn, plan, found, asked_at)

    def _engine_record(self, engine_id: str) -> types_pb2.Engine | None:
        """The registry's record of an engine, as the pool last listed it (the mirror's Location.engine)."""
        state = self._pool.find(engine_id)
        return state.record if state is not None else None

    async def _apply_lookup(
        self, turn: Turn, plan: _Plan, found: registry_pb2.LookupEntryResponse, asked_at: float
    ) -> None:
        """Decides on the lookup's answer; a single-use entry is then consumed in the registry before P may pull.
        ``asked_at``: when the lookup was sent (monotonic). P's READ must start within the engine's offer window
        of the lookup; the answer may have been made at any time after the request left, so the window runs
        from then (a slow answer shortens what P gets, it never stretches D's promise)."""
        assert plan.prompt_ids is not None
        loc = found.location
        if found.HasField("location") and loc.conversation_key == turn.conversation_key:
            plan.next_epoch = int(loc.epoch) + 1
        plan.verdict.tokens = plan.verified_tokens = int(found.verified_tokens)
        if found.verdict == registry_pb2.LOOKUP_VERDICT_HIT:
            plan.verdict.tokens = kvparams.reusable_tokens(plan.verified_tokens, len(plan.prompt_ids), plan.block_size)
        engine_id = loc.engine.engine_id
        local = self._pool.find(engine_id) if engine_id else None
        source = reuse.SourceState(
            healthy=local.offers_blocks if local is not None else None,
            pulling=(engine_id, loc.engine_request_id) in self._pulling,
            clock_offset_s=self._clock_offsets.get(engine_id),
        )
        decided = reuse.decide(
            plan.features,
            wants_reuse=True,
            prompt_tokens=len(plan.prompt_ids),
            lookup=found,
            block_size=plan.block_size,
            source=source,
            policy=self._policy,
            now_s=time.time(),
            looked_up_at=asked_at,
            now_mono=time.monotonic(),
        )
        if isinstance(decided, NoReuse):
            plan.verdict.outcome = decided
            return
        if decided.consume:
            try:
                took = await self._control.consume_entry(
                    tenant=turn.tenant, model=turn.model, conversation_key=decided.conversation_key, epoch=decided.epoch
                )
            except ControlPlaneError as exc:
                log.warning("could not consume a single-use entry, no reuse this turn: %s", exc)
                plan.verdict.outcome = NoReuse.REGISTRY_UNAVAILABLE
                return
            if not took:
                plan.verdict.outcome = NoReuse.CONSUMED
                return
        plan.pull = decided
        plan.verdict.tokens = decided.tokens
        plan.verdict.outcome = None

    # -- step 2: prefill ---------------------------------------------------------------------
    def _prefill_body(self, turn: Turn, params: dict[str, Any]) -> dict[str, Any]:
        body = {
            k: v
            for k, v in turn.body.items()
            if k not in ("stream_options", "max_completion_tokens", "min_tokens", "session_id")
        }
        body.update(max_tokens=1, stream=False, kv_transfer_params=params)
        return body

    async def _prefill_once(
        self, turn: Turn, plan: _Plan, engine: EngineState, params: dict[str, Any]
    ) -> dict[str, Any]:
        path = "/v1/chat/completions" if turn.kind == "chat" else "/v1/completions"
        started = time.perf_counter()
        with self._engine_span("kvbridge.gateway.prefill", engine) as span:
            span.set_attribute(tel.ATTR_PULLED_TOKENS, int(params.get("remote_num_tokens") or 0))
            async with self._pool.using(engine):
                try:
                    data = await self._http.post_json(
                        engine.url + path,
                        self._prefill_body(turn, params),
                        timeout_s=turn.timeout_s or self._s.prefill_timeout_s,
                        headers=tel.trace_headers(),
                    )
                except UpstreamError as exc:
                    self._engine_failed(engine, exc)
                    raise
                finally:
                    plan.engine_seconds += time.perf_counter() - started
                self._pool.answered(engine)
        try:
            return kvparams.check_prefill_returned(data.get("kv_transfer_params"))
        except ValueError as exc:
            raise UpstreamError(f"prefill on {engine.url}: {exc}") from exc

    async def _prefill(self, turn: Turn, plan: _Plan, engine: EngineState) -> dict[str, Any]:
        if plan.pull is not None:
            pull = plan.pull
            params = kvparams.reuse_prefill_params(
                pull.source, pull.tokens, plan.block_size, prompt_ids=plan.prompt_ids or (), secret=self._secret
            )
            self._pulling.add(pull.key)
            try:
                returned = await self._prefill_once(turn, plan, engine, params)
                cached = returned.get("remote_prefill_cached_tokens")
                if isinstance(cached, int) and cached == 0:
                    plan.verdict.outcome = NoReuse.RECOMPUTED  # P chose (or had) to recompute
                return returned
            except (UpstreamError, ClientError) as exc:
                # A single-use entry is already consumed (the registry deleted it): nobody tries it again.
                log.warning("prefill with D params failed; retrying without them: %s", exc)
                self._metrics.reuse_retries.inc()
                timed_out = isinstance(exc, UpstreamError) and exc.timed_out
                plan.verdict.outcome = NoReuse.PREFILL_TIMEOUT if timed_out else NoReuse.PREFILL_FAILED
            finally:
                self._pulling.discard(pull.key)
            with contextlib.suppress(Unavailable):  # the retry may go to another P if this one looks broken
                engine = await self._pool.choose_live(turn.model, PREFILL)
        try:
            return await self._prefill_once(turn, plan, engine, kvparams.plain_prefill_params())
        except UpstreamError as exc:
            # A plain prefill that timed out is worth one try on another prefill engine, if there is one.
            other = (
                self._pool.choose(turn.model, PREFILL, exclude=frozenset({engine.url}))
                if exc.timed_out and self._pool.count(turn.model, PREFILL) > 1
                else None
            )
            if other is None:
                raise _upstream_failure("prefill", exc) from exc
            log.warning("prefill on %s timed out; trying %s", engine.url, other.url)
        try:
            return await self._prefill_once(turn, plan, other, kvparams.plain_prefill_params())
        except UpstreamError as exc:
            raise _upstream_failure("prefill", exc) from exc

    def _engine_failed(self, engine: EngineState, exc: UpstreamError) -> None:
        """Passive health: a timeout ejects the engine for a while, any other transport failure marks it
        down until its next good health check."""
        if exc.timed_out:
            self._pool.timed_out(engine)
        elif exc.transport:
            self._pool.mark_failed(engine, str(exc))

    # -- step 3: decode ----------------------------------------------------------------------
    async def _decode(self, turn: Turn, plan: _Plan, engine: EngineState, p_params: dict[str, Any]) -> TurnResult:
        epoch = _epoch_for(plan)
        body = dict(turn.body)
        # A turn whose KV the chain does not cover (multimodal, LoRA) gives D no conversation: a connector there
        # registers nothing, and neither does the gateway.
        covered = plan.features.covered
        body["kv_transfer_params"] = kvparams.decode_params(
            p_params,
            tenant=turn.tenant,
            conversation_key=turn.conversation_key if covered else "",
            epoch=epoch,
            secret=self._secret,
        )
        register = (
            self._s.compat_registration
            and self._control.enabled
            and bool(turn.conversation_key)
            and not turn.stream
            and covered
        )
        if register:
            body["return_token_ids"] = True
        path = "/v1/chat/completions" if turn.kind == "chat" else "/v1/completions"
        self._metrics.router_overhead.observe(max(0.0, time.perf_counter() - plan.started - plan.engine_seconds))
        if turn.stream:
            return await self._decode_stream(turn, plan, engine, path, body)
        with self._engine_span("kvbridge.gateway.decode", engine):
            async with self._pool.using(engine):
                plan.decode_sent_s = time.time()
                try:
                    data = await self._http.post_json(
                        engine.url + path,
                        body,
                        timeout_s=turn.timeout_s or self._s.decode_timeout_s,
                        headers=tel.trace_headers(),
                    )
                except UpstreamError as exc:
                    self._engine_failed(engine, exc)
                    raise _upstream_failure("decode", exc) from exc
                plan.decode_answered_s = time.time()
        self._pool.answered(engine)
        self._metrics.ttft.labels(_reuse_label(plan)).observe(time.perf_counter() - plan.started)
        retained_params = data.pop("kv_transfer_params", None)
        result = TurnResult(plan.verdict, body=data)
        if register:
            seq = _sequence(turn, data)
            if seq is not None:
                # Started after the response, in this turn's context: the registration stays in the turn's trace.
                turn_context = contextvars.copy_context()
                result.after.append(
                    lambda: turn_context.run(
                        self._spawn, self._register(turn, plan, engine, retained_params, seq), turn
                    )
                )
        if not turn.client_wants_token_ids:
            _drop_token_ids(data)
        return result

    async def _decode_stream(
        self, turn: Turn, plan: _Plan, engine: EngineState, path: str, body: dict[str, Any]
    ) -> TurnResult:
        engine.outstanding += 1
        try:
            with self._engine_span("kvbridge.gateway.decode", engine):  # until D's response headers
                upstream = await self._http.open_stream(
                    engine.url + path,
                    body,
                    connect_timeout_s=self._s.connect_timeout_s,
                    read_timeout_s=turn.timeout_s or self._s.decode_timeout_s,
                    headers=tel.trace_headers(),
                )
        except UpstreamError as exc:
            engine.outstanding -= 1
            self._engine_failed(engine, exc)
            raise _upstream_failure("decode", exc) from exc
        except BaseException:
            engine.outstanding -= 1
            raise
        ttft = self._metrics.ttft.labels(_reuse_label(plan))
        return TurnResult(
            plan.verdict, stream=_forward(upstream, engine, lambda: ttft.observe(time.perf_counter() - plan.started))
        )

    # -- step 4: afterwards --------------------------------------------------------------------
    def _spawn(self, coro: Any, turn: Turn) -> None:
        if len(self._background) >= _MAX_BACKGROUND:
            coro.close()
            log.warning("too much post-turn work pending; skipping one task")
            return
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        key = (turn.tenant, turn.model, turn.conversation_key)
        self._pending_by_conversation.setdefault(key, set()).add(task)
        task.add_done_callback(lambda t: self._forget_pending(key, t))

    def _forget_pending(self, key: tuple[str, str, str], task: asyncio.Task[None]) -> None:
        tasks = self._pending_by_conversation.get(key)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._pending_by_conversation[key]

    async def settle_conversation(self, tenant: str, model: str, conversation_key: str, *, timeout_s: float) -> None:
        """Waits (bounded) for this conversation's post-turn work, so that closing it right after a turn
        also releases what that turn is still registering."""
        tasks = list(self._pending_by_conversation.get((tenant, model, conversation_key), ()))
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def _register(self, turn: Turn, plan: _Plan, engine: EngineState, params: object, seq: Sequence[int]) -> None:
        retained = kvparams.retained_from_decode(params, len(seq))
        if retained is None:
            self._metrics.registrations.labels("nothing_retained").inc()
            return
        if _connector_registers(engine, params):
            # The kvbridge connector on D registers its own entry under its own lease and frees the blocks when
            # that lease ends: an entry of ours would outlive them (and supersede the connector's).
            self._metrics.registrations.labels("connector_registers").inc()
            return
        if engine.engine_id and retained.engine_id != engine.engine_id:
            log.warning("D %s reported engine id %s; not registering", engine.url, retained.engine_id)
            self._metrics.registrations.labels("engine_mismatch").inc()
            return
        # Stock D holds the blocks for its fixed decoder_kv_blocks_ttl from when it finished, so no later than
        # decode_sent + ttl: the entry's deadline, which no lease renewal extends (lookups refuse an entry past
        # it). D's own deadline on its clock tells how its clock relates to ours (for P's expiry check).
        ttl = self._s.compat_decoder_kv_blocks_ttl_s
        expire_s = plan.decode_sent_s + ttl
        d_expiry = params.get(_EXPIRY_PARAM) if isinstance(params, dict) else None
        if isinstance(d_expiry, int | float) and not isinstance(d_expiry, bool):
            self._learn_clock(retained.engine_id, float(d_expiry) - ttl - plan.decode_answered_s)
        remaining = expire_s - time.time() - _EXPIRY_MARGIN_S
        if remaining <= 0:
            self._metrics.registrations.labels("expired").inc()
            return
        b = self._block_size(engine)
        full = retained.token_count // b
        if full == 0:
            self._metrics.registrations.labels("too_short").inc()
            return
        hashes = self._chains.chain(
            Scope(turn.tenant, turn.model, turn.cache_salt, b), turn.conversation_key, seq[: full * b]
        )
        n_blocks = -(-retained.token_count // b)
        groups = [types_pb2.BlockIds(ids=g[:n_blocks]) for g in retained.block_groups]
        lease_id = 0
        try:
            lease_id = await self._control.grant_lease(
                kind=lease_pb2.LEASE_KIND_ENTRY,
                tenant=turn.tenant,
                engine_id=retained.engine_id,
                model=turn.model,
                conversation_key=turn.conversation_key,
                retained_tokens=retained.token_count,
                ttl_s=min(self._s.entry_lease_ttl_s, remaining),
            )
            entry = registry_pb2.Entry(
                key=registry_pb2.EntryKey(tenant=turn.tenant, model=turn.model, conversation_key=turn.conversation_key),
                engine_id=retained.engine_id,
                engine_request_id=retained.request_id,
                block_ids=groups,
                block_size=b,
                token_count=retained.token_count,
                block_hashes=hashes,
                chain_stride=1,
                final_block_hash=hashes[-1],
                lease_id=lease_id,
                epoch=_epoch_for(plan),
            )
            entry.expire_time.FromNanoseconds(int(expire_s * 1e9))
            try:
                await self._control.register_entry(entry)
                self._metrics.registrations.labels("ok").inc()
                return
            except ControlPlaneError as exc:
                if exc.reason != Reason.STALE_EPOCH.value:
                    raise
                # A later turn's state is already registered: it wins; ours is dropped and its lease freed.
                log.info("registration superseded by a newer epoch: %s", exc)
                self._metrics.registrations.labels("superseded").inc()
                with contextlib.suppress(ControlPlaneError):
                    await self._control.revoke_lease(lease_id)
        except ControlPlaneError as exc:
            log.warning("compatibility-mode registration failed: %s", exc)
            self._metrics.registrations.labels("failed").inc()
            if lease_id:
                with contextlib.suppress(ControlPlaneError):
                    await self._control.revoke_lease(lease_id)

    def forget_clock(self, engine_id: str) -> None:
        """A new incarnation of the engine (maybe on another host, with another monotonic clock): learn anew."""
        self._clock_offsets.pop(engine_id, None)

    def _learn_clock(self, engine_id: str, offset_low: float) -> None:
        """Keeps the largest lower bound of D's clock minus ours (D finished before our receive time)."""
        old = self._clock_offsets.get(engine_id)
        if old is None and len(self._clock_offsets) >= _MAX_CLOCKS:
            self._clock_offsets.pop(next(iter(self._clock_offsets)))
        self._clock_offsets[engine_id] = offset_low if old is None else max(old, offset_low)


def _connector_registers(engine: EngineState, params: object) -> bool:
    """Whether D runs the kvbridge connector (its record says so, or it marked the response retained)."""
    record = engine.record
    if record is not None and reuse.CONNECTOR_CAPABILITY in record.capabilities:
        return True
    return isinstance(params, dict) and params.get(RETAINED_PARAM) is True


def _epoch_for(plan: _Plan) -> int:
    """Epochs are microseconds of wall time, and above the one the lookup saw.

    Time-based epochs order a conversation's turns across gateway replicas and
    across a registration that lands after the next turn's lookup (reading the
    stored epoch and adding one would let an older turn's state supersede a newer one).
    """
    return max(plan.next_epoch or 0, time.time_ns() // 1_000)


def _reuse_label(plan: _Plan) -> str:
    return "hit" if plan.verdict.hit else "none"


async def _forward(
    upstream: UpstreamStream, engine: EngineState, on_first_chunk: Callable[[], None]
) -> AsyncIterator[bytes]:
    """D's SSE bytes, forwarded as they arrive; closing early (client gone) closes the upstream request."""
    started = time.monotonic()
    first = True
    try:
        async for chunk in upstream.chunks():
            if first:
                on_first_chunk()
                first = False
            yield chunk
    except TRANSPORT_ERRORS as exc:
        log.warning("decode stream from %s broke after %.1fs: %s", engine.url, time.monotonic() - started, exc)
        yield b'data: {"error": {"message": "upstream stream failed", "code": "UPSTREAM_FAILED"}}\n\n'
    finally:
        engine.outstanding -= 1
        await upstream.aclose()


def _upstream_failure(step: str, exc: UpstreamError) -> KvbridgeError:
    """An engine past its deadline is DEADLINE_EXCEEDED (HTTP 504); any other failure UNAVAILABLE (502)."""
    if exc.timed_out:
        return DeadlineExceeded(Reason.UPSTREAM_FAILED, f"{step} timed out: {exc}")
    return Unavailable(Reason.UPSTREAM_FAILED, f"{step} failed: {exc}")


def _sequence(turn: Turn, data: dict[str, Any]) -> array[int] | None:
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


def _drop_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
