"""``auto``: DISCO's stop decision under a cap from the measured engine costs.

Speculation pays only where a verification of k draft tokens costs less than the k
target-only steps it can save. On a GPU or a CPU with bf16 units verification is nearly
free and long drafts pay; on an AVX2 CPU in bf16 a forward over k tokens costs about k
one-token forwards and no draft pays; int8 weight-only lies in between (short drafts pay).
``auto`` reads that from the measured costs (:class:`~disco.cost_model.CostModel`):

* per request, the loop asks :func:`speculation_pays` with an optimistic acceptance rate;
  where even that cannot beat target-only by :data:`MIN_SPEEDUP`, the request runs
  target-only (no draft session, no draft calls: as fast as ``none``);
* per block, the draft side caps the lookahead at the k that maximises the expected
  speedup for the session's running acceptance rate (:func:`best_lookahead`), and DISCO's
  classifier (the shipped ``disco:default`` artifact with its tuned rule) stops earlier
  when the next token looks likely to be rejected.

Expected speedup of lookahead k for a per-token acceptance rate ``a`` (tokens are
accepted independently with probability ``a``; the bonus token always counts)::

    speedup(k, a) = target_only_token * (1 - a**(k+1)) / (1 - a)  /  (k * t_draft + t_verify(k) + 2 * t_rtt)

The costs travel in the spec the draft session gets (``auto:td=...,tv=.../...,rtt=...``),
so the draft service needs no access to the target's measurements.
"""

from __future__ import annotations

from typing import Callable

from disco.cost_model import CostModel
from disco.errors import InvalidRequest
from disco.policies.base import Decision, StopPolicy
from disco.signals import TokenSignals

#: Below this expected speedup (at OPTIMISTIC_ACCEPTANCE) a request runs target-only.
MIN_SPEEDUP = 1.03
#: Acceptance rate assumed for the per-request decision: a well-matched pair on easy text.
OPTIMISTIC_ACCEPTANCE = 0.9
#: Prior of the session's acceptance estimate: pseudo-counts of accepted tokens and rejections.
PRIOR_ACCEPTED, PRIOR_REJECTED = 4.0, 1.0


def expected_speedup(cost: CostModel, lookahead: int, acceptance: float) -> float:
    """Tokens/s of lookahead ``lookahead`` over target-only tokens/s (model above)."""
    if lookahead <= 0:
        return 1.0
    acceptance = min(max(acceptance, 0.0), 0.999)
    expected_tokens = (1 - acceptance ** (lookahead + 1)) / (1 - acceptance)
    seconds = lookahead * cost.t_draft + cost.verify(lookahead) + 2 * cost.t_rtt
    return cost.target_only_token * expected_tokens / seconds


def best_lookahead(cost: CostModel, acceptance: float, max_lookahead: int) -> tuple[int, float]:
    """``(k, speedup)`` maximising :func:`expected_speedup` over ``0 <= k <= max_lookahead``
    (``k = 0``: target-only, speedup 1)."""
    best = (0, 1.0)
    for lookahead in range(1, max_lookahead + 1):
        speedup = expected_speedup(cost, lookahead, acceptance)
        if speedup > best[1]:
            best = (lookahead, speedup)
    return best


def speculation_pays(cost: CostModel, max_lookahead: int) -> bool:
    """Whether any lookahead can beat target-only by :data:`MIN_SPEEDUP` at an
    optimistic acceptance rate (the per-request decision of ``auto``)."""
    return best_lookahead(cost, OPTIMISTIC_ACCEPTANCE, max_lookahead)[1] >= MIN_SPEEDUP


def encode_costs(cost: CostModel) -> str:
    """The ``auto:`` argument carrying ``cost`` (milliseconds, 4 significant digits)."""
    verify = "/".join(f"{v * 1000:.4g}" for v in cost.t_verify)
    return f"td={cost.t_draft * 1000:.4g},tv={verify},rtt={cost.t_rtt * 1000:.4g}"


def decode_costs(spec: str, argument: str) -> CostModel | None:
    """Parse an ``auto:`` argument (``None`` for plain ``auto``); raises :class:`InvalidRequest`."""
    if not argument:
        return None
    fields: dict[str, str] = {}
    for item in argument.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in ("td", "tv", "rtt") or key in fields:
            raise InvalidRequest(f"malformed policy spec {spec!r}: expected auto or auto:td=MS,tv=MS/MS/...,rtt=MS")
        fields[key] = value
    try:
        verify = tuple(float(v) / 1000 for v in fields["tv"].split("/"))
        return CostModel(t_draft=float(fields.get("td", "0")) / 1000, t_verify=verify,
                         t_rtt=float(fields.get("rtt", "0")) / 1000, source="auto spec")
    except (KeyError, ValueError):
        raise InvalidRequest(f"malformed policy spec {spec!r}: td, tv and rtt must be milliseconds "
                             "(tv: one value per block size, separated by '/')") from None


class AutoPolicy(StopPolicy):
    """A DISCO policy whose block length is capped by :func:`best_lookahead` for the
    session's running acceptance rate (plain DISCO when no costs are known)."""

    def __init__(self, disco: StopPolicy, cost: CostModel | None) -> None:
        self.disco = disco
        self.cost = cost
        self.needs_signals = disco.needs_signals
        self.needs_hidden = disco.needs_hidden
        self.accepted, self.rejected = PRIOR_ACCEPTED, PRIOR_REJECTED

    @property
    def acceptance(self) -> float:
        """Per-token acceptance estimate: a block of k with n accepted shows n acceptances
        and, when n < k, one rejection (tokens after it are never judged)."""
        return self.accepted / (self.accepted + self.rejected)

    def begin_block(self, max_lookahead: int) -> int:
        budget = self.disco.begin_block(max_lookahead)
        if self.cost is not None:
            cap, _ = best_lookahead(self.cost, self.acceptance, max_lookahead)
            budget = min(budget, cap)
        return budget

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        return self.disco.after_token(position, token_id, signals)

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        self.disco.on_feedback(num_drafted, num_accepted)
        self.accepted += num_accepted
        self.rejected += 1 if num_accepted < num_drafted else 0


def auto_factory(spec: str, argument: str, disco_factory: Callable[[], StopPolicy]) -> Callable[[], StopPolicy]:
    """Per-session :class:`AutoPolicy` factory for the spec ``auto[:costs]``."""
    cost = decode_costs(spec, argument)
    return lambda: AutoPolicy(disco_factory(), cost)
