"""``auto``: DISCO's stop decision under a cap from the measured engine costs.

Speculation pays only where a verification of k draft tokens costs less than the k
target-only steps it can save. On a GPU or a CPU with bf16 units verification is nearly
free and long drafts pay; on an AVX2 CPU in bf16 a forward over k tokens costs about k
one-token forwards and no draft pays; int8 weight-only lies in between (short drafts pay).
``auto`` reads that from the measured costs (:class:`~disco.speculation.cost_model.CostModel`):

* per request, the loop asks :func:`speculation_pays` with an optimistic acceptance rate,
  the request's prompt and token budget: the draft's prefill of the prompt (a cost a
  target-only request never pays, ``t_draft_prefill`` per token) weighed against what
  drafting can save on its tokens (:func:`request_speedup`); where even that cannot beat
  target-only by :data:`MIN_SPEEDUP`, the request runs target-only (no draft session, no
  draft calls: as fast as ``none``). A long prompt with a short answer (a classification, a
  short JSON object) is not worth the draft's prefill on a CPU;
* per token, with a DISCO artifact whose classifier predicts each draft token's
  acceptance given the previous ones (label ``conditional``, the shipped
  ``disco:default``), the *rate rule* decides: after k drafted tokens with predicted
  conditional probabilities ``p_0 … p_{k-1}`` the block so far is worth
  ``E_k = 1 + C_0 + … + C_{k-1}`` tokens (``C_j = p_0 ··· p_j``; the 1 is the bonus or
  recovered token) for ``S_k = k * t_draft + t_verify(k) + 2 * t_rtt`` seconds; drafting
  goes on only while some longer block ``j > k`` (its next tokens assumed as likely as
  the last one, ``C_{i} = C_{k-1} * p_{k-1}^(i-k+1)``) has a higher expected rate
  ``E_j / S_j`` than ``E_k / S_k`` (rate maximisation with no threshold to tune; the
  artifact's tuned threshold is not used). The costs, not a threshold tuned for another
  machine, set how long blocks get: long where verification is nearly free (GPU), short
  where it is not (int8 on AVX2);
* the rate rule reads each probability through the deployment's online acceptance
  calibration (:mod:`disco.speculation.acceptance_calibration`) when the policy factory
  keeps one: the classifier's prediction, mapped to the acceptance the target gave to
  predictions like it on this deployment (a frozen copy per request);
* with another stop rule (an artifact of another label, or the confidence fallback), the
  draft side caps the lookahead at the k that maximises the expected speedup for the
  session's running acceptance rate (:func:`best_lookahead`) and the rule stops earlier.

Expected speedup of lookahead k for a per-token acceptance rate ``a`` (tokens are
accepted independently with probability ``a``; the bonus token always counts)::

    speedup(k, a) = target_only_token * (1 - a**(k+1)) / (1 - a)  /  (k * t_draft + t_verify(k) + 2 * t_rtt)

The costs travel in the spec the draft session gets (``auto:td=...,tv=.../...,rtt=...``),
so the draft service needs no access to the target's measurements.
"""

from __future__ import annotations

from typing import Callable

from disco.errors import InvalidRequest
from disco.speculation.acceptance_calibration import AcceptanceCalibration, CalibrationMap
from disco.speculation.cost_model import CostModel
from disco.speculation.policies.base import Decision, StopPolicy
from disco.speculation.signals import TokenSignals

#: Below this expected speedup (at OPTIMISTIC_ACCEPTANCE) a request runs target-only.
MIN_SPEEDUP = 1.03
#: The same bar where the cost model is that of several sessions in flight (``extra["sessions"]
#: > 1``, :func:`disco.speculation.live_model.live_cost_model`). Under load the model's gain
#: is small and its error is not: measured on the 2-vCPU AMX Xeon (int4 pair, bench-concurrency
#: with 32 tokens), the model put the best lookahead at 4 sessions at ~1.03x target-only
#: (k = 1: T(8 rows) 0.28 s + a draft step for 1.9 expected tokens, against T(4 rows) 0.168 s
#: per token), and ``auto`` measured 0.96x and 1.035x ``none`` in two runs; at 8 sessions
#: 0.95x and 0.98x. Speculating for a predicted gain inside that spread breaks the promise
#: never to be slower than target-only, so under load it must be predicted to pay by 10%.
MIN_SPEEDUP_UNDER_LOAD = 1.10
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


