"""Draft engine: per-session draft KV caches and the drafting loop that asks the
session's stop policy after every draft token (DISCO's stop decision lives here)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from disco.config import SamplingParams
from disco.errors import InvalidRequest
from disco.interfaces import DraftEvent, DraftSummary, DraftToken, Feedback, PrefillResult
from disco.batching import ForwardBatcher
from disco.kv import CachedSequence
from disco.policies import Decision, PolicyFactory, StopPolicy
from disco.sampling import logits_to_probs, make_generator
from disco.sessions import SessionLimits, SessionStore
from disco.signals import token_signals


@dataclass
class DraftSession:
    sequence: CachedSequence
    policy: StopPolicy
    sampling: SamplingParams
    generator: torch.Generator | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    block_base: int = 0  # sequence length before the block awaiting feedback
    block_size: int = 0  # draft tokens handed out in that block
    awaiting_feedback: bool = False


class DraftEngine:
    """Implements :class:`disco.interfaces.Drafter` over a local HF causal LM."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy_factory: PolicyFactory,
        limits: SessionLimits = SessionLimits(),
        max_batch: int = 16,
    ) -> None:
        self.model = model
        self.policy_factory = policy_factory
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.sessions: SessionStore[DraftSession] = SessionStore(limits)
        # Concurrent sessions' forwards run as one padded batch (see disco.batching).
        self.batcher = ForwardBatcher(model, max_batch)

    def start_session(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        policy_spec: str,
        reference_ids: Sequence[int] | None = None,
    ) -> PrefillResult:
        started = time.perf_counter_ns()
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens, the draft model's context is {self.max_context}")
        vocab_size = int(self.model.config.vocab_size)
        for name, ids in (("prompt", prompt_ids), ("reference", reference_ids or ())):
            if any(not 0 <= token < vocab_size for token in ids):
                raise InvalidRequest(f"{name} token ids must be in [0, {vocab_size})")
        sampling.validate()
        self.sessions.check_capacity()  # before paying for a prefill
        policy = self.policy_factory.build(policy_spec, reference_ids)
        session = DraftSession(
            sequence=CachedSequence(self.model, prompt_ids),
            policy=policy,
            sampling=sampling,
            generator=make_generator(sampling.seed),
        )
        self.batcher.prefill(session.sequence)  # batched with concurrent prefills
        self.sessions.add(session_id, session)
        return PrefillResult(prompt_tokens=len(prompt_ids), elapsed_ns=time.perf_counter_ns() - started)

    def end_session(self, session_id: str) -> None:
        self.sessions.remove(session_id)

    def draft(self, session_id: str, feedback: Feedback | None, max_lookahead: int) -> Iterator[DraftEvent]:
        session = self.sessions.get(session_id)
        if max_lookahead < 0:
            raise InvalidRequest(f"max_lookahead must be >= 0, got {max_lookahead}")
        return self._draft_block(session, session_id, feedback, max_lookahead)

    def _apply_feedback(self, session: DraftSession, feedback: Feedback | None) -> None:
        """Roll back to the accepted prefix and append the bonus token."""
        if feedback is None:
            if session.awaiting_feedback:
                raise InvalidRequest("feedback of the previous verification is required")
            return
        if not session.awaiting_feedback:
            raise InvalidRequest("feedback given but no draft block is awaiting verification")
        if not 0 <= feedback.num_accepted <= session.block_size:
            raise InvalidRequest(
                f"feedback accepts {feedback.num_accepted} tokens of a block of {session.block_size}")
        if not 0 <= feedback.bonus_token_id < session.sequence.model.config.vocab_size:
            raise InvalidRequest(f"bonus token id {feedback.bonus_token_id} is outside the vocabulary")
        session.sequence.truncate(session.block_base + feedback.num_accepted)
        session.sequence.tokens.append(feedback.bonus_token_id)
        session.policy.on_feedback(session.block_size, feedback.num_accepted)
        session.awaiting_feedback = False

    def _draft_block(self, session: DraftSession, session_id: str, feedback: Feedback | None,
                     max_lookahead: int) -> Iterator[DraftEvent]:
        """The drafting loop. The session lock is taken when iteration starts (so a
        generator that is dropped unstarted holds nothing) and released when it ends."""
        started = time.perf_counter_ns()
        if not session.lock.acquire(blocking=False):
            raise InvalidRequest(f"session {session_id!r} is already drafting")
        try:
            self._apply_feedback(session, feedback)
            sequence, policy = session.sequence, session.policy
            session.block_base, session.block_size, session.awaiting_feedback = len(sequence), 0, True
            room = self.max_context - len(sequence)
            budget = max(0, min(max_lookahead, policy.begin_block(max_lookahead), room))
            forwards, stop_reason = 0, "lookahead_cap"
            for position in range(budget):
                logits, hidden = self.batcher.forward(sequence, 1, want_hidden=policy.needs_hidden)
                forwards += 1
                signals = None
                if policy.needs_signals:  # one softmax serves both the signals and the token's probability
                    token = self._choose(session, logits[0], want_prob=False)
                    signals = token_signals(logits[0], token.token_id, hidden[0] if hidden is not None else None)
                    if session.sampling.is_greedy:
                        token = DraftToken(token_id=token.token_id, draft_prob=signals.token_prob)
                else:
                    token = self._choose(session, logits[0])
                decision = policy.after_token(position, token.token_id, signals)
                if decision is Decision.DISCARD:
                    stop_reason = "discarded"
                    break
                sequence.tokens.append(token.token_id)
                session.block_size += 1
                yield token
                if decision is Decision.STOP:
                    stop_reason = "policy"
                    break
            yield DraftSummary(forwards=forwards, elapsed_ns=time.perf_counter_ns() - started,
                               stop_reason=stop_reason)
        finally:
            session.lock.release()

    @staticmethod
    def _choose(session: DraftSession, logits: torch.Tensor,  # logits: [vocab]
                want_prob: bool = True) -> DraftToken:
        """Greedy: the argmax (its probability only if ``want_prob``; the caller may take it
        from the signals instead). Sampling: a token from the warped distribution."""
        if session.sampling.is_greedy:
            token_id = int(logits.argmax())
            prob = float(torch.softmax(logits, -1)[token_id]) if want_prob else float("nan")
            return DraftToken(token_id=token_id, draft_prob=prob)
        draft_probs = logits_to_probs(logits, session.sampling)  # [vocab]
        token_id = int(torch.multinomial(draft_probs, 1, generator=session.generator).item())
        return DraftToken(token_id=token_id, draft_prob=float(draft_probs[token_id]), draft_probs=draft_probs)

    def active_sessions(self) -> int:
        return len(self.sessions)
