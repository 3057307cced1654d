"""The gRPC runtime shared by the draft, target and orchestrator servers.

* :class:`ErrorInterceptor` — the one place where domain errors become status codes
  (unary and server-streaming handlers alike); :func:`error_from_rpc` is its inverse for
  clients of a backend, so an error keeps its code across hops.
* :func:`start_server` — a thread-pool server with ``grpc.health.v1`` (SERVING) and
  server reflection, bound to ``host:port`` (port 0 picks a free port).
* :func:`serve_until_signal` — blocks until SIGTERM/SIGINT, then drains gracefully.

NOTE: the servers are synchronous (``grpc.server`` + a thread pool), not ``grpc.aio``:
the engines are synchronous torch code behind a forward lock, so a thread per in-flight
call maps onto them directly, and a streaming handler that stops being iterated is
closed, which runs the speculation loop's ``finally`` (sessions freed). Clients may use
either API (:class:`orchestrator.client.AsyncDiscoClient` uses ``grpc.aio``).
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disco.errors import (
    DiscoError,
    InvalidRequest,
    ModelError,
    ResourceExhausted,
    SessionNotFound,
    Unavailable,
)

logger = logging.getLogger(__name__)

#: Backend messages carry up to max_lookahead full-vocabulary float32 distributions.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
#: Clients of a backend: reconnect quickly after a restart (gRPC's default backoff grows
#: to 2 min), and read server streams on the calling thread (no hop through the
#: channel's spin thread per draft token).
CHANNEL_OPTIONS = MESSAGE_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
)
GENERIC_INTERNAL_MESSAGE = "internal server error (the server log has the details)"


class Cancelled(DiscoError):
    """The caller cancelled the request (or its deadline passed) while it ran."""


#: Domain error -> status code, most specific first. Anything else is INTERNAL.
STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ModelError, grpc.StatusCode.FAILED_PRECONDITION),
    (Cancelled, grpc.StatusCode.CANCELLED),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for ``error``."""
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE


def error_from_rpc(error: grpc.RpcError, service: str) -> Exception:
    """The domain error matching a failed call to a backend (inverse of :func:`status_for`).

    Args:
        error: the failed call (it exposes ``code()`` and ``details()``).
        service: what was called, for the message, e.g. ``"draft service at 10.0.0.2:50052"``.
    """
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{service} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"{service} did not answer within the deadline")
    for error_type, mapped in STATUS_BY_ERROR:
        if code == mapped:
            return error_type(details)
    return RuntimeError(f"{service} failed with {code.name}: {details}")


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by unary and server-streaming handlers to status codes.

    Domain errors keep their message; anything else is logged with its traceback and
    answered with ``INTERNAL`` and a generic message (no internals leak to clients).
    """

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def _unary(behavior: Callable, method: str) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except Exception as error:  # noqa: BLE001 - this is the one place errors are mapped
            _abort(context, method, error)

    return handle


def _streaming(behavior: Callable, method: str) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Iterable[Any]:
        try:
            yield from behavior(request, context)
        except Exception as error:  # noqa: BLE001 - this is the one place errors are mapped
            _abort(context, method, error)

    return handle


def _abort(context: grpc.ServicerContext, method: str, error: Exception) -> None:
    code, message = status_for(error)
    if not context.is_active():
        logger.info("%s ended after the client left (%s: %s)", method, type(error).__name__, error)
    elif code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed", method, exc_info=error)
    else:
        logger.info("%s -> %s: %s", method, code.name, message)
    context.abort(code, message)


@dataclass
class RunningServer:
    """A started server; ``port`` is the bound port (useful with port 0)."""

    server: grpc.Server
    host: str
    port: int
    health: health.HealthServicer
    servicers: tuple[Any, ...]

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def stop(self, grace_s: float | None = 2.0) -> None:
        """Report NOT_SERVING, finish in-flight calls for up to ``grace_s``, then stop."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


#: ``(add_XServicer_to_server, servicer, full service name)``
ServiceRegistration = tuple[Callable[[Any, grpc.Server], None], Any, str]


def start_server(services: Sequence[ServiceRegistration], host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 16) -> RunningServer:
    """Start a server for ``services`` plus health (all SERVING) and reflection.

    Raises:
        DiscoError: ``host:port`` cannot be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=[ErrorInterceptor()], options=MESSAGE_OPTIONS)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [name for _, _, name in services]
    for add, servicer, name in services:
        add(servicer, server)
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise DiscoError(f"cannot listen on {address} (address in use or not available)")
    server.start()
    return RunningServer(server, host, bound, health_servicer, tuple(s for _, s, _ in services))


def format_address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def serve_until_signal(servers: Sequence[RunningServer], grace_s: float = 5.0) -> None:
    """Block until SIGTERM or SIGINT, then stop ``servers`` gracefully (main thread only)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
        logger.info("shutting down (grace %.1f s)", grace_s)
        for running in servers:
            running.health.enter_graceful_shutdown()
        for event in [running.server.stop(grace_s) for running in servers]:
            event.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
