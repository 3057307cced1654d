"""Training-free stop policies: none, static, HF's heuristic schedule, confidence,
adaptive confidence (HF's ROC re-fit), entropy (AdaEDL-style) and the oracle."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from disco.speculation.policies.base import Decision, StopPolicy
from disco.speculation.signals import TokenSignals


class TargetOnlyPolicy(StopPolicy):
    """``none``: target-only autoregressive decoding; the drafter is never called."""

    uses_draft = False

    def begin_block(self, max_lookahead: int) -> int:
        return 0


class StaticPolicy(StopPolicy):
    """``static:K``: always draft K tokens (capped by the lookahead cap)."""

    def __init__(self, lookahead: int) -> None:
        self.lookahead = lookahead

    def begin_block(self, max_lookahead: int) -> int:
        return min(self.lookahead, max_lookahead)


class HeuristicPolicy(StopPolicy):
    """``heuristic:K0``: HF transformers' ``num_assistant_tokens_schedule="heuristic"``.

    Start with K0; after each verification K += 2 if every draft token was accepted,
    else K = max(1, K - 1). NOTE: unlike HF, K is kept within the lookahead cap so that
    a long run of full acceptances cannot push it to values the cap never lets us use.
    """

    def __init__(self, initial_lookahead: int) -> None:
        self.lookahead = initial_lookahead
        self._cap = initial_lookahead

    def begin_block(self, max_lookahead: int) -> int:
        self._cap = max_lookahead
        return min(self.lookahead, max_lookahead)

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted > 0 and num_accepted == num_drafted:
            self.lookahead = min(self.lookahead + 2, max(self._cap, 1))
        else:
            self.lookahead = max(1, self.lookahead - 1)


class ConfidencePolicy(StopPolicy):
    """``confidence:T``: stop after a draft token whose top-1 probability is below T
    (HF's ``assistant_confidence_threshold``, default 0.4; llama.cpp's ``p_min``)."""

    needs_signals = True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        assert signals is not None
        return Decision.STOP if signals.top1_prob < self.threshold else Decision.CONTINUE


class AdaptiveConfidencePolicy(ConfidencePolicy):
    """``adaptive-confidence``: the confidence threshold is re-fitted online.

    HF transformers' rule (``AssistedCandidateGenerator.update_candidate_strategy``):
    remember the probability of every drafted token and whether it was accepted; once
    there are more than 5 samples of both outcomes, pick the ROC threshold minimizing
    ``fpr + 3 * fnr`` (scikit-learn ``roc_curve``).
    """

    MIN_SAMPLES = 5

    def __init__(self, initial_threshold: float = 0.4) -> None:
        super().__init__(initial_threshold)
        self._block_probs: list[float] = []
        self.probs: list[float] = []
        self.matches: list[int] = []

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        assert signals is not None
        self._block_probs.append(signals.top1_prob)
        return super().after_token(position, token_id, signals)

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        block_probs, self._block_probs = self._block_probs[:num_drafted], []
        self.probs.extend(block_probs)
        outcomes = [1] * num_accepted + ([0] if num_accepted < len(block_probs) else [])
        self.matches.extend(outcomes)
        # Tokens after the first rejection were never judged: drop their probabilities.
        del self.probs[len(self.matches):]
        if len(self.probs) > self.MIN_SAMPLES and {0, 1}.issubset(self.matches):
            from sklearn.metrics import roc_curve  # imported lazily: scikit-learn is slow to import

            fpr, tpr, thresholds = roc_curve(self.matches, self.probs)
            costs = fpr + 3 * (1 - tpr)
            best = float(thresholds[int(np.argmin(costs))])
            self.threshold = min(best, 1.0) if math.isfinite(best) else self.threshold


class EntropyPolicy(StopPolicy):
    """``entropy[:lambda=L,gamma=G,adapt=E,target=A]``: AdaEDL-style early stop.

    Agrawal et al. 2024 ("AdaEDL: Early Draft Stopping for Speculative Decoding using an
    Entropy-based Lower Bound on Token Acceptance Probability") bound the acceptance
    probability of a draft token from its draft entropy ``H`` (nats) by
    ``1 - sqrt(gamma * H)``. Rule: stop after a token whose bound is below ``lambda``.
    With ``adapt=E > 0`` the threshold follows the session's acceptance rate after each
    verification: ``lambda += E * (target - acceptance_ema)`` (clipped to [0.01, 0.99]),
    stopping earlier while the draft is doing worse than ``target``.
    Defaults: lambda=0.4, gamma=1.0, adapt=0 (static), target=0.8.
    """

    needs_signals = True

    def __init__(self, lam: float = 0.4, gamma: float = 1.0, adapt: float = 0.0, target: float = 0.8) -> None:
        self.lam, self.gamma, self.adapt, self.target = lam, gamma, adapt, target
        self._acceptance_ema = target

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        assert signals is not None
        bound = 1.0 - math.sqrt(self.gamma * max(signals.entropy, 0.0))
        return Decision.STOP if bound < self.lam else Decision.CONTINUE

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        if self.adapt <= 0 or num_drafted == 0:
            return
        self._acceptance_ema = 0.9 * self._acceptance_ema + 0.1 * (num_accepted / num_drafted)
        self.lam = min(0.99, max(0.01, self.lam + self.adapt * (self.target - self._acceptance_ema)))


class OraclePolicy(StopPolicy):
    """``oracle``: drafts exactly the tokens the target will accept (analysis only).

    Needs the target's own greedy continuation (``reference_ids``): a draft token that
    differs from it is discarded and the block ends, so every block is fully accepted.
    The discarded token's draft forward is still counted.
    """

    def __init__(self, reference_ids: Sequence[int]) -> None:
        self.reference_ids = list(reference_ids)
        self._generated = 0

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        index = self._generated + position
        if index >= len(self.reference_ids) or self.reference_ids[index] != token_id:
            return Decision.DISCARD
        return Decision.CONTINUE

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        self._generated += num_accepted + 1
