"""``disco.v1.DraftService``: validate → convert → :class:`DraftEngine` → convert back.

Sessions are keyed by (authenticated caller, session id) (:func:`protos.runtime.auth.session_key`):
a session belongs to the caller that started it.

Domain errors raised by the engine become status codes in
:class:`protos.runtime.server.ErrorInterceptor`; nothing here catches them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import grpc

from disco.engines.draft import DraftEngine
from disco.engines.packed_forward import describe_forward
from disco.engines.packing_proof import exactness_for
from disco.engines.sessions import SessionLimits
from disco.engines.static_proof import serving_exactness
from disco.interfaces import DraftEvent, DraftSummary
from disco.models.loading import LoadedModel
from draft_service.run_ahead import run_ahead
from protos import convert
from protos.disco.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from protos.runtime.auth import caller_of, session_key
from protos.runtime.metrics import ServerMetrics

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Thin translation layer over one draft engine."""

    def __init__(self, engine: DraftEngine, loaded: LoadedModel, limits: SessionLimits,
                 max_prompt_tokens: int | None = None, metrics: ServerMetrics | None = None,
                 forward_s: Sequence[float] = (), security: str = "", prefill_s_per_token: float = 0.0) -> None:
        self.engine = engine
        self.loaded = loaded
        self.forward_s = tuple(forward_s)  # measured forward costs, reported by Info
        self.prefill_s_per_token = prefill_s_per_token  # measured prefill per prompt token, reported by Info
        self.security = security  # how callers are authenticated (BackendSecurity.statement), reported by Info
        self.limits = limits
        self.max_prompt_tokens = max_prompt_tokens  # applies to re-prefills too (prompt + tokens so far)
        self.metrics = metrics or ServerMetrics("draft", loaded.name)
        self.metrics.track_sessions(engine.active_sessions, limits.max_sessions)
        self.metrics.track_kv(*engine.kv_memory())
        # Proven when the engine's batcher started (kept on the model): stated in Info and /metrics.
        self.exactness = serving_exactness(exactness_for(loaded.model), engine.static)
        self.metrics.describe_exactness(self.exactness.proven, self.exactness.statement)
        self.forward = describe_forward(loaded.model)  # what runs its forwards: Info and /metrics
        if engine.static is not None:  # slotted sessions step through the static path's own loop
            self.forward += "; slotted sessions: the static step (its Python layer loop; Info.batching)"
        self.metrics.describe_forward(self.forward)
        self.metrics.track_overlap()
        # Draft streams draft on these threads, ahead of the gRPC thread sending each token.
        self.drafting_threads = ThreadPoolExecutor(max_workers=limits.max_sessions + 1,
                                                   thread_name_prefix="drafting")

    def StartSession(self, request: draft_pb2.StartDraftSessionRequest,
                     context: grpc.ServicerContext) -> common_pb2.StartSessionResponse:
        convert.check_prompt_length(len(request.prompt_ids), self.max_prompt_tokens, "the draft service")
        convert.check_token_ids(request.prompt_ids, self.loaded.vocab_size, "prompt_ids")
        convert.check_token_ids(request.reference_ids, self.loaded.vocab_size, "reference_ids")
        result = self.engine.start_session(
            session_key(caller_of(context), request.session_id), list(request.prompt_ids), convert.sampling_from_pb(request.sampling),
            request.policy, list(request.reference_ids) or None,
            overlap=request.overlap if request.HasField("overlap") else None)
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        return convert.prefill_to_pb(result)

    def Draft(self, request: draft_pb2.DraftRequest, context: grpc.ServicerContext) -> Iterator[draft_pb2.DraftEvent]:
        started = time.perf_counter_ns()
        session = session_key(caller_of(context), request.session_id)
        self.engine.sessions.get(session)  # an unknown session first: NOT_FOUND, as without the checks below
        feedback = convert.feedback_from_pb(request.feedback) if request.HasField("feedback") else None
        events = self.engine.draft(session, feedback, request.max_lookahead,
                                   expected_length=convert.expected_length(request))
        # Drafting runs ahead of sending (see run_ahead); a cancelled stream closes the
        # engine's block generator, which releases the session for the next Draft call.
        yield from run_ahead(events, lambda event: self._to_pb(event, started), self.drafting_threads)

    def _to_pb(self, event: DraftEvent, started_ns: int) -> draft_pb2.DraftEvent:
        if isinstance(event, DraftSummary):
            self.metrics.count_overlap(event.overlap_hit, event.overlap_miss, event.predrafted_used,
                                       event.predrafted_wasted)
        return convert.draft_event_to_pb(event, convert.elapsed_ns(started_ns))

    def EndSession(self, request: common_pb2.EndSessionRequest,
                   context: grpc.ServicerContext) -> common_pb2.EndSessionResponse:
        started = time.perf_counter_ns()
        self.engine.end_session(session_key(caller_of(context), request.session_id))
        return common_pb2.EndSessionResponse(elapsed_ns=convert.elapsed_ns(started))

    def close(self) -> None:
        """Let the drafting threads go (called when the server stopped; no call is left)."""
        self.drafting_threads.shutdown(wait=True, cancel_futures=True)

    def Info(self, request: common_pb2.ServiceInfoRequest, context: grpc.ServicerContext) -> common_pb2.ServiceInfo:
        return convert.service_info_pb("draft", self.loaded, self.engine.max_context,
                                       self.engine.active_sessions(), self.limits, time.perf_counter_ns(),
                                       self.forward_s, overlap=self.engine.overlap,
                                       batching=self.engine.batcher.describe(),
                                       live_forward_s=self.engine.batcher.live_costs.seconds_by_rows(),
                                       exactness=self.exactness.statement, security=self.security,
                                       prefill_s_per_token=self.prefill_s_per_token,
                                       prefill_window=self.engine.prefill_window, forward=self.forward)
