"""DISCO's predicted acceptance, recalibrated online against the verifications a deployment sees.

The shipped classifier was trained on one pair, engine and domain (the default pair in
float32, HumanEval train prompts); served on another engine (int4 weights), another domain
or another pair, its probabilities drift from the acceptance the target actually gives,
and ``auto``'s rate rule (:mod:`disco.speculation.policies.auto`) stops too early or too
late. No retraining: each draft deployment keeps one :class:`AcceptanceCalibration` per
artifact, shared by all its sessions, that maps a predicted conditional probability
(``P(token j accepted | the tokens before it were)``) to the acceptance observed for
predictions like it.

What a verification says: a block of ``k`` drafted tokens with ``n`` accepted shows tokens
``0..n-1`` accepted and, when ``n < k``, token ``n`` rejected; tokens after a rejection are
never judged (the conditional label is undefined there), so they are left out.

The map is a histogram over :data:`BINS` equal bins of the predicted probability; in each
bin the calibrated probability is ``(accepted + PRIOR * p) / (judged + PRIOR)``: the
classifier's own ``p`` until the bin has seen about :data:`PRIOR` tokens, then mostly what
they showed.

A request reads a :class:`CalibrationMap` — a frozen copy taken when its session starts —
for all its blocks, so a session's blocks do not depend on when verdicts of other
sessions (or its own pre-drafted block's) arrive: overlapped and sequential drafting make
the same decisions, and what the deployment learned serves the next requests. Each
observation also keeps the calibration error of the raw and of the calibrated predictions
(prequential: a token's calibrated probability was fixed before its outcome was known),
reported by :meth:`AcceptanceCalibration.summary`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

#: Equal-width bins of the predicted probability.
BINS = 20
#: Pseudo-count of the classifier's own prediction in each bin.
PRIOR = 20.0
#: Bins of the reported calibration error (ECE).
ECE_BINS = 10


@dataclass(frozen=True)
class CalibrationMap:
    """A frozen copy of the observed acceptance by bin: ``map(p)`` is the calibrated probability."""

    accepted: tuple[int, ...]
    judged: tuple[int, ...]
    prior: float = PRIOR

    def __call__(self, probability: float) -> float:
        index = _bin(probability, len(self.judged))
        judged = self.judged[index]
        if judged == 0:
            return probability  # exactly the classifier's own prediction
        return (self.accepted[index] + self.prior * probability) / (judged + self.prior)

    @staticmethod
    def identity(bins: int = BINS) -> "CalibrationMap":
        return CalibrationMap(accepted=(0,) * bins, judged=(0,) * bins)


class AcceptanceCalibration:
    """Observed acceptance by predicted probability, shared by a deployment's sessions (thread-safe)."""

    def __init__(self, bins: int = BINS, prior: float = PRIOR) -> None:
        if bins < 1 or prior <= 0:
            raise ValueError(f"need bins >= 1 and prior > 0, got {bins}, {prior}")
        self.bins, self.prior = bins, prior
        self._accepted = [0] * bins
        self._judged = [0] * bins
        self._raw_error = _ErrorBins(ECE_BINS)
        self._calibrated_error = _ErrorBins(ECE_BINS)
        self._lock = threading.Lock()

    def snapshot(self) -> CalibrationMap:
        """The map a new request uses for all its blocks."""
        with self._lock:
            return CalibrationMap(tuple(self._accepted), tuple(self._judged), self.prior)

    def observe(self, predictions: Sequence[tuple[float, float]], num_accepted: int) -> None:
        """Record one verification: ``predictions[j]`` is ``(raw, calibrated)``, the predicted
        conditional acceptance of draft token ``j`` of the block as the classifier gave it and
        as the request used it; ``num_accepted`` how many tokens the target accepted."""
        judged = list(predictions[:num_accepted + 1])
        with self._lock:
            for position, (raw, calibrated) in enumerate(judged):
                accepted = position < num_accepted
                index = _bin(raw, self.bins)
                self._judged[index] += 1
                self._accepted[index] += accepted
                self._raw_error.add(raw, accepted)
                self._calibrated_error.add(calibrated, accepted)

    def summary(self) -> dict:
        """Tokens judged and the expected calibration error (ECE) of the raw and of the
        calibrated predictions over them (prequential, see the module docstring)."""
        with self._lock:
            return {"judged": sum(self._judged), "ece_raw": self._raw_error.ece(),
                    "ece_calibrated": self._calibrated_error.ece()}

    def table(self) -> list[tuple[float, int, float]]:
        """``(bin midpoint, tokens judged, observed acceptance)`` for every bin that saw one."""
        with self._lock:
            return [((index + 0.5) / self.bins, judged, accepted / judged)
                    for index, (accepted, judged) in enumerate(zip(self._accepted, self._judged)) if judged]


class _ErrorBins:
    """Running sums for the ECE of a stream of ``(predicted probability, accepted)`` pairs."""

    def __init__(self, bins: int) -> None:
        self.predicted = [0.0] * bins
        self.observed = [0.0] * bins
        self.count = [0] * bins

    def add(self, probability: float, accepted: bool) -> None:
        index = _bin(probability, len(self.count))
        self.predicted[index] += probability
        self.observed[index] += float(accepted)
        self.count[index] += 1

    def ece(self) -> float:
        total = sum(self.count)
        if not total:
            return 0.0
        return sum(abs(p - o) for p, o in zip(self.predicted, self.observed)) / total


def expected_calibration_error(pairs: Iterable[tuple[float, bool]], bins: int = ECE_BINS) -> float:
    """ECE of ``(predicted probability, accepted)`` pairs: the mean over equal-width bins,
    weighted by their share of the pairs, of |mean prediction - observed acceptance|."""
    error = _ErrorBins(bins)
    for probability, accepted in pairs:
        error.add(probability, accepted)
    return error.ece()


def _bin(probability: float, bins: int) -> int:
    return min(bins - 1, max(0, int(probability * bins)))
