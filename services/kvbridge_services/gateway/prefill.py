"""Step 2 of a turn: the prefill on P, with D's params cut to the verified prefix (a hit) or plain.

Any failure on the reuse path retries once without D's params (slower, never wrong); a single-use entry
is already consumed, so nobody tries it again. A plain prefill that timed out gets one try on another P.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from kvbridge import telemetry as tel
from kvbridge.errors import Unavailable

from . import kvparams
from .enginecalls import (
    EngineAccess,
    EngineStep,
    call_timeout_s,
    client_cut_short,
    completion_path,
    upstream_failure,
)
from .engines import PREFILL, EngineState
from .figures import Figures
from .turn import Turn
from .turnstate import PullOutcome, TurnPlan
from .upstream import ClientError, UpstreamError

log = logging.getLogger(__name__)

# Fields of the client's body that P must not see: P generates one token and answers at once.
_NOT_FOR_PREFILL = ("stream_options", "max_completion_tokens", "min_tokens", "session_id")


def prefill_body(turn: Turn, params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as P gets it: one token, not streamed, with ``params`` as its kv_transfer_params."""
    body = {k: v for k, v in turn.body.items() if k not in _NOT_FOR_PREFILL}
    body.update(max_tokens=1, stream=False, kv_transfer_params=params)
    return body


class Prefiller(EngineStep):
    def __init__(self, access: EngineAccess, secret: bytes, figures: Figures | None = None) -> None:
        """``figures``: where each prefill's timing goes (the placement's measured prefill speed and bandwidth)."""
        super().__init__(access)
        self._figures = figures
        self._secret = secret
        # (engine id, request id) of D's blocks some P is pulling now: the reuse decision declines a second
        # pull of the same blocks while one runs.
        self.pulling: set[tuple[str, str]] = set()

    async def run(self, turn: Turn, plan: TurnPlan, engine: EngineState) -> dict[str, Any]:
        """P's returned kv_transfer_params (what D pulls from P)."""
        if plan.pull is not None:
            pull = plan.pull
            params = kvparams.reuse_prefill_params(
                pull.source, pull.tokens, plan.block_size, prompt_ids=plan.prompt_ids or (), secret=self._secret
            )
            self.pulling.add(pull.key)
            try:
                returned = await self._once(turn, plan, engine, params)
                cached = returned.get("remote_prefill_cached_tokens")
                if isinstance(cached, int) and cached == 0:
                    plan.observed.pull = PullOutcome.RECOMPUTED  # P chose (or had) to recompute
                return returned
            except (UpstreamError, ClientError) as exc:
                log.warning("prefill with D params failed; retrying without them: %s", exc)
                self._metrics.reuse_retries.inc()
                timed_out = isinstance(exc, UpstreamError) and exc.timed_out
                plan.observed.pull = PullOutcome.TIMED_OUT if timed_out else PullOutcome.FAILED
            finally:
                self.pulling.discard(pull.key)
            with contextlib.suppress(Unavailable):  # the retry may go to another P if this one looks broken
                engine = await self._pool.choose_live(turn.model, PREFILL)
        try:
            return await self._once(turn, plan, engine, kvparams.plain_prefill_params())
        except UpstreamError as exc:
            other = (
                self._pool.choose(turn.model, PREFILL, exclude=frozenset({engine.url}))
                if exc.timed_out
                and not client_cut_short(turn, self._s.prefill_timeout_s)  # another P would get the same deadline
                and self._pool.count(turn.model, PREFILL) > 1
                else None
            )
            if other is None:
                raise upstream_failure("prefill", exc) from exc
            log.warning("prefill on %s timed out; trying %s", engine.url, other.url)
        try:
            return await self._once(turn, plan, other, kvparams.plain_prefill_params())
        except UpstreamError as exc:
            raise upstream_failure("prefill", exc) from exc

    async def _once(self, turn: Turn, plan: TurnPlan, engine: EngineState, params: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        others = engine.outstanding  # this gateway's other requests in flight on P (the queue the call waits in)
        with self._calls.span("kvbridge.gateway.prefill", engine) as span:
            span.set_attribute(tel.ATTR_PULLED_TOKENS, int(params.get("remote_num_tokens") or 0))
            async with self._pool.using(engine):
                try:
                    data = await self._http.post_json(
                        engine.url + completion_path(turn),
                        prefill_body(turn, params),
                        timeout_s=call_timeout_s(turn, self._s.prefill_timeout_s),
                        headers=tel.trace_headers(),
                    )
                except UpstreamError as exc:
                    self._calls.failed(engine, exc, client_deadline=client_cut_short(turn, self._s.prefill_timeout_s))
                    raise
                finally:
                    plan.engine_seconds += time.perf_counter() - started
                self._pool.answered(engine)
        try:
            returned = kvparams.check_prefill_returned(data.get("kv_transfer_params"))
        except ValueError as exc:
            log.warning("prefill on %s answered unusable kv_transfer_params: %s", engine.url, exc)
            raise UpstreamError(f"the engine answered unusable kv_transfer_params: {exc}") from exc
        usage = data.get("usage")
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        prompt = prompt if isinstance(prompt, int) and prompt > 0 else None
        if prompt is not None and not plan.observed.engine_prompt_tokens:
            plan.observed.engine_prompt_tokens = prompt  # a turn planned without its ids: P's count
        if self._figures is not None and prompt is not None:
            self._observe(engine, params, returned, prompt, time.perf_counter() - started, others)
        return returned

    def _observe(
        self,
        engine: EngineState,
        params: dict[str, Any],
        returned: dict[str, Any],
        prompt: int,
        seconds: float,
        others: int,
    ) -> None:
        """One prefill's timing for the placement's figures: P's speed (plain prefill) or the pull's bandwidth.
        ``prompt``: P's usage.prompt_tokens; cached ones from ``remote_prefill_cached_tokens`` (vLLM 0.32: P's
        cache hits, local and pulled)."""
        assert self._figures is not None
        cached = returned.get("remote_prefill_cached_tokens")
        cached = cached if isinstance(cached, int) and 0 <= cached <= prompt else 0
        reader = engine.engine_id or engine.url
        offered = params.get("remote_num_tokens")
        source = params.get("remote_engine_id")
        if isinstance(offered, int) and offered > 0 and isinstance(source, str) and cached:
            self._figures.observe_pull(
                reader,
                source,
                pulled=min(cached, offered),
                computed=prompt - cached,
                context=cached,
                seconds=seconds,
                others=others,
            )
        elif not offered:
            self._figures.observe_prefill(
                reader, computed=prompt - cached, context=cached, seconds=seconds, others=others
            )
