"""The HTTP front doors' APIs: OpenAI chat and completions as they are, the Responses API and the Anthropic
Messages API translated to a chat turn and back. Each door says how a request is authenticated, how its body
becomes the turn's body (an :class:`Exchange`), and how its answers and errors look; ``http_api.serve_turn`` runs
every door's turn the same way (authorization row, limits, the router, the verdict header, metrics)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvbridge.errors import KvbridgeError, NotFound, Reason

from . import messages_api, responses_api
from .answers import openai_code, openai_type
from .chatstream import ChatAnswer, answer_of, chat_chunks, delta_of
from .responses_store import ResponseStore, StoredResponse
from .turn import TurnKind

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
CHAT_ROW = "kvbridge.gateway.v1.GatewayService/CreateChatCompletion"
COMPLETION_ROW = "kvbridge.gateway.v1.GatewayService/CreateCompletion"
PREVIOUS_NOT_FOUND = "previous_response_not_found"


@dataclass(frozen=True, slots=True)
class Failure:
    """An error as the HTTP door answers it, before a door gives it its API's shape."""

    status: int
    message: str
    code: str | None = None  # the machine reason, in lower case (OpenAI's ``code``)
    param: str | None = None
    close: bool = False  # the connection is closed after the answer (a body that never came)

    @classmethod
    def of(cls, err: KvbridgeError) -> Failure:
        status = _HTTP_STATUS.get(err.code, 500)
        if err.reason == Reason.TOO_LARGE.value:
            status = 413
        elif err.reason == Reason.UPSTREAM_FAILED.value and err.code is not grpc.StatusCode.DEADLINE_EXCEEDED:
            status = 502  # an engine failed; one that timed out keeps 504
        return cls(status, err.message, openai_code(err.reason), err.metadata.get("field"))

    @classmethod
    def engine(cls, status: int, body: Any) -> Failure:
        """An engine's own 4xx answer (vLLM's ``{"error": {"message", "type": "BadRequestError", "param", "code":
        400}}``, or its older flat form), translated: its message and ``param`` are kept, its ``type`` and numeric
        ``code`` (vLLM's exception class and the status) are replaced by OpenAI's type for the status."""
        err = body.get("error") if isinstance(body, dict) else None
        fields = err if isinstance(err, dict) else body if isinstance(body, dict) else {}
        message = fields.get("message")
        param = fields.get("param")
        code = fields.get("code")
        return cls(
            status,
            str(message or f"the engine answered {status}"),
            code if isinstance(code, str) and code else None,
            param if isinstance(param, str) and param else None,
        )


def _headers(failure: Failure) -> dict[str, str] | None:
    return {"connection": "close"} if failure.close else None


def openai_error_body(failure: Failure) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": failure.message,
            "type": openai_type(failure.status),
            "param": failure.param,
            "code": failure.code,
        }
    }


def openai_error(failure: Failure) -> JSONResponse:
    """The error answer of every OpenAI-compatible route (chat, completions, the Responses API, models): OpenAI's
    shape, engines' errors translated into it."""
    return JSONResponse(openai_error_body(failure), status_code=failure.status, headers=_headers(failure))


# The Responses API answers errors in OpenAI's shape too.
responses_error = openai_error


def messages_error(failure: Failure) -> JSONResponse:
    """The Anthropic Messages API's error answer: ``{"type": "error", "error": {"type", "message"}}``."""
    body = messages_api.error_body(messages_api.error_type(failure.status), failure.message)
    return JSONResponse(body, status_code=failure.status, headers=_headers(failure))


class Exchange(Protocol):
    """One request of a front door, translated: the chat (or completion) body its turn runs with, and how the
    turn's answer is given back in the door's API."""

    @property
    def turn_body(self) -> dict[str, Any]: ...

    def answer(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, chat_sse: AsyncIterator[bytes]) -> AsyncIterator[bytes]: ...


@dataclass(frozen=True, slots=True)
class FrontDoor:
    route: str  # the metrics' route label
    kind: TurnKind
    row: str  # the authorization row (the gRPC twin's method)
    credentials: Callable[[Request], str | None]
    prepare: Callable[[dict[str, Any], Request, str], Exchange]  # body, request, tenant
    error: Callable[[Failure], JSONResponse]


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if value is None:
        return None
    if not value.lower().startswith("bearer "):
        return ""
    return value[7:].strip()


