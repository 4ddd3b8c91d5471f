"""Channels and the retrying unary call every SDK client uses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import grpc

from kvbridge.backoff import Backoff
from kvbridge.errors import KvbridgeError, Reason, from_rpc_error

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Metadata key naming the tenant a service principal acts for (read by the gateway).
TENANT_METADATA_KEY = "x-kvbridge-tenant"


@dataclass(frozen=True, slots=True)
class ClientOptions:
    api_key: str | None = None
    # Service principals only: the tenant to act for. A tenant API key implies its tenant; leave None.
    tenant: str | None = None
    # Per-attempt deadline of a unary call, seconds.
    timeout_s: float = 5.0
    # Per-attempt deadline of a whole server-streaming call (one generation), seconds.
    stream_timeout_s: float = 600.0
    # Attempts for UNAVAILABLE (including the first).
    max_attempts: int = 4
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    # PEM root certificates; None = plaintext (loopback / inside a mesh).
    root_certificates: bytes | None = None
    # PEM client certificate chain + private key, for servers that require mutual TLS (needs root_certificates).
    client_certificate_chain: bytes | None = None
    client_private_key: bytes | None = None
    # Name the server certificate must carry when it differs from the target's host (tests, IP targets).
    tls_server_name: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def metadata(self) -> tuple[tuple[str, str], ...]:
        md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        if self.tenant:
            md += ((TENANT_METADATA_KEY, self.tenant),)
        return md


def backoff_delays(options: ClientOptions) -> Iterator[float]:
    """Sleeps between the attempts of one call: jittered (x0.5..1.5) exponential, capped at backoff_max_s.

    Yields ``max_attempts - 1`` delays; exhausting it means no attempt is left.
    """
    backoff = Backoff(options.backoff_initial_s, options.backoff_max_s, jitter=0.5)
    for _ in range(options.max_attempts - 1):
        yield backoff.next_delay()


def tls_channel(
    target: str,
    *,
    root_certificates: bytes | None,
    private_key: bytes | None = None,
    certificate_chain: bytes | None = None,
    server_name: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """Plaintext without root certificates; TLS with them; mutual TLS with a client certificate and key too.

    One place for every kvbridge gRPC client: the SDK, the services' calls to each other, the connector.
    """
    opts = list(options)
    if root_certificates is None:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(
        root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
    )
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors)


def open_channel(target: str, options: ClientOptions) -> grpc.aio.Channel:
    if (options.client_certificate_chain is None) != (options.client_private_key is None):
        raise ValueError("client_certificate_chain and client_private_key must be given together")
    if options.root_certificates is None and options.client_certificate_chain is not None:
        raise ValueError("a client certificate needs root_certificates (TLS)")
    return tls_channel(
        target,
        root_certificates=options.root_certificates,
        private_key=options.client_private_key,
        certificate_chain=options.client_certificate_chain,
        server_name=options.tls_server_name,
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
        ],
    )


# Codes of an attempt that got no answer from the server (with no ErrorInfo: the transport failed).
_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class BaseClient:
    """Owns a channel (or borrows one) and runs unary calls with retries.

    A NOT_LEADER error naming the leader moves the client to that address. When a redirected address stops
    answering (the old leader died), the client returns to the configured target (a Service reaching any
    replica, or a list of them) and follows the next NOT_LEADER from there.
    """

    def __init__(
        self,
        target: str,
        options: ClientOptions | None = None,
        *,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
    ) -> None:
        """``channel_factory``: opens the channel to a target (the configured one, then each redirect's), for
        callers that build their own (kvbridge services: peer TLS settings, tracing interceptors); default
        ``open_channel`` with ``options``."""
        self.options = options or ClientOptions()
        self.configured_target = target
        self.target = target
        self._open: Callable[[str], grpc.aio.Channel] = channel_factory or (lambda t: open_channel(t, self.options))
        self._channel = self._open(target)
        # Channels left by a redirect, closing while their calls finish (cut short by close()).
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._bind(self._channel)

    def _bind(self, channel: grpc.aio.Channel) -> None:
        raise NotImplementedError

    def _switch(self, target: str) -> None:
        old = self._channel
        self.target = target
        self._channel = self._open(target)
        self._bind(self._channel)
        # Calls already running on the old channel (another task's, a stream) get one attempt's deadline.
        task = asyncio.get_running_loop().create_task(old.close(grace=self.options.timeout_s))
        self._retiring[task] = old
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    def _redirect(self, leader: str) -> None:
        if leader and leader != self.target:
            self._switch(leader)

    def _fall_back(self) -> None:
        """Back to the configured target, which reaches whichever replica leads now."""
        if self.target != self.configured_target:
            self._switch(self.configured_target)

    def _follow(self, err: KvbridgeError, tried: str, unreachable: set[str]) -> None:
        """Moves the client after an attempt on ``tried`` failed with ``err``: to the leader a NOT_LEADER
        names, or back to the configured target when the redirected address gave no answer or does not
        know the leader. ``unreachable`` (one per call or reconnect sequence) collects the redirected
        addresses that gave no answer, so a stale NOT_LEADER still naming a dead leader is not followed."""
        if err.reason == Reason.NOT_LEADER.value:
            leader = err.metadata.get("leader", "")
            if leader and leader not in unreachable:
                self._redirect(leader)
                return
        elif err.reason or err.code not in _NO_ANSWER:
            return  # the server answered: it is reachable, the error is the caller's to handle
        elif tried != self.configured_target:
            unreachable.add(tried)
        if tried == self.target:  # not already moved by a concurrent call
            self._fall_back()

    def _stub(self) -> Any:
        raise NotImplementedError

    async def _unary(self, method: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """Calls ``method`` of the bound stub; retries UNAVAILABLE with jittered
        exponential backoff, following NOT_LEADER redirects."""
        opts = self.options
        delays = backoff_delays(opts)
        unreachable: set[str] = set()
        while True:
            # Looked up per attempt: a redirect rebinds the stub.
            fn = getattr(self._stub(), method)
            tried = self.target
            try:
                return await fn(request, timeout=timeout_s or opts.timeout_s, metadata=opts.metadata())
            except grpc.RpcError as exc:
                await self._before_retry(from_rpc_error(exc), delays, tried, unreachable)

    async def _server_stream(
        self, method: str, request: Any, *, timeout_s: float | None = None
    ) -> AsyncGenerator[Any, None]:
        """Yields the messages of a server-streaming ``method``. UNAVAILABLE is retried like a unary call,
        but only until the first message arrived: after that a retry could repeat side effects (a second
        generation), so the typed error is raised instead. Closing the iterator cancels the call."""
        opts = self.options
        delays = backoff_delays(opts)
        unreachable: set[str] = set()
        while True:
            tried = self.target
            call = getattr(self._stub(), method)(
                request, timeout=timeout_s or opts.stream_timeout_s, metadata=opts.metadata()
            )
            received = False
            try:
                async for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if received:
                    self._follow(err, tried, unreachable)
                    raise err from None
                await self._before_retry(err, delays, tried, unreachable)
            finally:
                call.cancel()

    async def _before_retry(
        self, err: KvbridgeError, delays: Iterator[float], tried: str, unreachable: set[str]
    ) -> None:
        """Follows a NOT_LEADER redirect or falls back from a dead redirected address (also when ``err`` is
        raised: the next call starts from there); then raises ``err`` unless it is UNAVAILABLE with
        attempts left, else sleeps the backoff delay."""
        self._follow(err, tried, unreachable)
        delay = next(delays, None) if err.code is grpc.StatusCode.UNAVAILABLE else None
        if delay is None:
            raise err from None
        await asyncio.sleep(delay)

    async def close(self) -> None:
        for task, channel in list(self._retiring.items()):
            task.cancel()
            await channel.close()
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["BaseClient", "ClientOptions", "KvbridgeError", "TENANT_METADATA_KEY", "backoff_delays", "open_channel"]
