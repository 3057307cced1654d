"""``disco.v1.TargetService``: validate → convert → :class:`TargetEngine` → convert back.

Sessions are keyed by (authenticated caller, session id) (:func:`protos.runtime.auth.session_key`):
a session belongs to the caller that started it.

Domain errors raised by the engine become status codes in
:class:`protos.runtime.server.ErrorInterceptor`; nothing here catches them.
"""

from __future__ import annotations

import time
from typing import Sequence

import grpc

from disco.engines.packed_forward import describe_forward
from disco.engines.packing_proof import exactness_for
from disco.engines.sessions import SessionLimits
from disco.engines.static_proof import serving_exactness
from disco.engines.target import TargetEngine
from disco.models.loading import LoadedModel
from protos import convert
from protos.disco.v1 import common_pb2, target_pb2, target_pb2_grpc
from protos.runtime.auth import caller_of, session_key
from protos.runtime.metrics import ServerMetrics

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Thin translation layer over one target engine."""

    def __init__(self, engine: TargetEngine, loaded: LoadedModel, limits: SessionLimits,
                 max_prompt_tokens: int | None = None, metrics: ServerMetrics | None = None,
                 forward_s: Sequence[float] = (), security: str = "", prefill_s_per_token: float = 0.0) -> None:
        self.engine = engine
        self.loaded = loaded
        self.forward_s = tuple(forward_s)  # measured forward costs, reported by Info
        self.prefill_s_per_token = prefill_s_per_token  # measured prefill per prompt token, reported by Info
        self.security = security  # how callers are authenticated (BackendSecurity.statement), reported by Info
        self.limits = limits
        self.max_prompt_tokens = max_prompt_tokens  # applies to re-prefills too (prompt + tokens so far)
        self.metrics = metrics or ServerMetrics("target", loaded.name)
        self.metrics.track_sessions(engine.active_sessions, limits.max_sessions)
        self.metrics.track_kv(*engine.kv_memory())
        # Proven when the engine's batcher started (kept on the model): stated in Info and /metrics.
        self.exactness = serving_exactness(exactness_for(loaded.model), engine.static)
        self.metrics.describe_exactness(self.exactness.proven, self.exactness.statement)
        self.forward = describe_forward(loaded.model)  # what runs its forwards: Info and /metrics
        if engine.static is not None:  # slotted sessions step through the static path's own loop
            self.forward += "; slotted sessions: the static step (its Python layer loop; Info.batching)"
        self.metrics.describe_forward(self.forward)
        self.device = next(loaded.model.parameters()).device

    def StartSession(self, request: target_pb2.StartTargetSessionRequest,
                     context: grpc.ServicerContext) -> common_pb2.StartSessionResponse:
        session = session_key(caller_of(context), request.session_id)
        convert.check_prompt_length(len(request.prompt_ids), self.max_prompt_tokens, "the target service")
        result = self.engine.start_session(session, list(request.prompt_ids),
                                           convert.sampling_from_pb(request.sampling))
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        return convert.prefill_to_pb(result)

    def Verify(self, request: target_pb2.VerifyRequest, context: grpc.ServicerContext) -> target_pb2.VerifyResponse:
        started = time.perf_counter_ns()
        session = session_key(caller_of(context), request.session_id)
        self.engine.sessions.get(session)  # an unknown session costs no decoding
        expected_length = convert.expected_length(request)
        draft_probs = convert.distributions_from_pb(  # [k, vocab] or None; budgets checked first
            request.draft_probs, self.device, num_tokens=len(request.draft_token_ids),
            vocab_size=self.engine.vocab_size)
        verdict = self.engine.verify(session, list(request.draft_token_ids), draft_probs,
                                     expected_length=expected_length)
        return convert.verify_to_pb(verdict, started)

    def EndSession(self, request: common_pb2.EndSessionRequest,
                   context: grpc.ServicerContext) -> common_pb2.EndSessionResponse:
        started = time.perf_counter_ns()
        self.engine.end_session(session_key(caller_of(context), request.session_id))
        return common_pb2.EndSessionResponse(elapsed_ns=convert.elapsed_ns(started))

    def Info(self, request: common_pb2.ServiceInfoRequest, context: grpc.ServicerContext) -> common_pb2.ServiceInfo:
        return convert.service_info_pb("target", self.loaded, self.engine.max_context,
                                       self.engine.active_sessions(), self.limits, time.perf_counter_ns(),
                                       self.forward_s, batching=self.engine.batcher.describe(),
                                       live_forward_s=self.engine.batcher.live_costs.seconds_by_rows(),
                                       exactness=self.exactness.statement, security=self.security,
                                       prefill_s_per_token=self.prefill_s_per_token, forward=self.forward)