def api_key_or_bearer(request: Request) -> str | None:
    """Anthropic's ``x-api-key``, else ``Authorization: Bearer`` (the same keys)."""
    key = request.headers.get("x-api-key")
    return key.strip() if key is not None else bearer(request)


# -- chat and completions: the body as it is ---------------------------------------------------------------
@dataclass(slots=True)
class Passthrough:
    turn_body: dict[str, Any]

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def stream(self, chat_sse: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return chat_sse


def passthrough(body: dict[str, Any], _request: Request, _tenant: str) -> Exchange:
    return Passthrough(body)


# -- the Responses API ---------------------------------------------------------------------------------------
class ResponsesExchange:
    def __init__(self, store: ResponseStore, tenant: str, body: dict[str, Any], session_header: str | None) -> None:
        previous = body.get("previous_response_id")
        self._parent: StoredResponse | None = None
        if isinstance(previous, str) and previous:
            self._parent = store.get(tenant, previous)
            if self._parent is None:
                raise NotFound(
                    PREVIOUS_NOT_FOUND,
                    f"Previous response with id '{previous}' not found.",
                    metadata={"field": "previous_response_id"},
                )
        self.request = responses_api.to_chat(body, self._parent.messages if self._parent is not None else ())
        self.builder = responses_api.ResponseBuilder(self.request)
        self._store = store
        self._tenant = tenant
        # The conversation key: the chain's (previous_response_id), or the client's own. Without one the chain is
        # a keyless thread (ADR 0022): a stateless client resending the history and a stateful one chaining
        # previous_response_id render the same prompts, so both find the same thread by content.
        key = self._parent.thread_key if self._parent is not None else responses_api.conversation_key(body)
        self.thread_key = key or session_header or ""
        self.turn_body = dict(self.request.chat_body)
        if key:
            self.turn_body["conversation_id"] = key

    def _stored(self, response: dict[str, Any], answer: ChatAnswer) -> None:
        if self.request.store and response["status"] in ("completed", "incomplete"):
            self._store.put(
                self._tenant,
                response,
                thread_key=self.thread_key,
                parent=self._parent,
                new_messages=self.builder.thread_messages(answer),
            )

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = answer_of(body)
        response = self.builder.response(answer)
        self._stored(response, answer)
        return response

    async def stream(self, chat_sse: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        out = responses_api.ResponsesStream(self.builder, self._stored)
        yield out.start()
        try:
            async for chunk in chat_chunks(chat_sse):
                events = out.feed(delta_of(chunk))
                if events:
                    yield events
                if out.failed:
                    return
        except ValueError as exc:  # D's stream was not SSE
            yield out.fail(f"unreadable engine stream: {exc}")
            return
        yield out.finish()


def responses_door(store: ResponseStore) -> Callable[[dict[str, Any], Request, str], Exchange]:
    def prepare(body: dict[str, Any], request: Request, tenant: str) -> Exchange:
        return ResponsesExchange(store, tenant, body, request.headers.get("x-session-id"))

    return prepare


# -- the Anthropic Messages API --------------------------------------------------------------------------------
class MessagesExchange:
    def __init__(self, body: dict[str, Any]) -> None:
        self.turn_body = messages_api.to_chat(body)
        self.model = str(body.get("model") or "")
        self.stop_sequences = messages_api.stop_sequences_of(body)
        self.message_id = responses_api.new_id("msg")

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        return messages_api.message_of(
            answer_of(body), message_id=self.message_id, model=self.model, stop_sequences=self.stop_sequences
        )

    async def stream(self, chat_sse: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        out = messages_api.MessagesStream(
            message_id=self.message_id, model=self.model, stop_sequences=self.stop_sequences
        )
        yield out.start()
        try:
            async for chunk in chat_chunks(chat_sse):
                events = out.feed(delta_of(chunk))
                if events:
                    yield events
                if out.failed:
                    return
        except ValueError as exc:
            yield out.fail(f"unreadable engine stream: {exc}")
            return
        yield out.finish()


def messages_door(body: dict[str, Any], _request: Request, _tenant: str) -> Exchange:
    return MessagesExchange(body)


__all__ = [
    "CHAT_ROW",
    "COMPLETION_ROW",
    "Exchange",
    "Failure",
    "FrontDoor",
    "MessagesExchange",
    "ResponsesExchange",
    "api_key_or_bearer",
    "bearer",
    "messages_door",
    "messages_error",
    "openai_error",
    "openai_error_body",
    "passthrough",
    "responses_door",
    "responses_error",
]
