"""``disco.v1.Orchestrator``: the public API.

Per request: parse the message, check the prompt's size (:mod:`orchestrator.prompts`),
tokenize, then run the one speculation loop
(:class:`~disco.speculation.loop.SpeculativeGenerator`) with :class:`~orchestrator.remote.RemoteDrafter`
and :class:`~orchestrator.remote.RemoteVerifier` bound to this call's deadline and
cancellation, and translate its events back to messages. Domain errors become status
codes in :class:`protos.runtime.server.ErrorInterceptor`.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
from transformers import PreTrainedTokenizerBase

import disco
from disco.config import DEFAULT_MAX_LOOKAHEAD, MAX_LOOKAHEAD_LIMIT, SamplingParams, SpeculationConfig
from disco.engines.in_process import encode_conversation, encode_prompt
from disco.errors import DiscoError, InvalidRequest, ResourceExhausted
from disco.interfaces import TokenLogprobs
from disco.speculation.loop import GenerationEvent, GenerationResult, SpeculativeGenerator, TokenChunk
from disco.speculation.policies import POLICY_INFOS, parse_policy_spec, reads_costs
from orchestrator.backends import Backends
from orchestrator.degrade import DegradingDrafter, UnreachableDrafter, draft_check
from orchestrator.failover import FailoverDrafter, FailoverVerifier
from orchestrator.logprobs import logprobs_to_pb, prompt_logprobs_to_pb
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.prompts import (MIN_PROMPT_BYTES, Tokenizers, check_fits_context, check_prompt_bytes,
                                  conversation_bytes, conversation_from_pb, default_prompt_byte_limit, prompt_bytes)
from orchestrator.remote import DEFAULT_CALL_TIMEOUT_S, CallScope
from protos import convert
from protos.disco.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from protos.stats import stats_to_pb

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
DEFAULT_POLICY = SpeculationConfig().policy
#: Policies that only make sense in process (they need the target's output up front).
IN_PROCESS_ONLY = ("oracle",)
_NO_DEADLINE_S = 1e8  # time_remaining() of a call without a deadline is effectively infinite
INFO_TIMEOUT_S = 2.0  # Info answers even when a backend is black-holed


@dataclass(frozen=True)
class OrchestratorLimits:
    max_new_tokens: int = 4096  # largest max_new_tokens a request may ask for
    max_sessions: int = 64  # concurrent Generate calls; more get RESOURCE_EXHAUSTED
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S  # cap on one backend call
    max_prompt_tokens: int = 0  # longest prompt in tokens; 0: the target's context is the only limit
    #: Largest prompt in UTF-8 bytes (a conversation: its contents), checked before tokenizing;
    #: 0: 8 bytes per token of max_prompt_tokens or else of the target's context, within
    #: [64 KiB, 8 MiB] (orchestrator.prompts).
    max_prompt_bytes: int = 0


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Runs each request through the speculation loop against the draft and target services."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, backends: Backends,
                 limits: OrchestratorLimits = OrchestratorLimits(), metrics: OrchestratorMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.backends = backends
        self.limits = limits
        self.metrics = metrics or OrchestratorMetrics(tokenizer.name_or_path)
        self.metrics.track_sessions(lambda: self._active, limits.max_sessions)
        self._tokenizers = Tokenizers(tokenizer)  # encoding and decoding never wait for each other
        self._active = 0
        self._admissions = 0  # requests admitted since start: a request served alone saw no other
        self._active_lock = threading.Lock()

    @property
    def active_sessions(self) -> int:
        return self._active

    def Generate(self, request: orchestrator_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[orchestrator_pb2.GenerateResponse]:
        started = time.perf_counter_ns()
        prompt_ids, sampling, speculation = self._parse(request)
        prompt_fields: dict[str, Any] | None = None  # the prompt's logprobs and text: first chunk and result
        for event in self._generate(prompt_ids, sampling, speculation, context):
            first = prompt_fields is None
            if first:
                prompt_fields = self._prompt_fields(request, prompt_ids, sampling, event.prompt_logprobs)
            if isinstance(event, TokenChunk):
                chunk = orchestrator_pb2.GenerateChunk(
                    token_ids=event.token_ids, text=event.text, elapsed_ns=convert.elapsed_ns(started),
                    logprobs=self._logprobs_pb(event.token_ids, event.logprobs, sampling),
                    **(prompt_fields if first else {}))
                yield orchestrator_pb2.GenerateResponse(chunk=chunk)
            else:
                yield orchestrator_pb2.GenerateResponse(result=self._result_pb(event, started, sampling, prompt_fields))

    def GenerateUnary(self, request: orchestrator_pb2.GenerateRequest,
                      context: grpc.ServicerContext) -> orchestrator_pb2.GenerateResult:
        started = time.perf_counter_ns()
        prompt_ids, sampling, speculation = self._parse(request)
        result = list(self._generate(prompt_ids, sampling, speculation, context))[-1]
        assert isinstance(result, GenerationResult)
        prompt_fields = self._prompt_fields(request, prompt_ids, sampling, result.prompt_logprobs)
        return self._result_pb(result, started, sampling, prompt_fields)

    def _result_pb(self, result: GenerationResult, started_ns: int, sampling: SamplingParams,
                   prompt_fields: dict[str, Any] | None) -> orchestrator_pb2.GenerateResult:
        return orchestrator_pb2.GenerateResult(
            token_ids=result.token_ids, text=result.text, finish_reason=result.finish_reason,
            stats=stats_to_pb(result.stats), elapsed_ns=convert.elapsed_ns(started_ns),
            logprobs=self._logprobs_pb(result.token_ids, result.logprobs, sampling), **(prompt_fields or {}))

    def _logprobs_pb(self, token_ids: list[int], entries: tuple[TokenLogprobs, ...],
                     sampling: SamplingParams) -> list[orchestrator_pb2.TokenLogprob]:
        """The generated tokens' logprobs with their texts (asked: ``sampling.logprobs``)."""
        if sampling.logprobs is None:
            return []
        return logprobs_to_pb(token_ids, entries, self._tokenizers.token_texts)

    def _prompt_fields(self, request: orchestrator_pb2.GenerateRequest, prompt_ids: list[int],
                       sampling: SamplingParams, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
        """What the first chunk and the result say about the prompt: its logprobs (asked:
        ``sampling.prompt_logprobs``) and, with ``echo``, its text (as given, or decoded)."""
        fields: dict[str, Any] = {}
        if sampling.prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs_to_pb(prompt_ids, entries, self._tokenizers.token_texts)
        if request.echo:
            as_text = not request.prompt_ids and not request.messages and not request.chat
            fields["prompt_text"] = request.prompt if as_text else self._tokenizers.render(prompt_ids)
        return fields

    def Info(self, request: orchestrator_pb2.InfoRequest,
             context: grpc.ServicerContext) -> orchestrator_pb2.InfoResponse:
        started = time.perf_counter_ns()
        response = orchestrator_pb2.InfoResponse(
            version=disco.__version__, draft_address=self.backends.draft_address,
            target_address=self.backends.target_address,
            policies=[orchestrator_pb2.PolicyInfo(name=p.name, syntax=p.syntax, description=p.description)
                      for p in POLICY_INFOS if p.name not in IN_PROCESS_ONLY])
        response.active_sessions.orchestrator = self._active
        for role in ("draft", "target"):
            try:
                getattr(response, role).CopyFrom(self.backends.describe(role, timeout=INFO_TIMEOUT_S))
                setattr(response.active_sessions, role, getattr(response, role).active_sessions)
            except DiscoError as error:
                setattr(response.active_sessions, role, -1)
                response.errors.append(f"{role}: {error}")
        response.limits.CopyFrom(orchestrator_pb2.Limits(
            max_new_tokens=self.limits.max_new_tokens, max_lookahead=MAX_LOOKAHEAD_LIMIT,
            max_sessions=self.limits.max_sessions, max_context=response.target.max_context,
            max_prompt_tokens=self.limits.max_prompt_tokens))
        response.elapsed_ns = convert.elapsed_ns(started)
        return response

    def _generate(self, prompt_ids: list[int], sampling: SamplingParams, speculation: SpeculationConfig,
                  context: grpc.ServicerContext) -> Iterator[GenerationEvent]:
        """The loop's events for one request (as :meth:`_parse` gives it), run against both backends."""
        with self._admitted():
            target = self.backends.target_info()
            check_fits_context(len(prompt_ids), sampling.max_new_tokens, target.max_context)
            sampling.check_token_ids(target.vocab_size)  # the controls' token ids, before any work
            draft_down = draft_check(self.backends, speculation.policy)  # down: serve target-only
            remaining = context.time_remaining()
            scope = CallScope(None if remaining is None or remaining > _NO_DEADLINE_S
                              else time.monotonic() + remaining, self.limits.call_timeout_s)
            context.add_callback(scope.cancel)  # client cancel or deadline: stop the backend calls
            sticky_drafter, verifier = self.backends.session(scope)  # sticky replicas, re-prefilled on failure
            drafter = UnreachableDrafter(draft_down) if draft_down else DegradingDrafter(sticky_drafter)
            costs = self.backends.costs(self._active) if reads_costs(speculation.policy) else None
            generator = SpeculativeGenerator(drafter, verifier, self._tokenizers.decode, target.eos_token_ids,
                                             self.limits.max_new_tokens, costs=costs,
                                             parallel_prefill=True,  # the services have their own devices
                                             explore_draft=costs is not None and not draft_down
                                             and self.backends.draft_unobserved(),
                                             costs_now=None if costs is None else
                                             lambda: self.backends.costs(self._active),
                                             encode=self._encode_words)
            events = generator.stream(prompt_ids, sampling, speculation)
            yield from self.metrics.observe(self._observing_calls(
                _with_failovers(events, sticky_drafter, verifier), self._admissions))

    def _observing_calls(self, events: Iterator[GenerationEvent], admissions: int) -> Iterator[GenerationEvent]:
        """Pass ``events`` on; a request served alone (no other admitted from its admission,
        ``admissions``, to its end) adds its calls to the observed call overhead
        (:mod:`orchestrator.call_overhead`), once its result has been handed on (reading the
        draft's live cost may take an ``Info`` call: not on the response's path)."""
        for event in events:
            alone = self._admissions == admissions and self._active == 1
            yield event
            if isinstance(event, GenerationResult) and alone:
                self.backends.observe_calls(event.stats)

    def _parse(self, request: orchestrator_pb2.GenerateRequest) -> tuple[list[int], SamplingParams, SpeculationConfig]:
        speculation = SpeculationConfig(
            policy=request.policy or DEFAULT_POLICY,
            max_lookahead=request.max_lookahead if request.HasField("max_lookahead") else DEFAULT_MAX_LOOKAHEAD,
            overlap=request.overlap if request.HasField("overlap") else None)
        name = parse_policy_spec(speculation.policy).name
        if name in IN_PROCESS_ONLY:
            raise InvalidRequest(f"policy {name!r} is for analysis in process only (`disco generate` without "
                                 "--server); it is not served over gRPC")
        sampling = convert.sampling_from_pb(request.sampling)
        if sampling.eos_token_ids or sampling.resumed_tokens:
            raise InvalidRequest("sampling.eos_token_ids and sampling.resumed_tokens are set by the orchestrator for "
                                 "its backends; a request must leave them unset")
        # Validated here too (the loop does it again) so that a bad request is refused
        # with INVALID_ARGUMENT even while a backend is down.
        sampling.validate(self.limits.max_new_tokens)
        speculation.validate()
        if request.prompt_ids:
            prompt_ids = list(request.prompt_ids)
        else:
            if (request.tools_json or request.continue_final_message) and not request.messages:
                raise InvalidRequest("tools_json and continue_final_message need messages")
            size = (conversation_bytes(request.messages, request.tools_json) if request.messages
                    else prompt_bytes(request.prompt))
            check_prompt_bytes(size, self._prompt_byte_limit(size))
            conversation, tools = conversation_from_pb(request.messages, request.tools_json)
            with self._tokenizers.encoder(size) as tokenizer:
                prompt_ids = (encode_conversation(tokenizer, conversation, tools, request.continue_final_message)
                              if conversation else encode_prompt(tokenizer, request.prompt, request.chat))
        convert.check_prompt_length(len(prompt_ids), self.limits.max_prompt_tokens)
        sampling.check_logprob_entries(len(prompt_ids))
        return prompt_ids, sampling, speculation

    def _encode_words(self, text: str) -> list[int]:
        """A short text's token ids without special tokens (a request's bad words)."""
        with self._tokenizers.encoder(len(text.encode())) as tokenizer:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt_byte_limit(self, size: int) -> int:
        """The byte limit a prompt of ``size`` bytes is held to (the target is asked for its
        context only when the prompt is above the floor that every context gets).

        Raises:
            Unavailable: the target's context is needed and the target cannot be reached.
        """
        if self.limits.max_prompt_bytes:
            return self.limits.max_prompt_bytes
        if size <= MIN_PROMPT_BYTES:
            return MIN_PROMPT_BYTES
        return default_prompt_byte_limit(self.limits.max_prompt_tokens or self.backends.target_info().max_context)

    @contextmanager
    def _admitted(self) -> Iterator[None]:
        with self._active_lock:
            if self._active >= self.limits.max_sessions:
                raise ResourceExhausted(
                    f"too many concurrent requests ({self.limits.max_sessions}); retry later")
            self._active += 1
            self._admissions += 1
        try:
            yield
        finally:
            with self._active_lock:
                self._active -= 1


def _with_failovers(events: Iterator[GenerationEvent], drafter: FailoverDrafter,
                    verifier: FailoverVerifier) -> Iterator[GenerationEvent]:
    """Add the re-prefills done below the loop (a session moved off a failed replica) to
    the request's stats; the loop counts only the ones it did itself."""
    for event in events:
        if isinstance(event, GenerationResult):
            event.stats.target_reprefills += verifier.failovers
            event.stats.draft_reprefills += drafter.failovers
        yield event