def request_speedup(cost: CostModel, max_lookahead: int, prompt_tokens: int, new_tokens: int) -> float:
    """Expected tokens/s of a request that drafts over the same request target-only: the best
    lookahead's speedup at :data:`OPTIMISTIC_ACCEPTANCE` over ``new_tokens`` tokens, with the
    draft's prefill of ``prompt_tokens`` paid once (:meth:`CostModel.draft_prefill`: per token, up to
    the draft's prefill window). The
    token budget is an upper bound (a request may stop early), so this stays optimistic."""
    speedup = best_lookahead(cost, OPTIMISTIC_ACCEPTANCE, max_lookahead)[1]
    target_only = new_tokens * cost.target_only_token
    if target_only <= 0:
        return 1.0
    return target_only / (target_only / speedup + cost.draft_prefill(prompt_tokens))


def speculation_pays(cost: CostModel, max_lookahead: int, prompt_tokens: int = 0, new_tokens: int = 0) -> bool:
    """Whether drafting can beat target-only by :data:`MIN_SPEEDUP` at an optimistic acceptance
    rate (the per-request decision of ``auto``; by :data:`MIN_SPEEDUP_UNDER_LOAD` where ``cost``
    is that of several sessions in flight). With ``new_tokens``, for a whole request: the
    draft's prefill of ``prompt_tokens`` included (:func:`request_speedup`); without, per block."""
    margin = MIN_SPEEDUP_UNDER_LOAD if int(cost.extra.get("sessions", 1)) > 1 else MIN_SPEEDUP
    if new_tokens > 0:
        return request_speedup(cost, max_lookahead, prompt_tokens, new_tokens) >= margin
    return best_lookahead(cost, OPTIMISTIC_ACCEPTANCE, max_lookahead)[1] >= margin


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
            raise InvalidRequest(f"malformed policy spec {spec!r}: costs must read td=MS,tv=MS/MS/...,rtt=MS")
        fields[key] = value
    try:
        verify = tuple(float(v) / 1000 for v in fields["tv"].split("/"))
        return CostModel(t_draft=float(fields.get("td", "0")) / 1000, t_verify=verify,
                         t_rtt=float(fields.get("rtt", "0")) / 1000, source="auto spec")
    except (KeyError, ValueError):
        raise InvalidRequest(f"malformed policy spec {spec!r}: td, tv and rtt must be milliseconds "
                             "(tv: one value per block size, separated by '/')") from None


class AutoPolicy(StopPolicy):
    """DISCO's per-token probabilities under the rate rule (module docstring), or another
    stop rule under a :func:`best_lookahead` cap for the session's running acceptance rate;
    plain DISCO when no costs are known."""

    def __init__(self, disco: StopPolicy, cost: CostModel | None,
                 calibration: AcceptanceCalibration | None = None) -> None:
        self.disco = disco
        self.cost = cost
        # The deployment's calibration (shared, receives this session's verdicts) and the
        # frozen copy this request decides with.
        self.calibration = calibration
        self.calibration_map = calibration.snapshot() if calibration is not None else CalibrationMap.identity()
        self.needs_signals = disco.needs_signals
        self.needs_hidden = disco.needs_hidden
        self.accepted, self.rejected = PRIOR_ACCEPTED, PRIOR_REJECTED
        artifact = getattr(disco, "artifact", None)
        self.rate_rule = cost is not None and getattr(artifact, "label", None) == "conditional"
        self._block_accepted = 1.0  # C_{k-1}: predicted P(every token drafted so far is accepted)
        self._block_tokens = 1.0  # E_k: expected tokens of the block so far
        self._budget = 0  # the block's lookahead budget
        self._predictions: list[tuple[float, float]] = []  # (raw, calibrated) per token of the block

    @property
    def acceptance(self) -> float:
        """Per-token acceptance estimate: a block of k with n accepted shows n acceptances
        and, when n < k, one rejection (tokens after it are never judged)."""
        return self.accepted / (self.accepted + self.rejected)

    def begin_block(self, max_lookahead: int) -> int:
        budget = self.disco.begin_block(max_lookahead)
        self._block_accepted, self._block_tokens, self._budget = 1.0, 1.0, budget
        self._predictions = []
        if self.cost is not None and not self.rate_rule:
            cap, _ = best_lookahead(self.cost, self.acceptance, max_lookahead)
            budget = min(budget, cap)
        return budget

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        decision = self.disco.after_token(position, token_id, signals)
        if not self.rate_rule:
            return decision
        raw = float(self.disco.last_probability)  # type: ignore[attr-defined]
        probability = self.calibration_map(raw)
        self._predictions.append((raw, probability))
        return Decision.CONTINUE if self.marginal_beats_block(position + 1, probability) else Decision.STOP

    def marginal_beats_block(self, drafted: int, probability: float) -> bool:
        """Record draft token ``drafted - 1``'s predicted conditional acceptance and say
        whether drafting on raises the block's expected tokens per second: whether some
        longer block (the next tokens assumed as likely as this one, up to the block's
        budget) beats the block as it stands. Looking past the next token matters where
        the verification cost is uneven in k (a kernel's row tiles)."""
        cost = self.cost
        assert cost is not None
        self._block_accepted *= probability
        self._block_tokens += self._block_accepted
        rate = self._block_tokens / self._seconds(drafted)
        tokens, accepted = self._block_tokens, self._block_accepted
        for longer in range(drafted + 1, max(self._budget, drafted + 1) + 1):
            accepted *= probability
            tokens += accepted
            if tokens / self._seconds(longer) > rate:
                return True
        return False

    def _seconds(self, drafted: int) -> float:
        cost = self.cost
        assert cost is not None
        return drafted * cost.t_draft + cost.verify(drafted) + 2 * cost.t_rtt

    def bind_sampling(self, temperature: float) -> None:
        self.disco.bind_sampling(temperature)

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        if self.calibration is not None and self._predictions:
            self.calibration.observe(self._predictions[:num_drafted], num_accepted)

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        self.disco.on_feedback(num_drafted, num_accepted)
        self.accepted += num_accepted
        self.rejected += 1 if num_accepted < num_drafted else 0


