"""One turn through P/D with verified reuse: the core both front doors share.

tokens (prompt_ids.py) → hash chain → registry lookup (the gateway's mirror first) → the reuse decision
(reuse.py) → with placement on, where the turn runs (placement.py: recompute, pull to P, or a local prefill on
the D holding the history; D is the holder unless it is too loaded) → prefill on P with D's params cut to the
verified prefix K, or plain (prefill.py), or none → decode on D (decode.py) → compatibility mode: register the
new state under a fresh lease (registration.py), as supervised post-turn work (posturn.py). Any failure on the
reuse path retries the prefill once without D params, and a failed local prefill goes through P and another
D: slower, never wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from opentelemetry import trace

from kvbridge import hashchain
from kvbridge import telemetry as tel
from kvbridge.errors import DeadlineExceeded, NotFound, Reason, Unavailable
from kvbridge.registry.v1 import registry_pb2
from kvbridge.types.v1 import types_pb2
from kvbridge_services.common.telemetry import Telemetry

from . import kvparams, placement, reuse, threads
from .chaincache import ChainCache, Scope
from .config import GatewaySettings
from .control import ControlPlane, ControlPlaneError, KeyedLookup
from .decode import Decoder
from .enginecalls import EngineAccess, EngineCalls
from .engines import DECODE, PREFILL, EnginePool, EngineState
from .figures import Figures
from .freshness import RecentTurns, registration_wait_s
from .metrics import GatewayMetrics
from .mirror import EntryMirror
from .placement import Choice, Placement, Why
from .placer import Placer, engine_key, recompute_instead, set_placement
from .posturn import PostTurnWork
from .prefill import Prefiller
from .prompt_ids import PromptIds
from .registration import EXPIRY_MARGIN_S, ClockOffsets, CompatRegistrar
from .renewer import ConversationRenewer
from .reuse import NoReuse, ReuseVerdict
from .threads import RecentThreads, Thread, ThreadWhy
from .tokenizer import LocalTokenizers
from .trust import SecretCanary
from .turn import Turn
from .turnstate import TurnPlan, TurnResult
from .upstream import ClientError, EngineHttp, UpstreamError
from .verdict import verdict_of

log = logging.getLogger(__name__)

__all__ = ["TurnRouter"]


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
        self._telemetry = telemetry or Telemetry.disabled("kvbridge-gateway")
        self._tracer = self._telemetry.tracer
        self._pool = pool
        self._control = control
        self._metrics = metrics
        self._secret = hashchain.check_secret(secret)
        self._chains = ChainCache(self._secret, max_bytes=settings.chain_cache_mb * 1024 * 1024)
        self._threads = RecentThreads(self._chains)
        self.canary = SecretCanary(self._secret, metrics.secret_mismatch)
        self._policy = reuse.Policy(
            threshold_tokens=settings.reuse_threshold_tokens,
            single_use_entries=settings.single_use_entries,
            expiry_margin_s=EXPIRY_MARGIN_S,
        )
        self._policies: dict[int, reuse.Policy] = {}
        self._figures = Figures(
            prefill_s_per_token=settings.placement_prefill_s_per_token,
            pull_bytes_per_s=settings.placement_pull_bytes_per_s,
            kv_bytes_per_token=settings.placement_kv_bytes_per_token,
            attention_s_per_token_pair=settings.placement_attention_s_per_token_pair,
            pull_fixed_s=settings.placement_pull_fixed_s,
            weight=settings.placement_figure_weight,
        )
        self._placer = (
            Placer(
                placement.Costs(
                    kv_bytes_per_token=settings.placement_kv_bytes_per_token,
                    default_bytes_per_s=settings.placement_pull_bytes_per_s,
                    attention_s_per_token_pair=settings.placement_attention_s_per_token_pair,
                    pull_fixed_s=settings.placement_pull_fixed_s,
                    decode_load_weight=settings.placement_decode_load_weight,
                    holder_max_extra_load=settings.placement_holder_max_extra_load,
                    local_prefill=settings.placement_local_prefill,
                ),
                self._figures,
                pool,
                metrics,
                shares_turn=lambda turn, engine: (
                    not self._is_adapter(turn.model, engine) and not self.canary.mismatch(engine.record)
                ),
            )
            if settings.placement
            else None
        )
        self._renewer = ConversationRenewer(control)
        self._post_turn = PostTurnWork()
        calls = EngineCalls(pool, self._tracer)
        access = EngineAccess(settings, pool, http, calls, metrics)
        self._prompt_ids = PromptIds(access, tokenizers)
        self._prefiller = Prefiller(access, self._secret, self._figures)
        self._recent = RecentTurns()
        self._registrar = CompatRegistrar(
            control,
            self._chains,
            metrics,
            hold_s=settings.compat_decoder_kv_blocks_ttl_s,
            entry_lease_ttl_s=settings.entry_lease_ttl_s,
            on_registered=self._recent.finished,
        )
        self._decoder = Decoder(
            access,
            self._secret,
            self._registrar,
            self._post_turn,
            registers=lambda: settings.compat_registration and control.enabled,
            block_size=self._block_size,
        )

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
            plan = TurnPlan()
            prefill = await self._pool.choose_live(turn.model, PREFILL)
            decode = await self._pool.choose_live(turn.model, DECODE)  # the least-loaded D
            turn, plan = await self._plan(turn, prefill, decode, plan)
            if self._placer is not None and plan.placement is None:
                set_placement(plan, self._placer.place(turn, plan, None, prefill, decode))  # nothing to reuse
            if plan.decode_engine is not None:
                decode = plan.decode_engine
            if turn.conversation_key and self._control.enabled:
                # Renewed before P may pull the conversation's blocks (an entry near its deadline must outlive
                # the pull); the renewer writes it once the turn ends, or within 0.5 s of a long turn.
                self._renewer.touch(*turn.conversation)
            if plan.placement is not None and plan.placement.choice is Choice.PREFILL_ON_HOLDER:
                result = await self._in_place(turn, plan, span, prefill, decode)
            else:
                p_params = await self._prefiller.run(turn, plan, prefill)
                if plan.warm_up:  # while D decodes: P's prefill (the turn's TTFT) does not share the CPU with it
                    scope = Scope(turn.tenant, turn.model, turn.cache_salt, plan.block_size)
                    self._post_turn.spawn(self._warm_up(turn, scope), turn.conversation)
                result = await self._decoder.run(
                    turn, plan, decode, p_params, self._verdict(span, plan, prefill, decode)
                )
            result.after.insert(0, lambda: self._after_turn(turn, plan, result.verdict))
            return result

    async def _in_place(
        self, turn: Turn, plan: TurnPlan, span: trace.Span, prefill: EngineState, holder: EngineState
    ) -> TurnResult:
        """The turn as a plain request to the holder D (its prefix cache serves the history). If that fails, the
        turn is served as a recompute through P and another D: a failed local prefill costs time, not the answer."""
        holder.prefilling += 1  # the next turns' cost model sees it queued there
        try:
            result = await self._decoder.run(turn, plan, holder, kvparams.local_prefill_params(), verdict_of(plan))
        except (Unavailable, DeadlineExceeded) as exc:
            log.warning("local prefill on the holder %s failed; recomputing through P: %s", holder.url, exc)
        else:
            self._record_verdict(span, result.verdict, plan, None, holder)
            return result
        finally:
            holder.prefilling -= 1
        plan.observed.local_prefill_failed = True
        try:
            decode = await self._pool.choose_live(turn.model, DECODE, exclude=frozenset({holder.url}))
        except Unavailable:  # the holder is the only decode engine: through P to it, once more
            decode = await self._pool.choose_live(turn.model, DECODE)
        assert self._placer is not None
        fallback, decode = self._placer.place(turn, plan, None, prefill, decode)
        set_placement(plan, (Placement(fallback.chosen, Why.HOLDER_UNAVAILABLE, fallback.options), decode))
        p_params = await self._prefiller.run(turn, plan, prefill)
        return await self._decoder.run(turn, plan, decode, p_params, self._verdict(span, plan, prefill, decode))

    @property
    def figures(self) -> Figures:
        """What the placement measured: each P's prefill line and pull bandwidth."""
        return self._figures

    @property
    def clocks(self) -> ClockOffsets:
        """Each stock D's clock offset (compatibility mode), as learned from its responses."""
        return self._registrar.clocks

    def forget_clock(self, engine_id: str) -> None:
        """A new incarnation of the engine (maybe on another host, with another monotonic clock): learn anew."""
        self._registrar.clocks.forget(engine_id)

    async def settle_conversation(self, tenant: str, model: str, conversation_key: str, *, timeout_s: float) -> None:
        """Waits (bounded) for this conversation's post-turn work, so that closing it right after a turn
        also releases what that turn is still registering."""
        await self._post_turn.settle((tenant, model, conversation_key), timeout_s=timeout_s)

    def _after_turn(self, turn: Turn, plan: TurnPlan, verdict: ReuseVerdict) -> None:
        self._renewer.flush_soon()  # the renewal touched before the prefill goes out now
        if plan.thread is not None and plan.prompt_ids is not None:
            scope = self._scope(turn, plan)
            if plan.thread.continues and plan.thread.base != turn.conversation_key:
                # Another replica's thread taken over after the lookup: the ids were hashed under the key the turn
                # was looked up with; kept under the thread's too (every block reused). A fork was hashed under
                # its own key already.
                self._chains.chain(scope, turn.conversation_key, plan.prompt_ids, base=plan.thread.base)
            self._threads.served(scope, plan.prompt_ids, turn.conversation_key)
        if turn.conversation_key and plan.sent_epoch and plan.features.covered and plan.connector_registers:
            # D's connector registers this turn's state on its own schedule (compatibility mode: the registrar
            # reports its registrations itself).
            self._recent.finished(turn.conversation, plan.sent_epoch)
        log.info(  # the key hashed as in spans (KVBRIDGE_TELEMETRY_HASH_KEY_HEX): conversation keys are credentials
            "turn tenant=%s model=%s key=%s reuse=%s",
            turn.tenant,
            turn.model,
            self._telemetry.hash(turn.conversation_key) if turn.conversation_key else "-",
            verdict.header(),
        )

    async def _warm_up(self, turn: Turn, scope: Scope) -> None:
        """A new conversation's first prompt, encoded (worker thread) and hashed while D decodes it: what its next
        turn resumes. Only with the gateway's own tokenizer (asking P would add a call to every new conversation)."""
        try:
            ids = await self._prompt_ids.local(turn)
            if ids is not None and turn.conversation_key:
                self._chains.chain(scope, turn.conversation_key, ids)
        except Exception as exc:  # noqa: BLE001 - background work: the next turn computes its ids itself
            log.warning("could not encode a new conversation's first prompt for its next turn: %s", exc)

    def _verdict(self, span: trace.Span, plan: TurnPlan, prefill: EngineState, decode: EngineState) -> ReuseVerdict:
        """The turn's verdict once P answered (what the decode carries to the client), recorded."""
        verdict = verdict_of(plan)
        self._record_verdict(span, verdict, plan, prefill, decode)
        return verdict

    def _record_verdict(
        self,
        span: trace.Span,
        v: ReuseVerdict,
        plan: TurnPlan,
        prefill: EngineState | None,
        decode: EngineState,
    ) -> None:
        """The verdict's span attributes and metrics. ``prefill``: None when no P took part (a local prefill on
        the holder)."""
        pulled = v.pulled_tokens
        span.set_attributes(
            {
                tel.ATTR_VERDICT: v.verdict,
                tel.ATTR_REASON: v.span_reason,
                tel.ATTR_VERIFIED_TOKENS: plan.verified_tokens,
                tel.ATTR_PULLED_TOKENS: pulled,
                "kvbridge.prompt_tokens": v.prompt_tokens,
                "kvbridge.prefill.engine_id": engine_key(prefill) if prefill is not None else "",
                "kvbridge.decode.engine_id": engine_key(decode),
            }
        )
        if plan.pull is not None:
            span.set_attribute("kvbridge.source.engine_id", plan.pull.source.engine_id)
        self._metrics.reuse.labels(v.verdict, v.metric_reason).inc()
        self._metrics.verified_tokens.inc(plan.verified_tokens)
        self._metrics.pulled_tokens.inc(pulled)
        self._metrics.prompt_tokens.inc(v.prompt_tokens)
        if plan.placement is not None and self._placer is not None:
            self._placer.record(span, plan.placement, pulled, prefill)

    async def drain(self) -> None:
        """Waits for post-turn work (registrations, renewals); for tests and shutdown."""
        await self._post_turn.drain()
        await self._renewer.flush()

    async def close(self) -> None:
        await self.drain()
        await self._renewer.stop()

    # -- step 1: tokens, hashes, lookup --------------------------------------------------
    def _block_size(self, engine: EngineState) -> int:
        if engine.record is not None and engine.record.block_size:
            return int(engine.record.block_size)
        return self._s.default_block_size

    def _is_adapter(self, model: str, *engines: EngineState) -> bool:
        """Whether ``model`` names a LoRA adapter (or alias) of the engines rather than the model they register
        under: the kvbridge connector registers (and hashes) under the engine's model name, so the chain would
        not tell the adapter's KV from the base model's."""
        for e in engines:
            if model in e.adapters or (e.record is not None and e.record.model and e.record.model != model):
                return True
        return False

    def _policy_for(self, block_size: int) -> reuse.Policy:
        """The reuse policy of a turn: with placement on, the threshold is one block (the cost model, not a fixed
        token count, decides whether a pull is worth it)."""
        if self._placer is None:
            return self._policy
        policy = self._policies.get(block_size)
        if policy is None:
            policy = self._policies[block_size] = dataclasses.replace(self._policy, threshold_tokens=block_size)
        return policy

    async def _plan(
        self, turn: Turn, prefill: EngineState, decode: EngineState, plan: TurnPlan
    ) -> tuple[Turn, TurnPlan]:
        """The turn's plan, and the turn itself: a keyless turn comes back with its thread's key (threads.py)."""
        plan.block_size = self._block_size(prefill)
        policy = self._policy_for(plan.block_size)
        plan.features = reuse.request_features(
            turn.body,
            lora_adapter=self._is_adapter(turn.model, prefill, decode),
            secret_mismatch=self.canary.mismatch(decode.record),
        )
        wants_reuse = bool(
            self._s.reuse_enabled and self._control.enabled and (turn.conversation_key or self._s.content_lookup)
        )
        early = reuse.screen(plan.features, wants_reuse=wants_reuse, prompt_tokens=None, policy=policy)
        if early is not None:
            plan.outcome = early
        if not turn.conversation_key and wants_reuse and plan.features.covered:
            # A keyless turn: its thread (the key it registers and looks up under) is found from its ids.
            if not await self._tokenize(turn, plan, prefill, early):
                return turn, plan
            assert plan.prompt_ids is not None
            plan.thread = self._threads.find(self._scope(turn, plan), plan.prompt_ids)
            turn = dataclasses.replace(turn, conversation_key=plan.thread.key)
            self._metrics.keyless_threads.labels(plan.thread.why.value).inc()
        register = self._s.compat_registration and bool(turn.conversation_key) and plan.features.covered
        if early is not None and not register:
            return turn, plan
        await self._settle_previous_turn(turn)
        if early is None and plan.thread is None and self._new_conversation(turn):
            # Nothing to look up: the turn goes to P at once; its ids are computed once P answered, off its path.
            plan.outcome, plan.warm_up = NoReuse.NOT_FOUND, True
            self._metrics.lookups.labels("mirror").inc()
            trace.get_current_span().set_attribute(tel.ATTR_LOOKUP_SOURCE, "mirror")
            return turn, plan
        if plan.prompt_ids is None and not await self._tokenize(turn, plan, prefill, early):
            return turn, plan
        assert plan.prompt_ids is not None
        if early is not None:
            return turn, plan
        short = reuse.screen(plan.features, wants_reuse=True, prompt_tokens=len(plan.prompt_ids), policy=policy)
        if short is not None:
            plan.outcome = short
            return turn, plan
        await self._lookup(turn, plan, prefill, decode)
        if plan.thread is not None and plan.thread.key != turn.conversation_key:
            turn = dataclasses.replace(turn, conversation_key=plan.thread.key)  # continues another replica's thread
        return turn, plan

    async def _tokenize(self, turn: Turn, plan: TurnPlan, prefill: EngineState, early: NoReuse | None) -> bool:
        """Sets the plan's prompt ids; False when they could not be had (no reuse this turn)."""
        try:
            plan.prompt_ids = await self._prompt_ids.of(turn, prefill)
        except ClientError:
            raise
        except UpstreamError as exc:
            if early is None:
                plan.outcome = NoReuse.TOKENIZE_FAILED
            log.warning("tokenize failed, no reuse this turn: %s", exc)
            return False
        plan.prompt_tokens = len(plan.prompt_ids)
        return True

    @staticmethod
    def _scope(turn: Turn, plan: TurnPlan) -> Scope:
        return Scope(turn.tenant, turn.model, turn.cache_salt, plan.block_size)

    def _new_conversation(self, turn: Turn) -> bool:
        """Whether the turn's conversation has no entry to reuse, known without its ids: this gateway served no
        turn of it lately and the copy of the registry holds no entry under its key (``EntryMirror.absent``).
        A keyed turn's lookup is keyed (content lookups are for keyless threads): the key alone tells."""
        if self._mirror is None or not turn.conversation_key:
            return False
        conversation = turn.conversation
        if self._recent.last(conversation) is not None or self._post_turn.pending(conversation):
            return False
        return self._mirror.absent(conversation)

    async def _settle_previous_turn(self, turn: Turn) -> None:
        """Waits (bounded) for the conversation's post-turn work before its ids are computed: this gateway's own
        compatibility-mode registration, or the previous turn's warm-up (its encoding is what this turn resumes)."""
        if not turn.conversation_key or self._s.registration_wait_s <= 0:
            return
        conversation = turn.conversation
        if self._post_turn.pending(conversation):
            started = time.monotonic()
            await self._post_turn.settle(conversation, timeout_s=self._s.registration_wait_s)
            done = not self._post_turn.pending(conversation)
            self._metrics.registration_waits.labels("yes" if done else "no").observe(time.monotonic() - started)

    async def _await_previous_turn(self, turn: Turn) -> None:
        """Waits (bounded) for the entry of the conversation's previous turn when it ended a moment ago
        (freshness.py) to reach the copy of the registry."""
        if not turn.conversation_key:
            return
        conversation = turn.conversation
        last = self._recent.last(conversation)
        if last is None or self._mirror is None:
            return
        wait = registration_wait_s(
            last,
            registered_epoch=self._mirror.epoch_of(*conversation),
            now=self._recent.now(),
            max_wait_s=self._s.registration_wait_s,
        )
        if wait > 0:
            started = time.monotonic()
            seen = await self._mirror.wait_for_epoch(conversation, last.epoch, wait)
            self._metrics.registration_waits.labels("yes" if seen else "no").observe(time.monotonic() - started)

    async def _lookup(self, turn: Turn, plan: TurnPlan, prefill: EngineState, decode: EngineState) -> None:
        assert plan.prompt_ids is not None
        b, threshold = plan.block_size, self._policy_for(plan.block_size).threshold_tokens
        thread = plan.thread
        hashes = self._chains.chain(
            self._scope(turn, plan), turn.conversation_key, plan.prompt_ids, base=thread.base if thread else ""
        )
        query = KeyedLookup(
            tenant=turn.tenant,
            model=turn.model,
            # A thread this turn does not continue is found by content: the tenant's longest verified prefix.
            conversation_key=turn.conversation_key if thread is None or thread.continues else "",
            block_hashes=hashes,
            block_size=b,
            min_tokens=threshold,
        )
        await self._await_previous_turn(turn)
        if self._mirror is not None:
            asked_at = time.monotonic()
            found = self._mirror.lookup(query, engine_record=self._engine_record)
            if found is not None:
                self._metrics.lookups.labels("mirror").inc()
                await self._apply_lookup(turn, plan, found, asked_at, prefill, decode)
                if plan.outcome is None or plan.outcome is NoReuse.RECOMPUTE_CHEAPER:
                    trace.get_current_span().set_attribute(tel.ATTR_LOOKUP_SOURCE, "mirror")
                    return
                # Declined here (consumed, busy, ...): the registry may hold a newer entry than the copy.
                plan.outcome, plan.reused_tokens, plan.in_place = NoReuse.NOT_REQUESTED, 0, False
                plan.next_epoch, plan.verified_tokens = None, 0
                plan.placement, plan.decode_engine = None, None
        asked_at = time.monotonic()
        try:
            found = await self._control.lookup(query)
        except ControlPlaneError as exc:
            log.warning("registry lookup failed, no reuse this turn: %s", exc)
            plan.outcome = NoReuse.REGISTRY_UNAVAILABLE
            return
        self._metrics.lookups.labels("registry").inc()
        trace.get_current_span().set_attribute(tel.ATTR_LOOKUP_SOURCE, "registry")
        if thread is not None and thread.why is ThreadWhy.NEW:
            continued = threads.continued_by_lookup(found, b)
            if continued is not None:  # another replica's thread (or one this gateway forgot): take it over
                plan.thread = Thread(continued, ThreadWhy.CONTINUES, base=turn.conversation_key)
                plan.next_epoch = int(found.location.epoch) + 1
        await self._apply_lookup(turn, plan, found, asked_at, prefill, decode)

    def _engine_record(self, engine_id: str) -> types_pb2.Engine | None:
        """The registry's record of an engine, as the pool last listed it (the mirror's Location.engine)."""
        state = self._pool.find(engine_id)
        return state.record if state is not None else None

    async def _apply_lookup(
        self,
        turn: Turn,
        plan: TurnPlan,
        found: registry_pb2.LookupEntryResponse,
        asked_at: float,
        prefill: EngineState,
        decode: EngineState,
    ) -> None:
        """Decides on the lookup's answer, then (placement on) where the turn runs; a single-use entry is then
        consumed in the registry before P may pull. ``asked_at``: when the lookup was sent (monotonic). P's READ
        must start within the engine's offer window of the lookup; the answer may have been made at any time after
        the request left, so the window runs from then (a slow answer shortens what P gets, it never stretches D's
        promise). ``prefill``, ``decode``: the pool's P and least-loaded D."""
        assert plan.prompt_ids is not None
        loc = found.location
        if found.HasField("location") and loc.conversation_key == turn.conversation_key:
            plan.next_epoch = int(loc.epoch) + 1
        plan.reused_tokens = plan.verified_tokens = int(found.verified_tokens)
        if found.verdict == registry_pb2.LOOKUP_VERDICT_HIT:
            plan.reused_tokens = kvparams.reusable_tokens(plan.verified_tokens, len(plan.prompt_ids), plan.block_size)
        engine_id = loc.engine.engine_id
        local = self._pool.find(engine_id) if engine_id else None
        source = reuse.SourceState(
            healthy=local.offers_blocks if local is not None else None,
            pulling=(engine_id, loc.engine_request_id) in self._prefiller.pulling,
            clock_offset_s=self._registrar.clocks.get(engine_id),
        )
        decided = reuse.decide(
            plan.features,
            wants_reuse=True,
            prompt_tokens=len(plan.prompt_ids),
            lookup=found,
            block_size=plan.block_size,
            source=source,
            policy=self._policy_for(plan.block_size),
            now_s=time.time(),
            looked_up_at=asked_at,
            now_mono=time.monotonic(),
        )
        if isinstance(decided, NoReuse):
            plan.outcome = decided
            return
        if self._placer is not None:
            placed, target = self._placer.place(turn, plan, decided, prefill, decode)
            set_placement(plan, (placed, target))
            if placed.choice is Choice.PREFILL_ON_HOLDER:
                # No pull: the holder's own prefix cache serves the verified history (nothing to consume).
                plan.reused_tokens, plan.outcome, plan.in_place = decided.tokens, None, True
                return
            if placed.choice is Choice.RECOMPUTE:
                plan.reused_tokens, plan.outcome = decided.tokens, NoReuse.RECOMPUTE_CHEAPER
                return
        if decided.consume:
            try:
                took = await self._control.consume_entry(
                    tenant=turn.tenant, model=turn.model, conversation_key=decided.conversation_key, epoch=decided.epoch
                )
            except ControlPlaneError as exc:
                log.warning("could not consume a single-use entry, no reuse this turn: %s", exc)
                plan.outcome = NoReuse.REGISTRY_UNAVAILABLE
                recompute_instead(plan)
                return
            if not took:
                plan.outcome = NoReuse.CONSUMED
                recompute_instead(plan)
                return
        plan.pull = decided
        plan.reused_tokens = decided.tokens
        plan.outcome = None
