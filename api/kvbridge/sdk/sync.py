"""Blocking versions of the SDK clients, for code without an event loop.

Each sync client runs its async twin on a private event loop in a background thread (one per
client) and blocks on the result, so retries, deadlines and typed errors have one implementation.
Streams come back as ordinary iterators; breaking out of one cancels the call. Use ``with`` (or
``close()``): it closes the channel and ends the thread.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar

from . import conversation as aio_conversation
from . import gateway as aio_gateway
from . import lease as aio_lease
from . import registry as aio_registry
from .channel import BaseClient

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
A = TypeVar("A")
C = TypeVar("C", bound=BaseClient)


class LoopThread:
    """An event loop running in a daemon thread; ``run`` blocks the caller until a coroutine finishes."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, awaitable: Awaitable[T]) -> T:
        if threading.current_thread() is self._thread:
            if isinstance(awaitable, Coroutine):
                awaitable.close()  # never awaited: close it quietly
            raise RuntimeError("a sync kvbridge client was called from its own event loop thread")

        async def wrapper() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result()

    def iterate(self, stream: AsyncIterator[T]) -> Generator[T, None, None]:
        """``stream`` as a blocking iterator; closing it early (break, garbage collection) closes the stream."""
        try:
            while True:
                try:
                    item = self.run(anext(stream))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None and self.alive:
                self.run(close())

    def stop(self) -> None:
        if self.alive:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


class _Facade(Generic[A]):
    """A blocking facade over the async object ``A`` that lives on the loop thread ``_runner``."""

    _runner: LoopThread
    _aio: A

    @property
    def aio(self) -> A:
        """The async object underneath (call it only through this facade's loop)."""
        return self._aio


