"""The gRPC runtime shared by the draft, target and orchestrator servers.

* :class:`ErrorInterceptor` — the one place where domain errors become status codes
  (unary and server-streaming handlers alike); :func:`error_from_rpc` is its inverse for
  clients of a backend, so an error keeps its code across hops.
* :func:`start_server` — a thread-pool server with ``grpc.health.v1`` (SERVING) and
  server reflection, bound to ``host:port`` (port 0 picks a free port), TLS or mTLS when
  given :class:`~protos.runtime.tls.TlsFiles`, its own :class:`~protos.runtime.metrics.ServerMetrics`
  (``/metrics`` served when a metrics port is given) and optional extra interceptors
  (the orchestrator's bearer-token check).
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
    SessionMismatch,
    SessionNotFound,
    Unavailable,
)
from protos.runtime.metrics import ObservabilityInterceptor, ServerMetrics
from protos.runtime.tls import TlsFiles

logger = logging.getLogger(__name__)

#: Backend messages carry up to max_lookahead full-vocabulary float32 distributions.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
#: While a call runs, a backend that stops answering HTTP/2 pings (a hung or frozen
#: process, a black-holed network) fails the call with UNAVAILABLE within about
#: KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, instead of holding it until its deadline.
KEEPALIVE_TIME_MS = 5000
KEEPALIVE_TIMEOUT_MS = 3000
#: Clients of a backend: reconnect quickly after a restart (gRPC's default backoff grows
#: to 2 min), ping during calls (above), and read server streams on the calling thread
#: (no hop through the channel's spin thread per draft token).
CHANNEL_OPTIONS = MESSAGE_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # NOTE: what recent gRPC cores obey (default 60 s)
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging during a long prefill
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
)
#: Servers accept those pings (gRPC's default answers pings more frequent than every
#: 5 minutes without data with GOAWAY "too many pings"), and ping their own clients
#: every 30 s: a client that vanished without closing its connection (host down,
#: partition) has its calls cancelled, and so its sessions freed, within ~40 s.
SERVER_KEEPALIVE_OPTIONS = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
)
GENERIC_INTERNAL_MESSAGE = "internal server error (the server log has the details)"


class Cancelled(DiscoError):
    """The caller cancelled the request while it ran."""


class DeadlineExceeded(Cancelled):
    """The request's deadline passed while it ran (the client sees ``DEADLINE_EXCEEDED``,
    whichever side notices first)."""


#: Domain error -> status code, most specific first. Anything else is INTERNAL.
STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ModelError, grpc.StatusCode.FAILED_PRECONDITION),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
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
    answered with ``INTERNAL`` and a generic message (no internals leak to clients). A
    request that does not parse as its message is ``INVALID_ARGUMENT`` (gRPC's own
    answer would be ``INTERNAL``).
    """

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary, method),
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer)


class MalformedRequest:
    """Stands in for a request whose bytes did not parse; the handler refuses it."""

    session_id = None

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # noqa: BLE001 - DecodeError, or anything a parser raises
            return MalformedRequest(error)

    return deserialize


def _check_parsed(request: Any) -> None:
    if isinstance(request, MalformedRequest):
        raise InvalidRequest(f"the request is not a valid protobuf message of this method ({request.error})")


def _unary(behavior: Callable, method: str) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            _check_parsed(request)
            return behavior(request, context)
        except Exception as error:  # noqa: BLE001 - this is the one place errors are mapped
            _abort(context, method, error)

    return handle


def _streaming(behavior: Callable, method: str) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Iterable[Any]:
        try:
            _check_parsed(request)
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
    metrics: ServerMetrics | None = None
    tls: bool = False

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of ``/metrics`` when it is served over HTTP."""
        port = self.metrics.http_port if self.metrics is not None else None
        return format_address(self.host, port) if port is not None else None

    def stop(self, grace_s: float | None = 2.0) -> None:
        """Report NOT_SERVING, finish in-flight calls for up to ``grace_s``, then stop;
        servicers with a ``close()`` (threads of their own) are closed last."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        for servicer in self.servicers:
            close = getattr(servicer, "close", None)
            if close is not None:
                close()
        if self.metrics is not None:
            self.metrics.close()


#: ``(add_XServicer_to_server, servicer, full service name)``
ServiceRegistration = tuple[Callable[[Any, grpc.Server], None], Any, str]


def start_server(services: Sequence[ServiceRegistration], host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 16, *, tls: TlsFiles | None = None, require_client_cert: bool | None = None,
                 metrics: ServerMetrics | None = None, metrics_port: int | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 max_receive_bytes: int = MAX_MESSAGE_BYTES) -> RunningServer:
    """Start a server for ``services`` plus health (all SERVING) and reflection.

    Args:
        services: what to serve.
        host: interface to bind (127.0.0.1 unless the deployment says otherwise).
        port: port to bind; 0 picks a free one.
        max_workers: threads, i.e. calls handled at once.
        tls: serve TLS with ``tls.cert``/``tls.key`` (plaintext when ``None``).
        require_client_cert: require client certificates signed by ``tls.ca`` (mTLS);
            ``None``: exactly when ``tls.ca`` is given.
        metrics: this server's metrics (a fresh :class:`ServerMetrics` when ``None``).
        metrics_port: serve ``/metrics`` over HTTP on ``host:metrics_port`` (0: a free
            port); ``None``: not served.
        interceptors: run after the observability interceptor, before error mapping.
        max_receive_bytes: largest request message accepted.

    Raises:
        DiscoError: ``host:port`` (or the metrics port) cannot be bound, or the TLS
            material is incomplete.
    """
    metrics = metrics or ServerMetrics(services[0][2].rpartition(".")[2].removesuffix("Service").lower()
                                       if services else "")
    options = (("grpc.max_receive_message_length", max_receive_bytes),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *SERVER_KEEPALIVE_OPTIONS)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=[ObservabilityInterceptor(metrics), *interceptors, ErrorInterceptor()],
                         options=options)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [name for _, _, name in services]
    for add, servicer, name in services:
        add(servicer, server)
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = format_address(host, port)
    credentials = None
    if tls is not None:
        credentials = tls.server_credentials(tls.ca is not None if require_client_cert is None
                                             else require_client_cert)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise DiscoError(f"cannot listen on {address} (address in use or not available)")
    if metrics_port is not None:
        try:
            metrics.serve_http(host, metrics_port)
        except OSError as error:
            raise DiscoError(f"cannot serve /metrics on {format_address(host, metrics_port)}: "
                             f"{error.strerror or error}") from None
    server.start()
    return RunningServer(server, host, bound, health_servicer, tuple(s for _, s, _ in services), metrics,
                         tls=credentials is not None)


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
        for running in servers:
            if running.metrics is not None:
                running.metrics.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
