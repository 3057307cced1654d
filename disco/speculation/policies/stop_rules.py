"""DISCO decision rules: when the calibrated classifier output stops a block.

The classifier gives one calibrated probability ``p_j`` per draft token ``j`` (0-based in
the block); what it is about depends on the artifact's label (``current``: every block
token so far is accepted; ``next``: so is the next one; ``conditional``: token ``j`` is
accepted given that tokens ``0…j-1`` were). A rule turns ``p_j`` and the block's running
product ``C_j = p_0 · … · p_j`` into a statistic; the block stops when it is below the
threshold:

* ``token`` — ``p_j`` (the original DISCO rule; with ``next`` it reads "draft one more
  only if it is likely to be accepted");
* ``cumulative`` — ``C_j`` (SpecDec++): with ``conditional`` it estimates P(the whole
  block so far is accepted);
* ``gain`` — explicit cost-aware expected gain of drafting token ``j+1``:
  ``C_j · p_j · value / marginal(k)``, where ``C_j · p_j`` estimates P(the block through
  ``j+1`` is accepted) (``p_j`` stands in for the next token's conditional acceptance),
  ``value`` = target-only seconds per token and ``marginal(k) = t_draft + t_verify(k+1) -
  t_verify(k)`` with ``k = j + 1`` tokens drafted; 1.0 is break-even, the threshold is a
  scale factor tuned by replay.

The live :class:`~disco.speculation.policies.learned.DiscoPolicy` and offline replay run this same
code, so replayed and live decisions agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from disco.errors import InvalidRequest
from disco.speculation.cost_model import CostModel

RULES = ("token", "cumulative", "gain")
#: Rules tried per label by training (products of ``current``/``next`` would double count:
#: those labels already mean "the block so far is accepted").
RULES_FOR_LABEL = {"current": ("token",), "next": ("token",), "conditional": RULES}

_TOKEN_GRID = tuple(round(0.02 * i, 2) for i in range(1, 50))
# 0.01 … 0.95, log-spaced in 1 - t: products of high per-token probabilities decide in
# 0.4 … 0.95, where the grid is dense (steps of ~0.003 near 0.95, ~0.03 near 0.5).
_CUMULATIVE_GRID = tuple(sorted(float(f"{1 - t:.4g}") for t in np.geomspace(0.05, 0.99, 48)))
_GAIN_GRID = tuple(float(f"{t:.4g}") for t in np.geomspace(0.1, 10.0, 60))


def candidates(labels: Sequence[str], rules: Sequence[str] = RULES) -> list[tuple[str, str]]:
    """(label, rule) pairs training tries: each label with the rules that make sense for it."""
    pairs = [(label, rule) for label in labels for rule in RULES_FOR_LABEL[label] if rule in rules]
    if not pairs:
        needed = [label for label, allowed in RULES_FOR_LABEL.items() if set(rules) & set(allowed)]
        raise InvalidRequest(f"no DISCO candidate: rule(s) {', '.join(rules)} need label {' or '.join(needed)}")
    return pairs


def threshold_grid(rule: str) -> tuple[float, ...]:
    """Thresholds swept by training and ``disco tune`` for a rule (increasing)."""
    grids = {"token": _TOKEN_GRID, "cumulative": _CUMULATIVE_GRID, "gain": _GAIN_GRID}
    if rule not in grids:
        raise InvalidRequest(f"unknown DISCO rule {rule!r} (known: {', '.join(RULES)})")
    return grids[rule]


@dataclass(frozen=True)
class StopRule:
    """One decision rule with its threshold (and, for ``gain``, the cost model)."""

    name: str = "token"
    threshold: float = 0.5
    cost: CostModel | None = None

    def __post_init__(self) -> None:
        if self.name not in RULES:
            raise InvalidRequest(f"unknown DISCO rule {self.name!r} (known: {', '.join(RULES)})")
        if self.name == "gain" and self.cost is None:
            raise InvalidRequest("the DISCO gain rule needs the artifact's cost model")

    def statistic(self, position: int, probability: float, cumulative: float) -> float:
        """``cumulative`` = product of the block's probabilities, this token's included."""
        if self.name == "token":
            return probability
        if self.name == "cumulative":
            return cumulative
        cost = self.cost
        assert cost is not None
        drafted = position + 1
        marginal = cost.t_draft + cost.verify(drafted + 1) - cost.verify(drafted)
        return cumulative * probability * cost.target_only_token / max(marginal, 1e-9)

    def stops(self, position: int, probability: float, cumulative: float) -> bool:
        return self.statistic(position, probability, cumulative) < self.threshold