class SyncClient(_Facade[C]):
    """A blocking facade over the async client ``C``, which lives on this facade's own loop thread."""

    def __init__(self, factory: Callable[[], C]) -> None:
        self._runner = LoopThread(f"kvbridge-{type(self).__name__}")

        async def make() -> C:  # inside the loop, so the channel binds to it
            return factory()

        try:
            self._aio = self._runner.run(make())
        except BaseException:
            self._runner.stop()
            raise

    @property
    def target(self) -> str:
        return self._aio.target

    def close(self) -> None:
        if self._runner.alive:
            try:
                self._runner.run(self._aio.close())
            finally:
                self._runner.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _blocking(
    method: Callable[Concatenate[A, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[_Facade[A], P], R]:
    """The blocking version of an async method (same signature and docstring)."""

    @functools.wraps(method)
    def call(self: _Facade[A], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._runner.run(method(self._aio, *args, **kwargs))

    return call


def _iterating(
    method: Callable[Concatenate[A, P], AsyncIterator[R]],
) -> Callable[Concatenate[_Facade[A], P], Generator[R, None, None]]:
    """The blocking-iterator version of an async method returning a stream."""

    @functools.wraps(method)
    def call(self: _Facade[A], /, *args: P.args, **kwargs: P.kwargs) -> Generator[R, None, None]:
        async def start() -> AsyncIterator[R]:  # built on the loop: the call binds to it
            return method(self._aio, *args, **kwargs)

        return self._runner.iterate(self._runner.run(start()))

    return call


def _constructor(
    aio_class: Callable[P, C],
) -> Callable[[Callable[..., None]], Callable[Concatenate[SyncClient[C], P], None]]:
    """Turns the decorated empty ``__init__`` into one that takes ``aio_class``'s arguments (same signature,
    as mypy and ``help`` see it) and builds that client on the facade's loop thread. A decorated def rather
    than ``__init__ = ...``: mypy takes a class's constructor signature only from a def."""

    def decorate(_: Callable[..., None]) -> Callable[Concatenate[SyncClient[C], P], None]:
        @functools.wraps(aio_class.__init__)
        def __init__(self: SyncClient[C], /, *args: P.args, **kwargs: P.kwargs) -> None:
            SyncClient.__init__(self, lambda: aio_class(*args, **kwargs))

        return __init__

    return decorate


class RegistryClient(SyncClient[aio_registry.RegistryClient]):
    @_constructor(aio_registry.RegistryClient)
    def __init__(self) -> None: ...

    register_engine = _blocking(aio_registry.RegistryClient.register_engine)
    deregister_engine = _blocking(aio_registry.RegistryClient.deregister_engine)
    list_engines = _blocking(aio_registry.RegistryClient.list_engines)
    register_entry = _blocking(aio_registry.RegistryClient.register_entry)
    lookup = _blocking(aio_registry.RegistryClient.lookup)
    get_entry = _blocking(aio_registry.RegistryClient.get_entry)
    list_entries = _blocking(aio_registry.RegistryClient.list_entries)
    delete_entry = _blocking(aio_registry.RegistryClient.delete_entry)


class LeaseClient(SyncClient[aio_lease.LeaseClient]):
    @_constructor(aio_lease.LeaseClient)
    def __init__(self) -> None: ...

    grant = _blocking(aio_lease.LeaseClient.grant)
    revoke = _blocking(aio_lease.LeaseClient.revoke)
    get = _blocking(aio_lease.LeaseClient.get)
    list_leases = _blocking(aio_lease.LeaseClient.list_leases)
    renew_once = _blocking(aio_lease.LeaseClient.renew_once)
    watch = _iterating(aio_lease.LeaseClient.watch)


def _conversation(
    method: Callable[Concatenate[aio_gateway.GatewayClient, P], aio_conversation.Conversation],
) -> Callable[Concatenate[GatewayClient, P], Conversation]:
    """The sync client's version of ``GatewayClient.conversation``: the same arguments, a blocking Conversation."""

    @functools.wraps(method)
    def call(self: GatewayClient, /, *args: P.args, **kwargs: P.kwargs) -> Conversation:
        return Conversation(self._runner, method(self._aio, *args, **kwargs))

    call.__doc__ = "A blocking :class:`Conversation` (see :meth:`kvbridge.sdk.GatewayClient.conversation`)."
    return call


class GatewayClient(SyncClient[aio_gateway.GatewayClient]):
    __doc__ = aio_gateway.GatewayClient.__doc__

    @_constructor(aio_gateway.GatewayClient)
    def __init__(self) -> None: ...

    chat = _blocking(aio_gateway.GatewayClient.chat)
    stream_chat = _iterating(aio_gateway.GatewayClient.stream_chat)
    complete = _blocking(aio_gateway.GatewayClient.complete)
    stream_complete = _iterating(aio_gateway.GatewayClient.stream_complete)
    list_models = _blocking(aio_gateway.GatewayClient.list_models)
    close_conversation = _blocking(aio_gateway.GatewayClient.close_conversation)

    conversation = _conversation(aio_gateway.GatewayClient.conversation)


class Conversation(_Facade[aio_conversation.Conversation]):
    """The blocking twin of :class:`kvbridge.sdk.Conversation`; its heartbeats run on the client's loop thread."""

    def __init__(self, runner: LoopThread, conversation: aio_conversation.Conversation) -> None:
        self._runner = runner
        self._aio = conversation

    @property
    def key(self) -> str:
        return self.aio.key

    @property
    def model(self) -> str:
        return self.aio.model

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.aio.messages

    send = _blocking(aio_conversation.Conversation.send)
    stream = _iterating(aio_conversation.Conversation.stream)
    close = _blocking(aio_conversation.Conversation.close)

    def open(self) -> None:
        """Starts keeping the conversation's lease alive (done by ``with`` and the first turn)."""

        async def on_loop() -> None:  # starts the heartbeater task: must run on the client's loop
            self.aio.open()

        self._runner.run(on_loop())

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Conversation", "GatewayClient", "LeaseClient", "LoopThread", "RegistryClient", "SyncClient"]
