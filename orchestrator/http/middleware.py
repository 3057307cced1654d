"""ASGI middleware of the gateway: the request counters, the bearer token check and the
body limit, in that order from the outside in (see :func:`orchestrator.http.app.create_app`),
so that a refused request costs no body read and no parsing; and the admission of
generation requests (:class:`Admission`: a bounded queue before 429), which the routes
apply once a request's body is valid.

Each middleware wraps the app the ASGI way (``scope``/``receive``/``send``); none parses
HTTP: uvicorn does, Starlette's :class:`~starlette.datastructures.Headers` reads the header.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import deque
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
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
        self.running = Gauge("disco_http_running_requests",
                             "Generations running: one per admitted request and output (n, best_of, prompts)",
                             registry=self.registry)
        self.waiting = Gauge("disco_http_waiting_requests", "Generation requests waiting in the queue for a slot",
                             registry=self.registry)

    def track_admission(self, admission: "Admission") -> None:
        self.running.set_function(lambda: admission.running)
        self.waiting.set_function(lambda: admission.waiting)


class Slot:
    """One admitted request's places; :meth:`release` gives them back (once, however often called)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class Admission:
    """At most ``max_concurrent`` generations at once; up to ``max_queue`` more requests wait
    for their turn, first come first served; one more is refused with 429 at once.

    A request takes one place per gRPC generation it runs (``count``: a request for ``n``
    outputs takes ``n``), all at once: a request never holds some places while it waits for
    the rest (two such requests could wait on each other), and one at the head of the queue
    is not overtaken by smaller ones behind it. A count above ``max_concurrent`` could never
    be admitted: the routes refuse it (400) before they ask. A waiting request leaves the
    queue when its deadline passes or its client goes away (the caller cancels the wait, see
    ``orchestrator.http.app``). Use it from one event loop.
    """

    def __init__(self, max_concurrent: int, max_queue: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.running = 0  # places taken (generations running)
        self.waiting = 0  # requests in the queue
        self._queue: deque[tuple[int, asyncio.Future[Slot]]] = deque()

    def wait(self, count: int = 1) -> asyncio.Future[Slot]:
        """``count`` places, at once or after a wait in the queue (cancel the future to leave the queue).

        Raises:
            ValueError: ``count`` is not in [1, ``max_concurrent``].
            ApiError: 429 ``too_many_requests`` (at once, not when awaited) when the request
                cannot start now and the queue is full.
        """
        if not 1 <= count <= self.max_concurrent:
            raise ValueError(f"a request takes 1 to {self.max_concurrent} places, not {count}")
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        if not self._queue and self.running + count <= self.max_concurrent:
            self.running += count
            future.set_result(self._slot(count))
            return future
        if self.waiting >= self.max_queue:
            raise ApiError(429, f"too many requests: {self.running} generations running and {self.waiting} "
                                "requests waiting (the limits of this server); retry later", code="too_many_requests")
        self.waiting += 1  # counted at once, so that the next request sees it
        self._queue.append((count, future))
        future.add_done_callback(self._left_queue)  # admitted, or cancelled
        return future

    def _slot(self, count: int) -> Slot:
        return Slot(lambda: self._release(count))

    def _left_queue(self, future: asyncio.Future[Slot]) -> None:
        self.waiting -= 1
        if future.cancelled():
            self._queue = deque(entry for entry in self._queue if entry[1] is not future)
            self._admit()  # the head may have left: the next ones may fit now

    def _release(self, count: int) -> None:
        self.running -= count
        self._admit()

    def _admit(self) -> None:
        """Start the requests at the head of the queue while their places are free."""
        while self._queue and (self._queue[0][1].done() or self.running + self._queue[0][0] <= self.max_concurrent):
            count, future = self._queue.popleft()
            if not future.done():  # NOTE: a cancelled one leaves the queue in its callback, a moment later
                self.running += count
                future.set_result(self._slot(count))


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
    ``Authorization: Bearer <token>`` with one of ``tokens`` (several API keys).

    Every key is compared, each in constant time, so the timing shows neither whether nor
    which one matched. A refused request's body is never read.
    """

    def __init__(self, app: ASGIApp, tokens: Sequence[str]) -> None:
        if not tokens or not all(tokens):
            raise ValueError("BearerTokenMiddleware needs at least one non-empty token")
        self.app = app
        self._expected = tuple(f"Bearer {token}".encode() for token in tokens)

    def accepts(self, presented: bytes) -> bool:
        matched = False
        for expected in self._expected:
            matched |= hmac.compare_digest(presented, expected)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            presented = Headers(scope=scope).get("authorization", "").encode("latin-1")
            if not self.accepts(presented):
                error = ApiError(401, "missing or invalid bearer token (send `Authorization: Bearer <token>`)",
                                 code="invalid_api_key")
                await refuse(error, scope, receive, send, {"WWW-Authenticate": "Bearer"}, close=has_body(scope))
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request's body before the app sees it, at most ``max_bytes`` of it.

    A ``Content-Length`` above the limit is answered 413 at once, before any of the body is
    read; a chunked body as soon as its count passes the limit (uvicorn stops reading the
    socket once it holds 64 KiB the app has not taken, so little more than the limit is
    ever held). A body that stalls ``timeout_s`` between two reads is answered 408.
    Refusals close the connection, so the rest of the body is not read either. The app then
    gets the whole body in one ``http.request`` message (FastAPI buffers it anyway to parse it).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_body(scope):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")  # h11 has checked it is a number
        if length is not None and int(length) > self.max_bytes:
            await refuse(self._too_large(), scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                error = ApiError(408, f"the request body stalled for {self.timeout_s:g} s", code="request_timeout")
                await refuse(error, scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client left: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await refuse(self._too_large(), scope, receive, send)
                return
            more_body = message.get("more_body", False)
        await self.app(scope, _replaying({"type": "http.request", "body": b"".join(chunks), "more_body": False},
                                         receive), send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                        code="request_too_large")


def has_body(scope: Scope) -> bool:
    """Whether a request comes with a body (a non-zero ``Content-Length``, or chunked)."""
    headers = Headers(scope=scope)
    length = headers.get("content-length")
    return int(length) > 0 if length is not None else "transfer-encoding" in headers


def _replaying(first: Message, receive: Receive) -> Receive:
    """``receive`` that answers ``first`` once, then the connection's own messages (``http.disconnect``)."""
    pending: list[Message] = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def refuse(error: ApiError, scope: Scope, receive: Receive, send: Send,
                 headers: dict[str, str] | None = None, close: bool = True) -> None:
    """Answer ``error`` without reading (more of) the request's body; with ``close``, close
    the connection after the answer (``Connection: close``) so that the body is not read at all."""
    headers = {**(headers or {}), **({"Connection": "close"} if close else {})}
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)
