"""The orchestrator's view of its backends: the replicas of the draft and target
services (:class:`~orchestrator.routing.ReplicaSet`, one channel per replica, shared by
all requests), what they serve (fetched once, then cached), and the checks that a
draft, a target and the orchestrator's tokenizer belong together."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import replace
from typing import Sequence

import grpc

from disco.errors import DiscoError, ModelError, Unavailable, VocabularyMismatch
from disco.speculation.cost_model import CostModel
from disco.speculation.live_model import live_cost_model
from disco.stats import RequestStats
from orchestrator.call_overhead import CallOverhead
from orchestrator.failover import FailoverDrafter, FailoverVerifier, SessionTrack
from orchestrator.remote import CallScope
from orchestrator.routing import ReplicaSet
from protos.disco.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from protos.runtime.server import error_from_rpc
from protos.runtime.tls import TlsFiles

DESCRIBE_TIMEOUT_S = 5.0
#: How long a request waits for the target's channel to connect before it is UNAVAILABLE: the
#: channel's longest reconnect backoff (``grpc.max_reconnect_backoff_ms`` of
#: :data:`protos.runtime.server.CHANNEL_OPTIONS`, 2 s) and a margin, so a target that came up
#: after the orchestrator is found by its next connection attempt.
CONNECT_WAIT_S = 2.5


#: How long an orchestrator goes on without costs before asking the services again.
COSTS_RETRY_S = 30.0
#: How often the services' live forward costs are read again (an ``Info`` call each).
LIVE_REFRESH_S = 1.0


class Backends:
    """The draft and target replicas.

    Args:
        draft: ``HOST:PORT`` of the draft service (several comma-separated: replicas),
            or a :class:`ReplicaSet` (e.g. discovered through Ray).
        target: the same for the target service.
        tokenizer_hash: hash of the orchestrator's tokenizer (:func:`disco.models.loading.tokenizer_hash`);
            every service must serve a model with this tokenizer.
        tls: TLS towards the backends: ``ca`` verifies them, ``cert``/``key`` is the
            orchestrator's client identity (mTLS); ``None``: plaintext.
    """

    def __init__(self, draft: str | ReplicaSet, target: str | ReplicaSet, tokenizer_hash: str,
                 tls: TlsFiles | None = None, interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()) -> None:
        self.draft = draft if isinstance(draft, ReplicaSet) else ReplicaSet.static("draft", draft)
        self.target = target if isinstance(target, ReplicaSet) else ReplicaSet.static("target", target)
        if tls is not None:
            self.draft.tls = self.target.tls = tls
        self.draft.interceptors = self.target.interceptors = tuple(interceptors)
        self.tokenizer_hash = tokenizer_hash
        self._target_info: common_pb2.ServiceInfo | None = None
        self._costs: CostModel | None = None
        self._costs_retry_at = 0.0  # no costs known: ask the services again after this time
        self._live: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # target's, draft's seconds by rows
        self._live_read_at = float("-inf")
        self._draft_checked = False
        self.call_overhead = CallOverhead()  # auto's t_rtt, once a request served alone was observed
        self._lock = threading.Lock()

    @property
    def draft_address(self) -> str:
        return ",".join(self.draft.addresses())

    @property
    def target_address(self) -> str:
        return ",".join(self.target.addresses())

    def session(self, scope: CallScope) -> tuple[FailoverDrafter, FailoverVerifier]:
        """A drafter and a verifier for one request, sharing what it has committed (so
        either can re-create its session on another replica)."""
        track = SessionTrack()
        return FailoverDrafter(self.draft, scope, track), FailoverVerifier(self.target, scope, track)

    def routing(self) -> dict[str, list[dict]]:
        """Per-replica routing state of both roles."""
        return {"draft": self.draft.snapshot(), "target": self.target.snapshot()}

    def describe(self, role: str, timeout: float = DESCRIBE_TIMEOUT_S,
                 wait_for_ready: bool = False) -> common_pb2.ServiceInfo:
        """The ``Info`` of a healthy replica of the ``"draft"`` or ``"target"`` service;
        ``wait_for_ready``: wait up to ``timeout`` for the channel to connect instead of
        failing at once while it backs off between connection attempts (a replica that came
        up after the orchestrator: its channel may wait up to 2 s before trying again).

        Raises:
            Unavailable: no replica can be reached.
        """
        replica = (self.draft if role == "draft" else self.target).peek()
        stub = (draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub)(
            replica.channel)
        try:
            return stub.Info(common_pb2.ServiceInfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as error:
            if wait_for_ready and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unavailable(f"{role} service at {replica.address} is unavailable: "
                                  f"no connection within {timeout:g} s") from None
            raise error_from_rpc(error, f"{role} service at {replica.address}") from None

    def target_info(self) -> common_pb2.ServiceInfo:
        """The target's ``Info`` (cached after the first success); its EOS ids are authoritative.

        Raises:
            Unavailable: the target cannot be reached.
            ModelError: the target's tokenizer differs from the orchestrator's.
        """
        with self._lock:
            if self._target_info is None:
                info = self.describe("target", CONNECT_WAIT_S, wait_for_ready=True)  # a request needs it
                if info.tokenizer_hash != self.tokenizer_hash:
                    raise ModelError(
                        f"the target service at {self.target_address} serves {info.model_name!r}, whose tokenizer "
                        "differs from the orchestrator's; start the orchestrator with --model set to the target model")
                self._target_info = info
            return self._target_info

    def costs(self, in_flight: int = 1) -> CostModel | None:
        """The cost model ``auto`` decides one request with, ``in_flight`` requests (this one
        included) being served: the calibration corrected by the services' live forward
        costs, at the load (:func:`disco.speculation.live_model.live_cost_model`; the sessions
        per target replica are ``in_flight`` spread over the replicas), with the call overhead
        observed on requests served alone as ``t_rtt`` (:mod:`orchestrator.call_overhead`; the
        ``Info`` round trip until one was). ``None`` while a service reports no costs or cannot
        be reached."""
        calibrated = self.calibrated_costs()
        if calibrated is None:
            return None
        target_live, draft_live = self.live_costs()
        replicas = max(1, len(self.target.addresses()))
        costs = live_cost_model(calibrated, target_live, draft_live, -(-max(1, in_flight) // replicas))
        overhead = self.call_overhead.seconds()
        if overhead is None:
            return costs
        return replace(costs, t_rtt=overhead, source=f"{costs.source}, call overhead {overhead * 1000:.1f} ms "
                                                      f"observed over {self.call_overhead.requests()} request(s)")

    def observe_calls(self, stats: RequestStats) -> None:
        """Add the calls of a request served alone to the observed call overhead (priced at
        the draft's live forward cost; a request that drafted is skipped while no cost is known)."""
        if stats.draft_forwards == 0:
            self.call_overhead.observe(stats, 0.0)
            return
        costs = self.costs(1)
        if costs is not None:
            self.call_overhead.observe(stats, costs.t_draft)

    def draft_unobserved(self) -> bool:
        """Whether no live draft forward has been seen (then a draft calibration that is too
        high would keep ``auto`` from ever drafting, and so from ever correcting it)."""
        return not any(seconds > 0 for seconds in self.live_costs()[1])

    def live_costs(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The target's and the draft's observed forward seconds by rows (their ``Info``'s
        ``live_forward_s``), read at most every :data:`LIVE_REFRESH_S`; the last ones read
        when a service cannot be reached."""
        with self._lock:
            if time.monotonic() - self._live_read_at < LIVE_REFRESH_S:
                return self._live
            self._live_read_at = time.monotonic()
        try:
            live = (tuple(self.describe("target").live_forward_s), tuple(self.describe("draft").live_forward_s))
        except DiscoError:
            return self._live
        with self._lock:
            self._live = live
        return live

    def calibrated_costs(self) -> CostModel | None:
        """The deployment's calibrated cost model: the draft's and the target's measured
        forward costs at start (from their ``Info``) and the round trip of a call, measured
        here (median of 3 ``Info`` calls minus their server time). Cached once known;
        ``None`` while a service reports no costs or cannot be reached."""
        with self._lock:
            if self._costs is not None or time.monotonic() < self._costs_retry_at:
                return self._costs
            self._costs_retry_at = time.monotonic() + COSTS_RETRY_S
        try:
            draft = self.describe("draft")
            trips = []
            for _ in range(3):
                started = time.perf_counter()
                target = self.describe("target")
                trips.append(max(0.0, time.perf_counter() - started - target.elapsed_ns / 1e9))
        except DiscoError:
            return None
        if not draft.forward_s or not target.forward_s:
            return None
        costs = CostModel.from_forward_costs(draft.forward_s, target.forward_s, statistics.median(trips),
                                             source=f"measured by the services ({target.dtype})",
                                             draft_prefill_s_per_token=draft.prefill_s_per_token,
                                             draft_prefill_window=draft.prefill_window)
        with self._lock:
            self._costs = costs
        return costs

    def check_draft(self) -> None:
        """Check once that the draft shares the target's tokenizer.

        Raises:
            Unavailable: the draft cannot be reached.
            VocabularyMismatch: its tokenizer differs.
        """
        with self._lock:
            if self._draft_checked:
                return
            info = self.describe("draft")
            if info.tokenizer_hash != self.tokenizer_hash:
                raise VocabularyMismatch(
                    f"the draft service at {self.draft_address} serves {info.model_name!r}, which does not share "
                    "the target's tokenizer; speculative decoding needs one vocabulary")
            self._draft_checked = True

    def close(self) -> None:
        self.draft.close()
        self.target.close()
