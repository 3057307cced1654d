"""The OpenAI-compatible HTTP API in front of one orchestrator: the ASGI app and its routes.

Every generation request becomes exactly one gRPC ``Generate`` (streamed) or
``GenerateUnary`` call through :class:`~orchestrator.client.AsyncDiscoClient`; this layer
holds no model and no speculation logic, only the mapping of fields
(:mod:`orchestrator.http.schemas`, :mod:`orchestrator.http.responses`) and of errors
(:mod:`orchestrator.http.errors`). Routes: ``POST /v1/completions``, ``POST
/v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse

import disco
from disco.config import SpeculationConfig
from orchestrator.client import AsyncDiscoClient, AsyncGenerationStream, Chunk
from orchestrator.http.config import HttpConfig
from orchestrator.http.errors import ApiError, from_rpc_error, invalid
from orchestrator.http.middleware import BearerTokenMiddleware, BodyLimitMiddleware, HttpMetrics, MetricsMiddleware
from orchestrator.http.responses import Shaper
from orchestrator.http.schemas import ChatCompletionRequest, CompletionRequest, validation_param

HEALTH_TIMEOUT_S = 5.0
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks whether its client went away
FALLBACK_MODEL_NAME = "disco"
T = TypeVar("T")


class Gateway:
    """What the routes of one app share: its settings, the gRPC client (created in the
    app's event loop) and the served model's name (asked once)."""

    def __init__(self, config: HttpConfig, client: AsyncDiscoClient) -> None:
        self.config = config
        self.client = client
        self.started = int(time.time())
        self._model_name = config.model_name

    async def model_name(self) -> str:
        """The served model: ``config.model_name``, else the target's name from ``Info``."""
        if self._model_name is None:
            info = await self.client.info()
            target = info["models"]["target"]
            if target is None:  # the target is unreachable now: do not remember a stand-in
                return FALLBACK_MODEL_NAME
            self._model_name = target["model_name"] or FALLBACK_MODEL_NAME
        return self._model_name


def create_app(config: HttpConfig) -> FastAPI:
    """The ASGI app of one gateway (run it with uvicorn, see :mod:`orchestrator.http.server`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncDiscoClient(config.server, timeout=config.timeout_s, tls_ca=config.tls_ca,
                                  tls_cert=config.tls_cert, tls_key=config.tls_key,
                                  tls_server_name=config.tls_server_name, auth_token=config.upstream_token or "")
        app.state.gateway = Gateway(config, client)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="disco-serve OpenAI-compatible API", version=disco.__version__, lifespan=lifespan,
                  description="Speculative decoding (DISCO) behind the OpenAI API; see docs/http.md.")
    metrics = HttpMetrics()
    app.state.metrics = metrics
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics_text, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
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
    """``GET /v1/models``: the one served model."""
    gateway = _gateway(request)
    name = await gateway.model_name()
    return {"object": "list", "data": [{"id": name, "object": "model", "created": gateway.started,
                                        "owned_by": "disco-serve"}]}


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


async def _generate(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Any:
    gateway = _gateway(request)
    prompt_param = "messages" if chat else "prompt"
    kwargs = body.generate_kwargs()
    shaper = Shaper(chat=chat, model=body.model or await gateway.model_name(),
                    policy=body.policy or SpeculationConfig().policy)
    try:
        if not body.stream:
            result = await _unless_disconnected(request, gateway.client.generate(**kwargs))
            return shaper.completion(result)
        stream = gateway.client.stream(**kwargs)
        chunks = stream.__aiter__()
        first = await anext(chunks, None)  # errors before the first token keep their HTTP status
    except grpc.RpcError as error:
        raise from_rpc_error(error, prompt_param) from None
    return EventSourceResponse(_events(stream, chunks, first, shaper, body.include_usage, prompt_param))


async def _events(stream: AsyncGenerationStream, chunks: AsyncIterator[Chunk], first: Chunk | None, shaper: Shaper,
                  include_usage: bool, prompt_param: str) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of one streamed generation, ending with ``[DONE]``; an
    error mid-stream is one event with the error object, and the stream ends. When the
    client goes away the task is cancelled and so is the gRPC call (the orchestrator then
    frees the request's sessions)."""

    def event(data: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(data, ensure_ascii=False)}

    try:
        if shaper.chat:
            yield event(shaper.chunk(text="", role="assistant", include_usage=include_usage))
        if first is not None:
            if first.text:
                yield event(shaper.chunk(text=first.text, include_usage=include_usage))
            async for chunk in chunks:
                if chunk.text:
                    yield event(shaper.chunk(text=chunk.text, include_usage=include_usage))
        result = stream.result
        if result is None:  # the stream ended without its result: never expected from the orchestrator
            raise ApiError(502, "the orchestrator's stream ended without a result", code="incomplete_stream")
        yield event(shaper.chunk(finish_reason=result.finish_reason, include_usage=include_usage))
        if include_usage:
            yield event(shaper.usage_chunk(result))
        yield {"data": "[DONE]"}
    except grpc.RpcError as error:
        yield event(from_rpc_error(error, prompt_param).body())
    except ApiError as error:
        yield event(error.body())
    finally:
        if stream.result is None:
            stream.cancel()  # the client left (or the stream failed): free the sessions now


async def _unless_disconnected(request: Request, call: Awaitable[T]) -> T:
    """Await ``call``, cancelling it (and so the gRPC call) when the client disconnects."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the request", code="client_closed_request")
    finally:
        task.cancel()


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


# --- errors -------------------------------------------------------------------------


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _rpc_error(request: Request, error: grpc.RpcError) -> JSONResponse:
    return await _api_error(request, from_rpc_error(error))


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """Malformed JSON and invalid fields: 400 ``invalid_request_error`` naming the first bad field."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return await _api_error(request, invalid(f"the body is not valid JSON{': ' + reason if reason else ''}",
                                                 code="invalid_json"))
    param = validation_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    return await _api_error(request, invalid(f"{param}: {message}" if param else message, param))
