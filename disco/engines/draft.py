"""Draft engine: per-session draft KV caches and the drafting loop that asks the
session's stop policy after every draft token (DISCO's stop decision lives here).

With ``overlap=True`` the engine drafts the next block in the background while the target
verifies the last one, on the guess that the whole block is accepted (see
:mod:`disco.engines.predraft`); the next ``draft`` call uses it on a hit and drops it on a miss.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from disco.config import MIN_PREFILL_WINDOW, SamplingParams
from disco.engines.batching import DEFAULT_MAX_BATCH, ForwardBatcher
from disco.engines.device_clock import now_ns
from disco.engines.kv import CachedSequence, prefill_window_skip
from disco.engines.kv_pool import KVPool
from disco.engines.predraft import Predraft, can_predraft
from disco.engines.sessions import KvBudget, SessionLimits, SessionStore
from disco.engines.static_runner import static_runner_for
from disco.errors import InvalidRequest, ModelError, SessionMismatch, SessionNotFound
from disco.interfaces import DraftEvent, DraftSummary, DraftToken, Feedback, PrefillResult
from disco.models.vocab_subset import VocabSubsetHead
from disco.speculation.policies import Decision, PolicyFactory, StopPolicy, block_budget
from disco.speculation.grammar import GrammarCompiler, GrammarState, session_grammar
from disco.speculation.logits_processors import apply_logits_controls
from disco.speculation.sampling import gumbel_sample, logits_to_probs, to_host
from disco.speculation.signals import NUM_SIGNAL_VALUES, TokenSignals, signal_values, signals_from_values


#: Token ids move to the host as float32 values (see :meth:`DraftEngine._step`): exact up to 2**24.
_EXACT_FLOAT32_INTS = 1 << 24


@dataclass
class DraftSession:
    sequence: CachedSequence
    policy: StopPolicy
    sampling: SamplingParams  # seeded when sampling (a random seed if the caller gave none)
    lock: threading.Lock = field(default_factory=threading.Lock)
    block_base: int = 0  # sequence length before the block awaiting feedback
    block_size: int = 0  # draft tokens handed out in that block
    awaiting_feedback: bool = False
    overlap: bool = False  # pre-draft the next block while this one is verified
    predraft: Predraft | None = None  # the next block, drafted in the background (overlap)
    closed: bool = False  # ended: no pre-draft may start any more
    predraft_guard: threading.Lock = field(default_factory=threading.Lock)  # predraft/closed vs end_session
    session_id: str = ""  # its key in the engine's store (KV reservations grow by it)
    output_start: int = 0  # index of the first output token in sequence.tokens (the sampling controls count from it)
    grammar: GrammarState | None = None  # the structured output's matcher, when the request has one


@dataclass
class _BlockStart:
    """How a block begins once the feedback is applied: on an overlap hit, with the
    pre-drafted tokens (already in the sequence)."""

    budget: int  # lookahead budget of the block
    tokens: list[DraftToken] = field(default_factory=list)  # pre-drafted tokens to stream first
    stop_reason: str | None = None  # set when the pre-draft already ended the block
    forwards: int = 0  # background forwards consumed by this call (used or wasted)
    hit: bool = False
    miss: bool = False
    wasted: int = 0  # pre-drafted tokens dropped


class DraftEngine:
    """Implements :class:`disco.interfaces.Drafter` over a local HF causal LM."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy_factory: PolicyFactory,
        limits: SessionLimits = SessionLimits(),
        max_batch: int = DEFAULT_MAX_BATCH,
        overlap: bool = False,
        grammar: GrammarCompiler | None = None,
        prefill_window: int = 0,
    ) -> None:
        """``overlap``: pre-draft the next block while the last one is verified (the
        default of sessions whose request does not say); ``grammar``: the model's tokenizer
        for structured outputs (``None``: refused); ``prefill_window``: a session's draft reads
        at most this many prompt tokens, the first :data:`~disco.engines.kv.SINK_TOKENS` and the
        last ones (:func:`~disco.engines.kv.prefill_window_skip`; 0: the whole prompt). The
        target verifies against the whole prompt: the output is unchanged, only acceptance may move."""
        if prefill_window and prefill_window < MIN_PREFILL_WINDOW:
            raise InvalidRequest(f"a draft's prefill window must hold at least {MIN_PREFILL_WINDOW} prompt tokens "
                                 f"(0: the whole prompt), got {prefill_window}")
        self.prefill_window = prefill_window
        self.model = model
        self.grammar = grammar
        self.overlap = overlap
        self.policy_factory = policy_factory
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.device = next(model.parameters()).device
        if int(model.config.vocab_size) > _EXACT_FLOAT32_INTS:
            raise ModelError(f"a vocabulary of {model.config.vocab_size} tokens: draft token ids travel to the host "
                             f"as float32, exact up to {_EXACT_FLOAT32_INTS}")
        # The static path's caches and graphs first: on a GPU the derived KV budget then sees them.
        self.static = static_runner_for(model, limits.static_slots, limits.static_capacity, "draft")
        self.sessions: SessionStore[DraftSession] = SessionStore(limits, kv=KvBudget.for_model(model, limits, "draft"))
        # Concurrent sessions' forwards run as one padded batch (see disco.engines.batching).
        self.batcher = ForwardBatcher(model, max_batch, static=self.static)
        # A head over a vocabulary subset (disco.models.vocab_subset): its logits are -inf elsewhere.
        self.vocab_subset = isinstance(model.get_output_embeddings(), VocabSubsetHead)

    def start_session(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        policy_spec: str,
        reference_ids: Sequence[int] | None = None,
        overlap: bool | None = None,
    ) -> PrefillResult:
        started = now_ns(self.device)
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
        sampling.check_token_ids(vocab_size)
        if sampling.resumed_tokens >= len(prompt_ids):
            raise InvalidRequest(f"resumed_tokens ({sampling.resumed_tokens}) must be less than the prompt's "
                                 f"{len(prompt_ids)} tokens")
        grammar = session_grammar(self.grammar, sampling.structured)  # an invalid one refused before work
        self.sessions.check_capacity()  # before building the policy (it may load an artifact)
        policy = self.policy_factory.build(policy_spec, reference_ids)
        policy.bind_sampling(0.0 if sampling.is_greedy else sampling.temperature)
        skipped = prefill_window_skip(len(prompt_ids), self.prefill_window)
        # Admitted (count and KV bytes of every position it can reach) before paying for a prefill.
        reserved = min(self.max_context, len(prompt_ids) - len(skipped) + sampling.max_new_tokens)
        with self.sessions.admitting(session_id, reserved):
            # The cache is preallocated for what was reserved (its buffers then never move).
            sequence = CachedSequence(self.model, prompt_ids, capacity=reserved + 1, skipped=skipped)
            if self.static is not None:
                self.static.acquire(sequence, reserved + 1)  # a slot when one is free (else the packed path)
            session = DraftSession(
                sequence=sequence,
                policy=policy,
                sampling=sampling.seeded(),
                overlap=self.overlap if overlap is None else overlap,
                session_id=session_id,
                output_start=len(prompt_ids) - sampling.resumed_tokens,
                grammar=grammar,
            )
            self.batcher.prefill(session.sequence)  # batched with concurrent prefills
            self.sessions.add(session_id, session)
        return PrefillResult(prompt_tokens=len(prompt_ids), elapsed_ns=now_ns(self.device) - started)

    def end_session(self, session_id: str) -> None:
        try:
            session = self.sessions.get(session_id)
        except SessionNotFound:
            return
        self.sessions.remove(session_id)
        with session.predraft_guard:
            session.closed = True
            predraft, session.predraft = session.predraft, None
        if predraft is not None:
            predraft.finish()  # no worker thread outlives its session

    def draft(self, session_id: str, feedback: Feedback | None, max_lookahead: int,
              expected_length: int | None = None) -> Iterator[DraftEvent]:
        """:meth:`disco.interfaces.Drafter.draft`; ``expected_length``: the caller's committed
        length of the session once ``feedback`` is applied (the gRPC path always sends it):
        another length is refused (:class:`SessionMismatch`) before anything changes."""
        session = self.sessions.get(session_id)
        if max_lookahead < 0:
            raise InvalidRequest(f"max_lookahead must be >= 0, got {max_lookahead}")
        predraft = session.predraft
        if predraft is not None:
            predraft.stop.set()  # at once: the block below waits for it when it starts
        return self._draft_block(session, session_id, feedback, max_lookahead, expected_length)

    @staticmethod
    def _check_length(session: DraftSession, feedback: Feedback | None, expected_length: int | None) -> None:
        """The session's length once the (checked) feedback is applied must be the caller's."""
        if expected_length is None:
            return
        length = len(session.sequence) if feedback is None else session.block_base + feedback.num_accepted + 1
        if length != expected_length:
            raise SessionMismatch(f"session holds {length} tokens after this feedback, the call expects "
                                  f"{expected_length}")

    def _check_feedback(self, session: DraftSession, feedback: Feedback | None) -> None:
        if feedback is None:
            if session.awaiting_feedback:
                raise InvalidRequest("feedback of the previous verification is required")
            return
        if not session.awaiting_feedback:
            raise InvalidRequest("feedback given but no draft block is awaiting verification")
        if not 0 <= feedback.num_accepted <= session.block_size:
            raise InvalidRequest(
                f"feedback accepts {feedback.num_accepted} tokens of a block of {session.block_size}")
        if not 0 <= feedback.next_token_id < session.sequence.model.config.vocab_size:
            raise InvalidRequest(f"bonus token id {feedback.next_token_id} is outside the vocabulary")

    def _draft_block(self, session: DraftSession, session_id: str, feedback: Feedback | None,
                     max_lookahead: int, expected_length: int | None = None) -> Iterator[DraftEvent]:
        """The drafting loop. The session lock is taken when iteration starts (so a
        generator that is dropped unstarted holds nothing) and released when it ends."""
        started = now_ns(self.device)
        if not session.lock.acquire(blocking=False):
            raise InvalidRequest(f"session {session_id!r} is already drafting")
        handed_out = False
        try:
            self._check_feedback(session, feedback)
            self._check_length(session, feedback, expected_length)
            start = self._start_block(session, feedback, max_lookahead)
            sequence, policy = session.sequence, session.policy
            for token in start.tokens:  # an overlap hit: already drafted (and in the sequence)
                session.block_size += 1
                yield token
            forwards, stop_reason = start.forwards, start.stop_reason or "lookahead_cap"
            for position in range(len(start.tokens), start.budget if start.stop_reason is None else 0):
                token, decision, _ = self._step(session, policy, position)
                forwards += 1
                if decision is Decision.DISCARD:
                    stop_reason = "discarded"
                    break
                sequence.tokens.append(token.token_id)
                session.block_size += 1
                yield token
                if decision is Decision.STOP:
                    stop_reason = "policy"
                    break
            handed_out = True
            yield DraftSummary(forwards=forwards, elapsed_ns=now_ns(self.device) - started,
                               stop_reason=stop_reason, predrafted_used=len(start.tokens),
                               predrafted_wasted=start.wasted, overlap_hit=start.hit, overlap_miss=start.miss)
        finally:
            try:
                if handed_out:
                    self._start_predraft(session, session_id, max_lookahead)
            finally:
                session.lock.release()

    def _start_block(self, session: DraftSession, feedback: Feedback | None, max_lookahead: int) -> _BlockStart:
        """Apply the (checked) feedback — on an overlap hit by adopting the pre-draft, else by
        rolling back to the accepted prefix and appending the bonus token — and size the block."""
        with session.predraft_guard:
            predraft, session.predraft = session.predraft, None
        start, rebuilt = _BlockStart(budget=0), False
        if feedback is not None:  # the verdict on the block session.policy drafted
            session.policy.observe_verification(session.block_size, feedback.num_accepted)
        if predraft is not None:
            predraft.finish()  # the worker is done with the sequence from here on
            start.forwards = predraft.forwards
            if predraft.matches(feedback):
                return self._adopt_predraft(session, predraft, max_lookahead, start)
            start.miss, start.wasted = predraft.attempted, len(predraft.tokens)
            if predraft.error is not None:  # a forward may have failed half-way: rebuild the cache
                # A fresh sequence on the packed path (its slot, if it had one, is freed with the old one).
                session.sequence, rebuilt = CachedSequence(self.model, session.sequence.tokens,
                                                           skipped=session.sequence.skipped), True
        sequence = session.sequence
        if feedback is not None:  # on a miss this also drops the guess, the pre-draft and their KV
            sequence.truncate(session.block_base + feedback.num_accepted)
            sequence.tokens.append(feedback.next_token_id)
            session.policy.on_feedback(session.block_size, feedback.num_accepted)
        if rebuilt:
            self.batcher.prefill(sequence)
        session.block_base, session.block_size, session.awaiting_feedback = len(sequence), 0, True
        room = self.max_context - len(sequence)
        start.budget = block_budget(session.policy, max_lookahead, room)
        return start

    def _adopt_predraft(self, session: DraftSession, predraft: Predraft, max_lookahead: int,
                        start: _BlockStart) -> _BlockStart:
        """An overlap hit: the guess is the bonus token, the pre-drafted tokens open the block."""
        sequence, start.hit = session.sequence, True
        session.block_base, session.block_size, session.awaiting_feedback = predraft.block_end + 1, 0, True
        if max_lookahead == predraft.max_lookahead:  # the policy copy saw exactly this block start
            session.policy, start.budget = predraft.policy, predraft.budget
            kept, stopped = predraft.tokens, predraft.stopped
        else:  # another cap (the request's end is near): replay the decisions on the policy itself
            policy = session.policy
            policy.on_feedback(predraft.block_size, predraft.block_size)
            room = self.max_context - session.block_base
            start.budget = block_budget(policy, max_lookahead, room)
            kept, stopped = [], False
            for position, (token, signals) in enumerate(zip(predraft.tokens, predraft.signals)):
                if position >= start.budget:
                    break
                kept.append(token)
                if policy.after_token(position, token.token_id, signals) is not Decision.CONTINUE:
                    stopped = True
                    break
        start.tokens, start.wasted = list(kept), len(predraft.tokens) - len(kept)
        if start.wasted:
            sequence.truncate(session.block_base + len(kept))
            if sequence.num_pending == 0:  # keep the last token pending, as drafting leaves it
                last = sequence.tokens[-1]
                sequence.truncate(len(sequence) - 1)
                sequence.tokens.append(last)
        if stopped:
            start.stop_reason = "policy"
        elif len(kept) >= start.budget:
            start.stop_reason = "lookahead_cap"
        return start

    def _start_predraft(self, session: DraftSession, session_id: str, max_lookahead: int) -> None:
        """Overlap: draft the next block in the background while this one is verified."""
        if not session.overlap or max_lookahead == 0 or not can_predraft(session.policy):
            return
        room = self.max_context - len(session.sequence) - 1  # the guess takes one position
        predraft = Predraft(session.sequence, session.policy, session.block_size, max_lookahead, room, self.batcher,
                            lambda policy, position: self._step(session, policy, position),
                            lambda logits, position: int(self._choose(
                                session.sampling, position, self._controlled(session, logits[None])[0], False)[0]),
                            name=f"predraft-{session_id}")
        with session.predraft_guard:
            if session.closed:
                return
            try:
                predraft.start()
            except RuntimeError:  # no thread to be had: no pre-draft this time
                return
            session.predraft = predraft

    def _step(self, session: DraftSession, policy: StopPolicy, position: int
              ) -> tuple[DraftToken, Decision, TokenSignals | None]:
        """Draft one token and ask the policy about it (the drafting loop's body);
        ``position``: the token's index in its block (the policy's).

        One device-to-host transfer per draft token: the token, its probability and the
        signals (and hidden state) a policy reads are gathered into one float32 tensor on
        the device and moved once (:func:`to_host`). Token ids travel as float32, exact below
        2**24 (checked at start). No distribution travels: the target verifies sampled
        tokens by their ids (drafter-invariant sampling).
        """
        sequence = session.sequence
        self.sessions.grow(session.session_id, sequence.kv_positions(len(sequence.tokens)))  # this forward's KV, admitted
        logits, hidden = self.batcher.forward(sequence, 1, want_hidden=policy.needs_hidden)  # [1, vocab]
        # Greedy with signals: the token's probability is the signals' (one softmax serves both).
        want_prob = not (policy.needs_signals and session.sampling.is_greedy)
        # The token goes at absolute position len(sequence.tokens): its noise's key when sampling.
        # The token is chosen under the request's sampling controls; the signals read the raw logits.
        controlled = self._controlled(session, logits)[0]  # [vocab]
        token, prob = self._choose(session.sampling, len(sequence.tokens), controlled, want_prob)
        parts = [token.float().reshape(1), prob.reshape(1) if prob is not None else logits.new_full((1,), float("nan"))]
        if self.vocab_subset:  # a head over a subset: the controls may leave no token it can propose
            parts.append(controlled.max().float().reshape(1))
        if policy.needs_signals:
            parts.append(signal_values(logits[0], token))  # [NUM_SIGNAL_VALUES]
            if hidden is not None:
                parts.append(hidden[0].float())  # [hidden_size]
        host = to_host(torch.cat(parts))  # the one transfer
        token_id, draft_prob, offset = int(host[0]), float(host[1]), 2
        if self.vocab_subset:
            if host[offset] == float("-inf"):  # nothing the subset holds is allowed here: the block ends
                return DraftToken(token_id=token_id, draft_prob=0.0), Decision.DISCARD, None
            offset += 1
        signals = None
        if policy.needs_signals:
            values, offset = host[offset: offset + NUM_SIGNAL_VALUES], offset + NUM_SIGNAL_VALUES
            hidden_host = None
            if hidden is not None:
                hidden_host, offset = host[offset: offset + hidden.shape[-1]], offset + hidden.shape[-1]
            signals = signals_from_values(values, hidden_host)
            if not want_prob:
                draft_prob = signals.token_prob
        token = DraftToken(token_id=token_id, draft_prob=draft_prob)
        return token, policy.after_token(position, token.token_id, signals), signals

    @staticmethod
    def _controlled(session: DraftSession,
                    logits: torch.Tensor,  # [1, vocab] at the position after the session's tokens
                    ) -> torch.Tensor:  # [1, vocab]
        """The request's sampling controls applied with the session's history, as the target
        applies them at that position (:mod:`disco.speculation.logits_processors`)."""
        tokens = session.sequence.tokens
        return apply_logits_controls(logits, session.sampling, tokens, len(tokens), session.output_start,
                                     session.grammar)

    @staticmethod
    def _choose(sampling: SamplingParams, position: int,
                logits: torch.Tensor,  # logits: [vocab]
                want_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft token at absolute sequence ``position`` on the device (nothing read back):
        ``(token [], its probability [] or None)``. Greedy: the argmax and, if ``want_prob``,
        its softmax probability (the caller may take it from the signals). Sampling: the
        Gumbel-max sample of the warped distribution under the noise of ``(seed, position)``
        (:func:`gumbel_sample`), the noise the target samples its own token with there, and
        its probability."""
        if sampling.is_greedy:
            token = logits.argmax()
            prob = torch.softmax(logits, -1).index_select(0, token.reshape(1))[0] if want_prob else None
            return token, prob
        draft_probs = logits_to_probs(logits, sampling)  # [vocab]
        token = gumbel_sample(draft_probs.unsqueeze(0), sampling.seed, [position])[0]
        return token, draft_probs.index_select(0, token.reshape(1))[0]

    def active_sessions(self) -> int:
        return len(self.sessions)

    def kv_memory(self) -> tuple[int, Callable[[], int], Callable[[], int]]:
        """The KV budget in bytes, and readers of the bytes sessions reserved and of those the
        model's KV pool holds (``/metrics``)."""
        pool = KVPool.of(self.model)
        return self.sessions.kv.budget_bytes, lambda: self.sessions.kv_bytes_in_use, lambda: pool.nbytes
