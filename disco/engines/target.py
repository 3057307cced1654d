"""Target engine: per-session target KV caches, prefill and block verification.

A session is admitted by count and by KV bytes (:mod:`disco.engines.sessions`): prompt +
``max_new_tokens`` reserved before the prefill, the reservation grown when a verification
block would take the cache past it. A verification reads one tensor back to the host (the
target's token at each position of the block: :func:`greedy_accept`, :func:`invariant_verify`).
Sampled sessions verify by drafter-invariant speculative sampling: the target's token at
absolute position ``i`` is its Gumbel-max sample under the noise of ``(seed, i)``, so the text
depends on the seed and the target alone (see :mod:`disco.speculation.sampling`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from disco.config import SamplingParams
from disco.engines.batching import DEFAULT_MAX_BATCH, ForwardBatcher
from disco.engines.device_clock import now_ns
from disco.engines.kv import CachedSequence
from disco.engines.kv_pool import KVPool
from disco.engines.sessions import KvBudget, SessionLimits, SessionStore
from disco.engines.static_runner import static_runner_for
from disco.errors import InvalidRequest, SessionMismatch
from disco.interfaces import PrefillResult, TokenLogprobs, VerifyResult
from disco.speculation.logprobs import prompt_logprobs, raw_logprobs, select_logprobs
from disco.speculation.grammar import GrammarCompiler, GrammarState, session_grammar
from disco.speculation.logits_processors import apply_logits_controls
from disco.speculation.sampling import greedy_accept, invariant_verify, logits_to_probs


@dataclass
class TargetSession:
    sequence: CachedSequence
    sampling: SamplingParams  # seeded when sampling (a random seed if the caller gave none)
    lock: threading.Lock = field(default_factory=threading.Lock)
    output_start: int = 0  # index of the first output token in sequence.tokens (the sampling controls count from it)
    grammar: GrammarState | None = None  # the structured output's matcher, when the request has one


class TargetEngine:
    """Implements :class:`disco.interfaces.Verifier` over a local HF causal LM."""

    def __init__(self, model: torch.nn.Module, limits: SessionLimits = SessionLimits(),
                 max_batch: int = DEFAULT_MAX_BATCH, grammar: GrammarCompiler | None = None) -> None:
        """``grammar``: the model's tokenizer for structured outputs (``None``: refused)."""
        self.model = model
        self.grammar = grammar
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.device = next(model.parameters()).device
        # The static path's caches and graphs first: on a GPU the derived KV budget then sees them.
        self.static = static_runner_for(model, limits.static_slots, limits.static_capacity, "target")
        kv = KvBudget.for_model(model, limits, "target")  # after the model is loaded: the derived budget sees it
        self.sessions: SessionStore[TargetSession] = SessionStore(limits, kv=kv)
        # Concurrent sessions' forwards run as one padded batch (see disco.engines.batching).
        self.batcher = ForwardBatcher(model, max_batch, static=self.static)

    def start_session(
        self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> PrefillResult:
        started = now_ns(self.device)
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        sampling.validate()
        sampling.check_logprob_entries(len(prompt_ids))
        sampling.check_token_ids(self.vocab_size)
        if sampling.resumed_tokens >= len(prompt_ids):
            raise InvalidRequest(f"resumed_tokens ({sampling.resumed_tokens}) must be less than the prompt's "
                                 f"{len(prompt_ids)} tokens")
        if len(prompt_ids) + sampling.max_new_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds the target model's context of {self.max_context} tokens")
        if any(not 0 <= token < self.vocab_size for token in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})")
        grammar = session_grammar(self.grammar, sampling.structured)  # an invalid one refused before work
        # Admitted (count and KV bytes of every token it can reach) before paying for a prefill.
        reserved = min(self.max_context, len(prompt_ids) + sampling.max_new_tokens)
        with self.sessions.admitting(session_id, reserved):
            # The cache is preallocated for what was reserved (its buffers then never move).
            sequence = CachedSequence(self.model, prompt_ids, capacity=reserved + 1)
            if self.static is not None:
                self.static.acquire(sequence, reserved + 1)  # a slot when one is free (else the packed path)
            session = TargetSession(sequence=sequence, sampling=sampling.seeded(),
                                    output_start=len(prompt_ids) - sampling.resumed_tokens, grammar=grammar)
            prompt_entries: list[TokenLogprobs] = []
            if sampling.prompt_logprobs is None:
                self.batcher.prefill(session.sequence)  # batched with concurrent prefills
            else:
                prompt_entries = self._scored_prefill(session.sequence, sampling.prompt_logprobs)
            self.sessions.add(session_id, session)
        return PrefillResult(prompt_tokens=len(prompt_ids), elapsed_ns=now_ns(self.device) - started,
                             prompt_logprobs=tuple(prompt_entries))

    def _scored_prefill(self, sequence: CachedSequence, top_n: int) -> list[TokenLogprobs]:
        """The prefill of a session that asked for its prompt's log-probabilities: the same
        forward as a plain prefill (the cache gets the same values), keeping every position's
        hidden states, then the LM head over them in chunks (:func:`prompt_logprobs`).
        NOTE: alone, not batched with concurrent prefills (prompt scoring is rare); the LM head
        runs under the model lock too, as every other use of the model does."""
        with self.batcher.model_lock:
            hidden = sequence.prefill_hidden()  # [n - 1, hidden]
            return prompt_logprobs(self.model.get_output_embeddings(), hidden, sequence.tokens, top_n,
                                   self.vocab_size)

    def end_session(self, session_id: str) -> None:
        self.sessions.remove(session_id)

    def verify(
        self,
        session_id: str,
        draft_token_ids: Sequence[int],
        draft_probs: torch.Tensor | None = None,  # [k, vocab] or None: not read (drafter-invariant rule)
        expected_length: int | None = None,
    ) -> VerifyResult:
        """:meth:`disco.interfaces.Verifier.verify`; ``expected_length``: the caller's committed
        length of the session (the gRPC path always sends it): another length is refused
        (:class:`SessionMismatch`) before anything changes.

        ``draft_probs`` are accepted from callers that still send them (an older
        orchestrator) and ignored: sampled blocks are verified by comparing token ids with
        the target's own seeded samples (:func:`invariant_verify`)."""
        started = now_ns(self.device)
        session = self.sessions.get(session_id)
        draft_token_ids = list(draft_token_ids)
        num_draft = len(draft_token_ids)
        if any(not 0 <= token < self.vocab_size for token in draft_token_ids):
            raise InvalidRequest(f"draft token ids must be in [0, {self.vocab_size})")
        if not session.lock.acquire(blocking=False):
            raise InvalidRequest(f"session {session_id!r} is already verifying")
        try:
            sequence = session.sequence
            if expected_length is not None and len(sequence) != expected_length:
                raise SessionMismatch(f"session holds {len(sequence)} tokens, the call expects {expected_length}")
            if len(sequence) + num_draft + 1 > self.max_context:
                raise InvalidRequest("block would exceed the target model's context")
            base = len(sequence)
            self.sessions.grow(session_id, base + num_draft)  # the KV this block adds, admitted
            sequence.tokens.extend(draft_token_ids)
            forward_started = now_ns(self.device)
            try:
                target_logits, _ = self.batcher.forward(sequence, num_draft + 1)  # [k + 1, vocab]
            except BaseException:
                sequence.truncate(base)  # a failed forward leaves the session as it was
                raise
            forward_ns = now_ns(self.device) - forward_started
            # Asked only: the raw log-probabilities, taken before anything processes the logits.
            target_logprobs = (raw_logprobs(target_logits) if session.sampling.logprobs is not None
                               else None)  # [k + 1, vocab]
            # The sampling controls: row j with its own history tokens[:base + j], as decoding has it.
            target_logits = apply_logits_controls(target_logits, session.sampling, sequence.tokens, base,
                                                  session.output_start, session.grammar)  # [k + 1, vocab]
            if session.sampling.is_greedy:
                num_accepted, bonus = greedy_accept(draft_token_ids, target_logits)
            else:
                target_probs = logits_to_probs(target_logits, session.sampling)  # [k + 1, vocab]
                # Row j is the target's distribution at absolute position base + j.
                num_accepted, bonus = invariant_verify(draft_token_ids, target_probs, session.sampling.seed, base)
            sequence.truncate(base + num_accepted)
            sequence.tokens.append(bonus)
            # Row j is the distribution of the token emitted at base + j (accepted ones, then the next).
            logprobs = () if target_logprobs is None else tuple(select_logprobs(
                target_logprobs[:num_accepted + 1], draft_token_ids[:num_accepted] + [bonus],
                session.sampling.logprobs or 0))
        finally:
            session.lock.release()
        return VerifyResult(num_accepted=num_accepted, next_token_id=bonus, forward_ns=forward_ns,
                            elapsed_ns=now_ns(self.device) - started, logprobs=logprobs)

    def active_sessions(self) -> int:
        return len(self.sessions)

    def kv_memory(self) -> tuple[int, Callable[[], int], Callable[[], int]]:
        """The KV budget in bytes, and readers of the bytes sessions reserved and of those the
        model's KV pool holds (``/metrics``)."""
        pool = KVPool.of(self.model)
        return self.sessions.kv.budget_bytes, lambda: self.sessions.kv_bytes_in_use, lambda: pool.nbytes
