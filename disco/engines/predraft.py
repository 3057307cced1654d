"""Overlapped drafting: draft the next block while the target verifies this one.

Without overlap the draft model idles while the target verifies a block. PEARL's
*post-verify* (Liu et al. 2024, "PEARL: Parallel Speculative Decoding with Adaptive Draft
Length") uses that time: guess the verification outcome and draft the next block after
the guess. Here the guess is: the target accepts the whole block, and its bonus token is
the draft's own most likely token at that position. A background worker (one
:class:`Predraft` per session and block, one thread) appends the guess and drafts after it
exactly as the drafting loop would after that feedback — same per-token stop-policy
calls, on a copy of the policy, same lookahead rule — until the policy says STOP, the
budget is spent, or the next ``Draft`` call tells it to stop (it finishes at most the
forward it is running).

The next ``Draft`` call then checks the guess (:meth:`Predraft.matches`): on a *hit* the
pre-drafted tokens are the first tokens of the new block and the policy copy replaces the
session's policy; on a *miss* everything the worker appended is dropped (the usual
rollback to the accepted prefix) and the original policy is kept.

Exactness: a pre-drafted token is used only when the feedback equals the guess, i.e. when
its context is exactly the committed tokens, and it is the very :class:`DraftToken` the
drafting loop would have produced there.

The guess is the draft's own choice at the bonus position: its argmax under greedy
decoding, and when sampling its Gumbel-max sample under the noise of (seed, that position),
the noise the target samples its bonus token with (drafter-invariant sampling, see
:mod:`disco.speculation.sampling`): it equals the target's token as often as a draft token
is accepted. Sampled draft tokens are functions of their context and of (seed, position),
so the worker's tokens are the drafting loop's with and without overlap, with no random
state to carry over.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Callable

import torch

from disco.engines.batching import ForwardBatcher
from disco.engines.kv import CachedSequence
from disco.interfaces import DraftToken, Feedback
from disco.speculation.acceptance_calibration import AcceptanceCalibration
from disco.speculation.policies import Decision, StopPolicy, block_budget
from disco.speculation.policies.learned import DiscoArtifact
from disco.speculation.policies.simple import OraclePolicy
from disco.speculation.signals import TokenSignals

logger = logging.getLogger(__name__)

#: One drafting step of the engine: (policy, position in block) -> the token, the policy's
#: decision after it, and the signals the policy read (None if it reads none).
Step = Callable[[StopPolicy, int], tuple[DraftToken, Decision, "TokenSignals | None"]]
#: The draft's choice of a token from its logits ([vocab]) at an absolute sequence position.
Choose = Callable[["torch.Tensor", int], int]


def can_predraft(policy: StopPolicy) -> bool:
    """Pre-drafting needs a policy that never discards a token: the oracle (analysis only,
    the one that discards) reads reference tokens by position and is left out."""
    return policy.uses_draft and not isinstance(policy, OraclePolicy)


def clone_policy(policy: StopPolicy) -> StopPolicy:
    """A deep copy of the policy's per-session state; trained DISCO artifacts (read-only,
    possibly large) are shared, not copied."""
    shared: dict[int, object] = {}
    pending: list[object] = [policy]
    while pending:
        for value in vars(pending.pop()).values():
            if isinstance(value, StopPolicy):  # e.g. auto's inner DISCO policy
                pending.append(value)
            elif isinstance(value, AcceptanceCalibration):  # the deployment's, shared by design
                shared[id(value)] = value
            elif isinstance(value, DiscoArtifact):
                for part in (value, value.classifier, value.projection, value.spec):
                    if part is not None:
                        shared[id(part)] = part
    return copy.deepcopy(policy, shared)


class Predraft:
    """The next block of one session, drafted in a background thread.

    Created (and started) by the draft engine when a block has been handed out, while it
    holds the session lock; the worker then owns ``sequence`` until :meth:`finish`
    returns. Only the holder of the session lock calls :meth:`finish` and touches the
    sequence afterwards, so the worker and a drafting call never overlap.
    """

    def __init__(self, sequence: CachedSequence, policy: StopPolicy, block_size: int, max_lookahead: int,
                 room: int, batcher: ForwardBatcher, step: Step, choose: Choose, name: str = "predraft") -> None:
        self.block_end = len(sequence)  # sequence length with the block awaiting verification
        self.block_size = block_size  # draft tokens in that block (the guessed num_accepted)
        self.max_lookahead = max_lookahead  # the cap assumed for the next block (the last call's)
        self._sequence, self._original = sequence, policy
        self._room, self._batcher, self._step, self._choose = room, batcher, step, choose
        self.stop = threading.Event()
        self.guess: int | None = None  # the guessed bonus token, once its forward ran
        self.policy: StopPolicy | None = None  # the copy: on_feedback(k, k), begin_block, after_token…
        self.budget = 0  # the next block's lookahead budget under the guess
        self.tokens: list[DraftToken] = []  # pre-drafted tokens, after the guess
        self.signals: list[TokenSignals | None] = []  # what the policy read for each of them
        self.stopped = False  # the last token got a STOP
        self.forwards = 0  # draft forwards run, used or not
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        """Stop the worker and wait for it (at most the forward it is running)."""
        self.stop.set()
        if self.thread.ident is not None:
            self.thread.join()

    def matches(self, feedback: Feedback | None) -> bool:
        """A hit: the whole block accepted and the bonus token equal to the guess."""
        return (feedback is not None and self.error is None and self.guess is not None
                and feedback.num_accepted == self.block_size and feedback.next_token_id == self.guess)

    @property
    def attempted(self) -> bool:
        """Whether there was a guess to check (or a failure): a hit or a miss, not a no-show."""
        return self.guess is not None or self.error is not None

    def _run(self) -> None:
        try:
            self._predraft()
        except Exception as error:  # noqa: BLE001 - a failed pre-draft is a miss, never a failed request
            logger.warning("pre-drafting failed (treated as a miss): %r", error)
            self.error = error

    def _predraft(self) -> None:
        # 1. The policy as the drafting loop would find it after the guessed feedback.
        policy = clone_policy(self._original)
        policy.on_feedback(self.block_size, self.block_size)
        budget = block_budget(policy, self.max_lookahead, self._room)
        if budget == 0 or self.stop.is_set():
            return
        # 2. The guess: the draft's own choice for the bonus position.
        sequence = self._sequence
        self.policy, self.budget = policy, budget
        logits, _ = self._batcher.forward(sequence, 1)  # [1, vocab]
        self.forwards += 1
        guess = self._choose(logits[0], len(sequence.tokens))
        sequence.tokens.append(guess)
        self.guess = guess
        # 3. The next block after the guess, token by token, as the drafting loop does.
        for position in range(budget):
            if self.stop.is_set():
                return
            token, decision, signals = self._step(policy, position)
            self.forwards += 1
            if decision is Decision.DISCARD:  # the oracle is left out (can_predraft); a draft over a vocabulary
                # subset with nothing allowed to propose: make it a miss
                raise RuntimeError("the stop policy discarded a pre-drafted token")
            sequence.tokens.append(token.token_id)
            self.tokens.append(token)
            self.signals.append(signals)
            if decision is Decision.STOP:
                self.stopped = True
                return