#: ``disco:PATH@tuned``: keep the artifact's tuned threshold although costs are known.
TUNED = "tuned"


def with_costs(spec: str, cost: CostModel | None) -> str:
    """The spec a request runs when the deployment's costs are known (the loop and
    ``disco replay`` both call this): a bare ``auto`` becomes ``auto:COSTS``, a bare
    ``disco:PATH`` becomes ``disco:PATH@COSTS`` (its classifier under the rate rule, the
    module docstring); any other spec, ``disco:PATH@tuned`` included, is unchanged."""
    if cost is None or not reads_costs(spec):
        return spec
    return f"auto:{encode_costs(cost)}" if spec == "auto" else f"{spec}@{encode_costs(cost)}"


def as_served(spec: str, cost: CostModel | None, max_lookahead: int, prompt_tokens: int = 0,
              new_tokens: int = 0) -> str:
    """The spec one request runs, as the loop resolves it (:meth:`SpeculativeGenerator.resolve_auto`):
    a bare ``auto`` where no lookahead can pay by ``cost`` (for a request of ``prompt_tokens`` and
    ``new_tokens``: the draft's prefill included, :func:`speculation_pays`) is ``none``
    (target-only: ``auto`` never runs below it), else :func:`with_costs`. ``disco replay`` replays
    ``auto`` this way."""
    if spec == "auto" and cost is not None and not speculation_pays(cost, max_lookahead, prompt_tokens, new_tokens):
        return "none"
    return with_costs(spec, cost)


def reads_costs(spec: str) -> bool:
    """Whether ``spec`` takes the deployment's costs (:func:`with_costs`), so that they are
    worth measuring for it: a bare ``auto`` or ``disco:PATH``."""
    return spec == "auto" or (spec.startswith("disco:") and "@" not in spec)


def split_disco_argument(spec: str, argument: str) -> tuple[str, CostModel | None]:
    """``PATH[@COSTS|@tuned]`` of a ``disco:`` spec -> (PATH, costs or ``None``); raises
    :class:`InvalidRequest` on malformed costs."""
    path, sep, costs = argument.partition("@")
    if not path:
        raise InvalidRequest(f"malformed policy spec {spec!r}: expected disco:PATH or disco:default")
    if not sep or costs == TUNED:
        return path, None
    cost = decode_costs(spec, costs)
    if cost is None:
        raise InvalidRequest(f"malformed policy spec {spec!r}: expected disco:PATH[@tuned|@td=MS,tv=MS/...,rtt=MS]")
    return path, cost


def auto_factory(spec: str, argument: str, disco_factory: Callable[[], StopPolicy],
                 calibration: AcceptanceCalibration | None = None) -> Callable[[], StopPolicy]:
    """Per-session :class:`AutoPolicy` factory for the spec ``auto[:costs]``."""
    cost = decode_costs(spec, argument)
    return lambda: AutoPolicy(disco_factory(), cost, calibration)
