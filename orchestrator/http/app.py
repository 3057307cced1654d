"""The OpenAI-compatible HTTP API in front of one orchestrator: the ASGI app and its routes.

Every output of a generation request becomes exactly one gRPC ``Generate`` (streamed) or
``GenerateUnary`` call through :class:`~orchestrator.client.AsyncDiscoClient` (several
outputs, ``n``/``best_of``/a list of prompts: :mod:`orchestrator.http.choices`); this layer
holds no model and no speculation logic, only the mapping of fields
(:mod:`orchestrator.http.schemas`, :mod:`orchestrator.http.responses`) and of errors
(:mod:`orchestrator.http.errors`). Routes: ``POST /v1/completions``, ``POST
/v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``; any other
URL or method is a 404 or 405 in the OpenAI error shape.

Generation requests pass :class:`~orchestrator.http.middleware.Admission` first (at most
``max_concurrent`` generations at once, a request taking one place per output; a bounded
queue behind, 429 beyond) and each has a deadline
from its arrival (``HttpConfig.timeout_s``; 504 past it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

import disco
from disco.config import SpeculationConfig
from orchestrator.client import AsyncDiscoClient, Chunk, Completion
from orchestrator.http import choices
from orchestrator.http.config import HttpConfig
from orchestrator.http.errors import ApiError, deadline_exceeded, from_rpc_error, invalid, route_error
from orchestrator.http.middleware import (
    Admission,
    BearerTokenMiddleware,
    BodyLimitMiddleware,
    HttpMetrics,
    MetricsMiddleware,
    Slot,
)
from orchestrator.http.responses import Shaper
from orchestrator.http.structured import parses_tool_calls
from orchestrator.tools import ToolCallStream
from orchestrator.http.schemas import (
    UNRECOGNIZED,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    validation_param,
)

HEALTH_TIMEOUT_S = 5.0
DISCONNECT_POLL_S = 0.5  # how often a waiting or non-streamed request checks whether its client went away
FALLBACK_MODEL_NAME = "disco"
T = TypeVar("T")

logger = logging.getLogger(__name__)


class Gateway:
    """What the routes of one app share: its settings, the gRPC client (created in the
    app's event loop) and the served model's name (asked once)."""

    def __init__(self, config: HttpConfig, client: AsyncDiscoClient, admission: Admission) -> None:
        self.config = config
        self.client = client
        self.admission = admission
        self.started = int(time.time())
        self._model_name = config.model_name
        self._max_model_len: int | None = None

    async def model_name(self) -> str:
        """The served model: ``config.model_name``, else the target's name from ``Info``."""
        if self._model_name is None:
            await self._describe()
        return self._model_name or FALLBACK_MODEL_NAME

    async def max_model_len(self) -> int | None:
        """The target's context in tokens (``Info``'s ``limits.max_context``; ``None``: unknown)."""
        if self._max_model_len is None:
            await self._describe()
        return self._max_model_len

    async def _describe(self) -> None:
        """Remember the target's name and context from ``Info`` (nothing while the target is
        unreachable: no stand-in is remembered)."""
        info = await self.client.info()
        target = info["models"]["target"]
        if target is None:
            return
        if self._model_name is None:
            self._model_name = target["model_name"] or FALLBACK_MODEL_NAME
        self._max_model_len = info["limits"]["max_context"] or None


def create_app(config: HttpConfig) -> FastAPI:
    """The ASGI app of one gateway (run it with uvicorn, see :mod:`orchestrator.http.server`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncDiscoClient(config.server, timeout=config.timeout_s, tls_ca=config.tls_ca,
                                  tls_cert=config.tls_cert, tls_key=config.tls_key,
                                  tls_server_name=config.tls_server_name, auth_token=config.upstream_token or "")
        app.state.gateway = Gateway(config, client, admission)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="disco-serve OpenAI-compatible API", version=disco.__version__, lifespan=lifespan,
                  description="Speculative decoding (DISCO) behind the OpenAI API; see docs/http.md.")
    metrics = HttpMetrics()
    app.state.metrics = metrics
    admission = Admission(config.max_concurrent, config.queue_limit)
    metrics.track_admission(admission)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics_text, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # unknown URL (404), wrong method (405)
    app.add_exception_handler(grpc.RpcError, _rpc_error)
    # The last added runs first: metrics (counts every refusal), the token (401 before any
    # of the body is read), the body limit (413 before the body is parsed), then the routes.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    if config.auth_tokens:
        app.add_middleware(BearerTokenMiddleware, tokens=config.auth_tokens)
    routes = frozenset(route.path for route in app.routes if hasattr(route, "path"))
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    return app


# --- routes -------------------------------------------------------------------------


async def completions(request: Request, body: CompletionRequest) -> Any:
    """``POST /v1/completions``."""
    return await _generate(request, body, chat=False)


async def chat_completions(request: Request, body: ChatCompletionRequest) -> Any:
    """``POST /v1/chat/completions`` (a conversation; see :class:`ChatCompletionRequest`)."""
    return await _generate(request, body, chat=True)


async def models(request: Request) -> dict[str, Any]:
    """``GET /v1/models``: the one served model, with its context (``max_model_len``, as vLLM
    reports it)."""
    gateway = _gateway(request)
    name = await gateway.model_name()
    return {"object": "list", "data": [{"id": name, "object": "model", "created": gateway.started,
                                        "owned_by": "disco-serve", "max_model_len": await gateway.max_model_len()}]}


async def health(request: Request) -> dict[str, Any]:
    """``GET /health`` (no token needed): 200 while the orchestrator answers ``Info``
    (``degraded`` when one of its backends does not; ``services`` says which: SERVING or
    NOT_SERVING per role), else 503. It names no address and no error detail: those are
    for clients with the token (``disco info``)."""
    gateway = _gateway(request)
    try:
        info = await asyncio.wait_for(gateway.client.info(), HEALTH_TIMEOUT_S)
    except (asyncio.TimeoutError, grpc.RpcError) as error:
        code = error.code().name.lower() if isinstance(error, grpc.RpcError) else "deadline_exceeded"
        raise ApiError(503, "the orchestrator does not answer", code=code) from None
    down = {error.partition(":")[0] for error in info["errors"]}
    return {"status": "degraded" if info["errors"] else "ok", "active_sessions": info["active_sessions"],
            "services": {role: "NOT_SERVING" if role in down else "SERVING" for role in ("draft", "target")}}


async def metrics_text(request: Request) -> Response:
    """``GET /metrics``: the gateway's Prometheus metrics."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- generation ---------------------------------------------------------------------


class Deadline:
    """A request's deadline: ``timeout_s`` after its arrival (``None``: none)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def error(self) -> ApiError:
        return deadline_exceeded(self.timeout_s)

    def cut(self) -> bool:
        """Whether a ``CancelledError`` just raised is the deadline's: a gRPC call cancelled
        by its timer raises it on the next read, while this task is not being cancelled."""
        task = asyncio.current_task()
        return self.passed() and task is not None and not task.cancelling()


async def _generate(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Any:
    gateway = _gateway(request)
    deadline = Deadline(gateway.config.timeout_s)
    prompt_param = "messages" if chat else "prompt"
    fanout = choices.plan(body, body.generate_kwargs(_max_tokens(body, gateway.config.max_tokens_limit)),
                         gateway.config.choices_limit)
    shaper = Shaper(chat=chat, model=body.model or await gateway.model_name(),
                    policy=body.policy or SpeculationConfig().policy,
                    id=f"{'chatcmpl' if chat else 'cmpl'}-{body.request_id}" if body.request_id else "",
                    logprobs=body.logprobs_asked(), echo=bool(fanout.calls[0].get("echo")),
                    prompt_logprobs=body.prompt_logprobs, tools=chat and parses_tool_calls(body))
    try:
        # 429 at once when the queue is full; else wait for a place per call (up to the deadline).
        slot = await _unless_disconnected(request, gateway.admission.wait(len(fanout.calls)), deadline,
                                          abandon=Slot.release)
    except ApiError as error:
        _log_client_gone(error, shaper.id, "while it waited for a slot")
        raise
    if not body.stream:
        try:
            results = await _unless_disconnected(
                request, choices.all_or_none([gateway.client.generate(**kwargs) for kwargs in fanout.calls]), deadline)
        except grpc.RpcError as error:
            raise _rpc_failure(error, deadline, prompt_param) from None
        except ApiError as error:
            _log_client_gone(error, shaper.id, "before its answer")
            raise
        finally:
            slot.release()
        return shaper.completion(fanout.outputs(results))
    streams = choices.ChoiceStreams([gateway.client.stream(**kwargs) for kwargs in fanout.calls])
    # At the deadline the gRPC calls are cancelled (their next read raises CancelledError, see Deadline.cut).
    watchdog = None if deadline.at is None else asyncio.get_running_loop().call_later(deadline.remaining(),
                                                                                      streams.cancel)
    try:
        await streams.start()  # errors before the first tokens keep their HTTP status
    except BaseException as error:
        slot.release()
        if watchdog is not None:
            watchdog.cancel()
        if isinstance(error, grpc.RpcError):
            raise _rpc_failure(error, deadline, prompt_param) from None
        if isinstance(error, asyncio.CancelledError) and deadline.cut():
            raise deadline.error() from None
        raise

    def end() -> None:
        slot.release()
        if watchdog is not None:
            watchdog.cancel()

    return AdmittedEvents(_events(streams, fanout, shaper, body.include_usage, prompt_param, deadline), end)


class AdmittedEvents(EventSourceResponse):
    """Server-sent events whose request holds a slot (and a deadline timer) until the
    response ends, however it ends (finished, failed, or the client gone)."""

    def __init__(self, content: AsyncIterator[dict[str, str]], on_end: Callable[[], Any]) -> None:
        super().__init__(content)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


def _max_tokens(body: GenerationRequest, limit: int) -> int:
    """The request's ``max_tokens``, or its route's default (capped to ``limit``).

    Raises:
        ApiError: 400 naming the field when the request asks for more than ``limit``.
    """
    asked, param = body.requested_max_tokens()
    if asked is None:  # absent or null: the default, as OpenAI documents it
        return min(body.default_max_tokens(), limit)
    if asked > limit:
        raise invalid(f"{param} must be <= {limit} on this server, got {asked}", param)
    return asked


def _rpc_failure(error: grpc.RpcError, deadline: Deadline, prompt_param: str) -> ApiError:
    """The HTTP error of a failed gRPC call; a call cut by the request's deadline is 504."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    if deadline.passed() and code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return deadline.error()
    return from_rpc_error(error, prompt_param)


def _log_client_gone(error: ApiError, request_id: str, when: str) -> None:
    if error.status == 499:
        logger.info("request %s: the client went away %s; cancelled", request_id, when)


async def _events(streams: choices.ChoiceStreams, fanout: choices.Plan, shaper: Shaper, include_usage: bool,
                  prompt_param: str, deadline: Deadline) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of one streamed request, ending with ``[DONE]``: each output's
    events carry its choice ``index``, interleaved as its tokens come, and its own finish event.
    An error mid-stream (of any output) is one event with the error object, the other outputs'
    calls are cancelled, and the stream ends. When the client goes away the task is cancelled
    and so are the gRPC calls (the orchestrator then frees the request's sessions), and one
    INFO line says how many tokens were sent."""

    def event(data: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(data, ensure_ascii=False)}

    sent = 0  # tokens whose event was handed to the client
    offsets = [0] * len(streams.streams)  # characters of each choice sent (a completion's text_offset)
    started = [False] * len(streams.streams)  # whether a choice's first event went out (echo: the prompt first)
    several = len(streams.streams) > 1
    ended = False
    calls = [ToolCallStream() for _ in streams.streams] if shaper.tools else None  # text held back per choice

    def piece(index: int, source: Chunk | Completion) -> dict[str, str] | None:
        """The event of a chunk's text and logprobs (the first one: after the echoed prompt's);
        none when it adds neither (a token inside a character, without logprobs)."""
        text, entries = shaper.delta(source, not started[index])
        started[index] = True
        if calls is not None:
            text = calls[index].feed(text)
        if not text and not (entries and shaper.logprobs is not None):
            return None
        data = shaper.chunk(text=text, include_usage=include_usage, text_offset=offsets[index], index=index,
                            logprobs=entries if shaper.logprobs is not None else None)
        offsets[index] += len(text)
        return event(data)

    try:
        if shaper.chat:
            for index in range(len(streams.streams)):
                yield event(shaper.chunk(text="", role="assistant", include_usage=include_usage, index=index))
        async for index, chunk in streams.events():
            if chunk is not choices.ENDED:
                if (data := piece(index, chunk)) is not None:
                    yield data
                sent += len(chunk.token_ids)
                continue
            result = streams.streams[index].result
            if result is None:  # the stream ended without its result: never expected from the orchestrator
                raise ApiError(502, "the orchestrator's stream ended without a result", code="incomplete_stream")
            if not started[index] and (data := piece(index, result)) is not None:  # max_tokens 0: the echo only
                yield data
            finish_reason = result.finish_reason
            if calls is not None:
                rest, made = calls[index].finish(shaper.call_id(index))
                if rest:
                    yield event(shaper.chunk(text=rest, include_usage=include_usage, index=index))
                for number, call in enumerate(made):
                    yield event(shaper.chunk(include_usage=include_usage, index=index,
                                             tool_calls=[{"index": number, **call.to_openai()}]))
                finish_reason = "tool_calls" if made else finish_reason
            yield event(shaper.chunk(finish_reason=finish_reason, include_usage=include_usage, index=index,
                                     own=shaper.own(result) if several else None))
        if include_usage:
            yield event(shaper.usage_chunk(fanout.outputs([stream.result for stream in streams.streams])))
        yield {"data": "[DONE]"}
        ended = True
    except grpc.RpcError as error:
        ended = True
        yield event(_rpc_failure(error, deadline, prompt_param).body())
    except ApiError as error:
        ended = True
        yield event(error.body())
    except asyncio.CancelledError:
        if not deadline.cut():
            raise  # the client went away
        ended = True
        yield event(deadline.error().body())
    finally:
        streams.cancel()  # the client left (or a stream failed): free the sessions now
        if not ended:
            logger.info("stream %s: the client went away after %d tokens were sent; cancelled", shaper.id, sent)


async def _unless_disconnected(request: Request, call: Awaitable[T], deadline: Deadline,
                               abandon: Callable[[T], Any] | None = None) -> T:
    """Await ``call``, cancelling it when the client disconnects (499) or the deadline
    passes (504). ``abandon`` gets the result of a call that finished but was not
    returned (the client left at the same moment), e.g. to give back a slot."""
    task = asyncio.ensure_future(call)
    returned = False
    try:
        while True:
            remaining = deadline.remaining()
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S if remaining is None
                                         else min(DISCONNECT_POLL_S, remaining))
            if done:
                returned = True
                return task.result()
            if deadline.passed():
                raise deadline.error()
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the request", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
        elif not returned and abandon is not None and not task.cancelled() and task.exception() is None:
            abandon(task.result())


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


# --- errors -------------------------------------------------------------------------


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _rpc_error(request: Request, error: grpc.RpcError) -> JSONResponse:
    return await _api_error(request, from_rpc_error(error))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (no such route: 404; a method the route does not take: 405)."""
    headers = dict(error.headers or {})
    api = route_error(error.status_code, request.method, request.url.path, headers.get("Allow", ""))
    return JSONResponse(api.body(), status_code=api.status, headers=headers)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """Malformed JSON and invalid fields: 400 ``invalid_request_error`` naming one bad field.

    An unknown field is named first (``Unrecognized request argument supplied``); otherwise
    the error with the longest location, which for a union (a message's ``content``) is the
    member that matched furthest rather than the first member tried."""
    errors = error.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    if errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "")
        return await _api_error(request, invalid(f"the body is not valid JSON{': ' + reason if reason else ''}",
                                                 code="invalid_json"))
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        param = validation_param(tuple(unknown[0]["loc"]), unrecognized=True)
        return await _api_error(request, invalid(UNRECOGNIZED.format(name=param), param,
                                                 code="unrecognized_argument"))
    chosen = max(errors, key=lambda e: len(e.get("loc", ())))
    param = validation_param(tuple(chosen.get("loc", ())))
    message = str(chosen.get("msg", "invalid value"))
    return await _api_error(request, invalid(f"{param}: {message}" if param else message, param))
