"""ASGI middleware of the gateway: the bearer token check and the request counters.

Both wrap the app the ASGI way (``scope``/``receive``/``send``); neither parses HTTP:
uvicorn does, Starlette's :class:`~starlette.datastructures.Headers` reads the header.
"""

from __future__ import annotations

import hmac
import time
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.http.errors import ApiError

#: Paths under this prefix need the token (``/health`` and ``/metrics`` stay open, as gRPC health does).
PROTECTED_PREFIX = "/v1/"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HttpMetrics:
    """Prometheus metrics of one gateway, in their own registry (served at ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("disco_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("disco_http_request_duration_seconds",
                                 "Time to the end of the HTTP response (streams: the whole stream)",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)


class MetricsMiddleware:
    """Counts every HTTP request by route (the matched route's path; a request refused
    before routing counts under its path when that is one of ``routes``; else
    ``unmatched``), method and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, routes: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", None) or (
                scope["path"] if scope["path"] in self.routes else "unmatched")
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


class BearerTokenMiddleware:
    """Answers 401 (OpenAI error shape) unless a request to ``/v1/...`` carries
    ``Authorization: Bearer <token>``; the comparison takes constant time."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            presented = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(presented, self._expected):
                error = ApiError(401, "missing or invalid bearer token (send `Authorization: Bearer <token>`)",
                                 code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
