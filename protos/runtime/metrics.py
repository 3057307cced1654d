"""Prometheus metrics of one server, and the interceptor that times every call.

Each server owns a :class:`ServerMetrics` with its own
:class:`~prometheus_client.CollectorRegistry` (never the global default one: tests and
Ray actors run several servers in one process). Collection is always on (a few
microseconds per call); ``--metrics-port`` only decides whether ``/metrics`` is served
over HTTP. Names follow vLLM's where one exists (``vllm:X`` -> ``disco_X``); the full
list is in docs/operations.md.

:class:`ObservabilityInterceptor` is the outermost interceptor: it starts each call's
log context (:mod:`protos.runtime.logs`) and observes ``disco_grpc_server_handling_seconds``
with the status code the call ended with (refusals by the token check included).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator, Sequence

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily

import disco
from protos.runtime.logs import replace_log_fields

#: RPC latencies span sub-millisecond Info calls to minutes-long streams.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
               60.0, 120.0, 300.0)


class ServerMetrics:
    """The metrics every server exposes.

    Args:
        role: ``"orchestrator"``, ``"draft"`` or ``"target"`` (the ``disco_service_info`` label).
        model: what it serves (a model name, or the tokenizer for the orchestrator).
    """

    def __init__(self, role: str, model: str = "") -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "disco_grpc_server_handling_seconds", "Time to handle a gRPC call (a stream: until it ends), by status",
            ["grpc_service", "grpc_method", "grpc_code"], buckets=RPC_BUCKETS, registry=self.registry)
        self.active_sessions = Gauge("disco_active_sessions",
                                     "Sessions held now (orchestrator: requests in flight)", registry=self.registry)
        self.max_sessions = Gauge("disco_max_sessions", "Limit on concurrent sessions", registry=self.registry)
        self.prompt_tokens = Counter(
            "disco_prompt_tokens", "Prompt tokens received (backends: prefilled, re-prefills included)",
            registry=self.registry)
        Info("disco_service", "What this server is", registry=self.registry).info(
            {"role": role, "model": model, "version": disco.__version__})
        self._http: Any = None
        self.http_port: int | None = None

    def track_sessions(self, count: Callable[[], int], max_sessions: int) -> None:
        """Read ``disco_active_sessions`` from ``count()`` at every scrape."""
        self.active_sessions.set_function(count)
        self.max_sessions.set(max_sessions)

    def track_kv(self, budget_bytes: int, reserved_bytes: Callable[[], int], pool_bytes: Callable[[], int]) -> None:
        """The KV cache's memory, read at every scrape: ``disco_kv_cache_budget_bytes`` (what
        admission allows), ``disco_kv_cache_reserved_bytes`` (what admitted sessions reserved) and
        ``disco_kv_pool_bytes`` (what the model's KV pool holds: its chunks, docs/operations.md)."""
        Gauge("disco_kv_cache_budget_bytes", "KV-cache bytes all sessions together may reserve (--max-kv-bytes or "
              "derived at start)", registry=self.registry).set(budget_bytes)
        Gauge("disco_kv_cache_reserved_bytes", "KV-cache bytes reserved by the admitted sessions",
              registry=self.registry).set_function(reserved_bytes)
        Gauge("disco_kv_pool_bytes", "Bytes the model's KV pool holds (chunks of pages, allocated as sessions need "
              "them)", registry=self.registry).set_function(pool_bytes)

    def track_batches(self, batch_sizes: Callable[[], Sequence[int]], packed: bool = True, detail: str = "") -> None:
        """Expose the mean of the engine's recent forward batch sizes (cross-session batching)
        and whether forwards are packed (``disco_forward_batching_packed``: 1 packed, 0 one by
        one; ``disco_forward_batching_info{detail}``: the engine's
        :class:`disco.engines.packing_proof.PackingVerdict` line)."""
        Gauge("disco_forward_batching_packed", "1: concurrent sessions' forwards run packed (proven exact on this "
              "machine at start); 0: one by one", registry=self.registry).set(int(packed))
        Info("disco_forward_batching", "How concurrent sessions' forwards run, and why",
             registry=self.registry).info({"detail": detail})
        gauge = Gauge("disco_forward_batch_size_recent_mean",
                      "Mean sessions per model forward over the engine's recent forwards (up to 1000)",
                      registry=self.registry)

        def mean() -> float:
            sizes = list(batch_sizes())
            return sum(sizes) / len(sizes) if sizes else 0.0

        gauge.set_function(mean)

    def describe_exactness(self, proven: bool, statement: str) -> None:
        """State whether greedy output is proven equal to target-only on this engine's device
        (``disco_exactness_proven``: 1 proven bit for bit at start, 0 not proven: near-ties
        may differ; ``disco_exactness_info{statement}``: the engine's
        :class:`disco.engines.packing_proof.Exactness` line)."""
        Gauge("disco_exactness_proven", "1: verified blocks proven at start to give decoding's logits bit for bit "
              "on this device (greedy output equals target-only); 0: not proven, greedy output may differ from "
              "target-only on near-ties", registry=self.registry).set(int(proven))
        Info("disco_exactness", "Whether greedy speculative output is proven equal to target-only here, and how",
             registry=self.registry).info({"statement": statement})

    def describe_forward(self, forward: str) -> None:
        """Name what runs this backend's forwards (``disco_forward_info{forward}``, ``Info.forward``:
        :func:`disco.engines.packed_forward.describe_forward`)."""
        Info("disco_forward", "What runs the model's forwards: the lean decoder (its layer loop in C++ or "
             "Python) or the HF decoder forward; every path gives the HF forward's bits where it runs",
             registry=self.registry).info({"forward": forward})

    def describe_security(self, statement: str) -> None:
        """State how this backend authenticates its callers (``disco_insecure``: 1 when it
        serves beyond loopback without client authentication, ``--insecure``;
        ``disco_security_info{statement}``: :meth:`BackendSecurity.statement`)."""
        Gauge("disco_insecure", "1: this backend is reachable beyond loopback without client authentication "
              "(--insecure); 0: every call is authenticated or it listens on loopback only",
              registry=self.registry).set(int(statement.startswith("INSECURE")))
        Info("disco_security", "How this backend authenticates its callers", registry=self.registry).info(
            {"statement": statement})

    def track_live_costs(self, seconds_by_rows: Callable[[], Sequence[float]]) -> None:
        """``disco_forward_seconds_live{rows}``: the engine's observed forward seconds by rows
        (:class:`disco.engines.live_costs.LiveCosts`), read at every scrape; row counts
        not observed yet are left out."""
        self.registry.register(_LiveCostsCollector(seconds_by_rows))

    def track_overlap(self) -> None:
        """Draft services: the overlapped-drafting counters (``disco draft-server --overlap on``;
        they stay 0 while overlap is off). Feed them with :meth:`count_overlap`."""
        r = self.registry
        self.overlap_hits = Counter("disco_overlap_hits", "Draft calls whose block had been pre-drafted on a "
                                    "right guess (overlapped drafting)", registry=r)
        self.overlap_misses = Counter("disco_overlap_misses", "Draft calls whose pre-drafted block was thrown "
                                      "away (a wrong guess, or pre-drafting failed)", registry=r)
        self.predrafted_used = Counter("disco_overlap_predrafted_tokens_used",
                                       "Pre-drafted tokens streamed as draft tokens", registry=r)
        self.predrafted_wasted = Counter("disco_overlap_predrafted_tokens_wasted",
                                         "Pre-drafted tokens thrown away", registry=r)

    def count_overlap(self, hit: bool, miss: bool, used: int, wasted: int) -> None:
        """Count one Draft call's overlap outcome (its ``DraftSummary``)."""
        self.overlap_hits.inc(int(hit))
        self.overlap_misses.inc(int(miss))
        self.predrafted_used.inc(used)
        self.predrafted_wasted.inc(wasted)

    def describe_engine(self, engine: str, device: str, forward_s: Sequence[float] = (), prefill: str = "") -> None:
        """Name the engine this backend runs (``disco_engine_info``), how it multiplies prefill
        blocks where it had a choice (``disco_prefill_info{path}``, ``Info.prefill``: the
        weight-only engines) and expose its measured forward costs
        (``disco_engine_forward_seconds{new_tokens="k"}``, from :mod:`disco.engines.engine_costs`)."""
        Info("disco_engine", "The engine the model runs as (concrete dtype; int8 = int8 weight-only, "
             "bfloat16 activations) and its device", registry=self.registry).info(
            {"engine": engine, "device": device})
        if prefill:
            Info("disco_prefill", "How prompt prefill blocks are multiplied, chosen by measurement at load: kernel "
                 "(the decoded rows' kernel) or a dense GEMM's dtype; replicas that differ prefill with other "
                 "numerics", registry=self.registry).info({"path": prefill})
        if forward_s:
            gauge = Gauge("disco_engine_forward_seconds",
                          "Measured seconds of one model forward over new_tokens new tokens after a ~200-token "
                          "context (median; measured once per model, engine, device and thread count)",
                          ["new_tokens"], registry=self.registry)
            for k, seconds in enumerate(forward_s, start=1):
                gauge.labels(str(k)).set(seconds)

    def serve_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port."""
        self._http, _ = start_http_server(port, addr=host.strip("[]"), registry=self.registry)
        self.http_port = int(self._http.server_port)
        return self.http_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def exposition(self) -> str:
        """The text ``/metrics`` would answer now."""
        return generate_latest(self.registry).decode()


class _LiveCostsCollector:
    def __init__(self, seconds_by_rows: Callable[[], Sequence[float]]) -> None:
        self.seconds_by_rows = seconds_by_rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("disco_forward_seconds_live",
                                   "Observed seconds of a decoding/verification forward over `rows` new tokens "
                                   "(all sessions it packs): decaying average while serving", labels=["rows"])
        for rows, seconds in enumerate(self.seconds_by_rows(), start=1):
            if seconds > 0:
                family.add_metric([str(rows)], seconds)
        yield family


class ObservabilityInterceptor(grpc.ServerInterceptor):
    """Outermost interceptor: per-call log context and the per-RPC latency histogram."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        histogram = self._metrics.rpc_seconds

        def observe(code: str, seconds: float) -> None:
            histogram.labels(service, method, code).observe(seconds)

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _observed_stream(handler.unary_stream, handler_call_details.method, observe),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _observed_unary(handler.unary_unary, handler_call_details.method, observe),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _start(request: Any, context: grpc.ServicerContext, rpc: str) -> float:
    session_id = getattr(request, "session_id", None) or None
    replace_log_fields(rpc=rpc, peer=context.peer(), session_id=session_id,
                       request_id=None if session_id else uuid.uuid4().hex[:12])
    return time.perf_counter()


def _code(context: grpc.ServicerContext, default: grpc.StatusCode) -> str:
    code = context.code()
    return (code if isinstance(code, grpc.StatusCode) else default).name


def _observed_unary(behavior: Callable, rpc: str, observe: Callable[[str, float], None]) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        started = _start(request, context, rpc)
        code = grpc.StatusCode.UNKNOWN
        try:
            response = behavior(request, context)
            code = grpc.StatusCode.OK
            return response
        finally:
            observe(_code(context, code), time.perf_counter() - started)

    return handle


def _observed_stream(behavior: Callable, rpc: str, observe: Callable[[str, float], None]) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        started = _start(request, context, rpc)
        code = grpc.StatusCode.UNKNOWN
        try:
            yield from behavior(request, context)
            code = grpc.StatusCode.OK
        except GeneratorExit:  # the client went away (cancel, deadline, disconnect)
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            observe(_code(context, code), time.perf_counter() - started)

    return handle


def sample_value(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of sample ``name{labels}`` in an exposition text (tests and tools)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return None

