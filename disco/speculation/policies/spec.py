"""Policy spec strings (``static:6``, ``confidence:0.4``, ``disco:PATH`` …): parsing,
validation and building a fresh per-session policy object.

Grammar: ``NAME[:ARGS]``. Parsing is pure and cheap so every layer (CLI, orchestrator,
draft service) can validate a spec before doing any work.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from disco.errors import InvalidRequest
from disco.speculation.acceptance_calibration import AcceptanceCalibration
from disco.speculation.policies.auto import AutoPolicy, auto_factory, decode_costs, split_disco_argument
from disco.speculation.policies.base import StopPolicy
from disco.speculation.policies.simple import (
    AdaptiveConfidencePolicy,
    ConfidencePolicy,
    EntropyPolicy,
    HeuristicPolicy,
    OraclePolicy,
    StaticPolicy,
    TargetOnlyPolicy,
)

logger = logging.getLogger(__name__)

#: ``auto``'s stop rule where the DISCO artifact does not fit the draft: confidence at the
#: threshold tuned on the default pair's training prompts (docs/disco.md, 70 + 6 prompts).
AUTO_FALLBACK_CONFIDENCE = 0.8
#: Longest policy spec accepted (characters): real ones are under 100 (a ``disco:`` path
#: included); a cap keeps every message that quotes a spec small (docs/operations.md, "Limits").
MAX_POLICY_SPEC_CHARS = 256


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    syntax: str
    description: str


POLICY_INFOS: tuple[PolicyInfo, ...] = (
    PolicyInfo("none", "none", "target-only autoregressive decoding (the baseline; no draft calls)"),
    PolicyInfo("static", "static:K", "always draft K tokens per iteration"),
    PolicyInfo("heuristic", "heuristic:K0", "HF schedule: start at K0; K += 2 if all accepted, else K = max(1, K-1)"),
    PolicyInfo("confidence", "confidence:T", "stop after a draft token whose top-1 probability < T (HF default 0.4)"),
    PolicyInfo("adaptive-confidence", "adaptive-confidence[:T0]",
               "confidence threshold re-fitted online by ROC (cost fpr + 3*fnr), as HF does"),
    PolicyInfo("entropy", "entropy[:lambda=L,gamma=G,adapt=E,target=A]",
               "AdaEDL-style: stop after a token with 1 - sqrt(gamma*entropy) < lambda"),
    PolicyInfo("disco", "disco:PATH|default[@tuned]",
               "trained DISCO classifier; disco:default is the shipped artifact for the default pair (trained on "
               "the HumanEval train split). Where the deployment's costs are measured its per-token probabilities "
               "drive the rate rule (stop when drafting on no longer raises the expected tokens/s); without "
               "costs, or with @tuned, stop when its statistic < the artifact's tuned threshold"),
    PolicyInfo("auto", "auto",
               "the default: disco:default under the measured engine costs, target-only where speculation "
               "cannot pay (e.g. bf16 on a CPU without bf16 units); confidence:0.8 for a draft the artifact "
               "was not trained for"),
    PolicyInfo("oracle", "oracle", "analysis only: drafts exactly the tokens the target will accept (greedy)"),
)

#: Loads a DISCO artifact and returns a factory of per-session policies.
LearnedPolicyLoader = Callable[[str], Callable[[], StopPolicy]]


@dataclass(frozen=True)
class PolicySpec:
    name: str
    argument: str  # text after the first ':' ('' if none)
    text: str  # the spec as given

    @property
    def uses_draft(self) -> bool:
        return self.name != "none"


def _number(spec: str, text: str, kind: type, low: float, high: float) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise InvalidRequest(f"malformed policy spec {spec!r}: {text!r} is not a valid {kind.__name__}") from None
    if not low <= value <= high:
        raise InvalidRequest(f"malformed policy spec {spec!r}: {value} is outside [{low}, {high}]")
    return value


def _entropy_params(spec: str, argument: str) -> dict[str, float]:
    params: dict[str, float] = {}
    names = {"lambda": "lam", "gamma": "gamma", "adapt": "adapt", "target": "target"}
    for item in filter(None, argument.split(",")):
        key, sep, value = item.partition("=")
        if not sep and not params and key:  # entropy:0.3 is shorthand for lambda=0.3
            key, value = "lambda", key
        if key not in names:
            raise InvalidRequest(
                f"malformed policy spec {spec!r}: unknown entropy parameter {key!r} "
                f"(known: {', '.join(names)})")
        params[names[key]] = _number(spec, value, float, 0.0, 100.0)
    return params


def parse_policy_spec(spec: str) -> PolicySpec:
    """Parse and validate ``spec``; raises :class:`InvalidRequest` with the reason."""
    if len(spec or "") > MAX_POLICY_SPEC_CHARS:
        raise InvalidRequest(f"malformed policy spec: {len(spec)} characters, more than the limit of "
                             f"{MAX_POLICY_SPEC_CHARS} (it starts {spec[:32]!r})")
    text = (spec or "").strip()
    if not text:
        raise InvalidRequest("policy spec is empty (try 'static:6' or see `disco policies`)")
    name, _, argument = text.partition(":")
    parsed = PolicySpec(name=name, argument=argument, text=text)
    if name in ("none", "oracle") and argument:
        raise InvalidRequest(f"malformed policy spec {text!r}: {name} takes no argument")
    elif name in ("static", "heuristic"):
        if not argument:
            raise InvalidRequest(f"malformed policy spec {text!r}: expected {name}:K with an integer K >= 1")
        _number(text, argument, int, 1, 1024)
    elif name == "confidence":
        if not argument:
            raise InvalidRequest(f"malformed policy spec {text!r}: expected confidence:T with T in [0, 1]")
        _number(text, argument, float, 0.0, 1.0)
    elif name == "adaptive-confidence":
        if argument:
            _number(text, argument, float, 0.0, 1.0)
    elif name == "entropy":
        _entropy_params(text, argument)
    elif name == "disco":
        split_disco_argument(text, argument)
    elif name == "auto":
        decode_costs(text, argument)
    elif name not in ("none", "oracle"):
        known = ", ".join(info.syntax for info in POLICY_INFOS)
        raise InvalidRequest(f"unknown policy {name!r} in spec {text!r} (known: {known})")
    return parsed


class PolicyFactory:
    """Builds a fresh :class:`StopPolicy` per session from a spec string.

    ``learned_loader`` resolves ``disco:PATH`` artifacts (and caches them); without one,
    ``disco:`` specs are refused with a clear message.

    One factory serves one draft deployment: with ``calibrate_acceptance`` it keeps an
    :class:`~disco.speculation.acceptance_calibration.AcceptanceCalibration` per artifact,
    shared by the sessions whose rate rule reads it (``auto``, ``disco:PATH@COSTS``), so
    the verdicts of earlier requests recalibrate the classifier for the next ones.
    """

    def __init__(self, learned_loader: LearnedPolicyLoader | None = None, calibrate_acceptance: bool = True) -> None:
        self._learned_loader = learned_loader
        self._calibrate = calibrate_acceptance
        self._calibrations: dict[str, AcceptanceCalibration] = {}
        self._lock = threading.Lock()

    def calibration(self, artifact: str) -> AcceptanceCalibration | None:
        """The deployment's acceptance calibration of ``artifact`` (``None`` when off)."""
        if not self._calibrate:
            return None
        with self._lock:
            return self._calibrations.setdefault(artifact, AcceptanceCalibration())

    def calibration_summaries(self) -> dict[str, dict]:
        """Per artifact: tokens judged and the calibration error before/after (observability)."""
        with self._lock:
            calibrations = dict(self._calibrations)
        return {artifact: calibration.summary() for artifact, calibration in calibrations.items()}

    def _auto_stop_rule(self) -> Callable[[], StopPolicy]:
        """``auto``'s stop decision: the shipped DISCO artifact where it fits this draft,
        else (another model pair, no artifact loader) the training-free confidence rule at
        the threshold tuned on the default pair's training prompts (docs/disco.md)."""
        if self._learned_loader is not None:
            try:
                return self._learned_loader("default")
            except InvalidRequest as error:
                logger.info("auto: %s; using confidence:%g instead", error, AUTO_FALLBACK_CONFIDENCE)
        return lambda: ConfidencePolicy(AUTO_FALLBACK_CONFIDENCE)

    def build(self, spec: str, reference_ids: Sequence[int] | None = None) -> StopPolicy:
        parsed = parse_policy_spec(spec)
        name, argument = parsed.name, parsed.argument
        if name == "none":
            return TargetOnlyPolicy()
        if name == "static":
            return StaticPolicy(int(argument))
        if name == "heuristic":
            return HeuristicPolicy(int(argument))
        if name == "confidence":
            return ConfidencePolicy(float(argument))
        if name == "adaptive-confidence":
            return AdaptiveConfidencePolicy(float(argument) if argument else 0.4)
        if name == "entropy":
            return EntropyPolicy(**_entropy_params(parsed.text, argument))
        if name == "oracle":
            if reference_ids is None:
                raise InvalidRequest("the oracle policy needs the target's reference output (in-process analysis only)")
            return OraclePolicy(reference_ids)
        if name == "auto":
            return auto_factory(parsed.text, argument, self._auto_stop_rule(), self.calibration("default"))()
        if name == "disco":
            if self._learned_loader is None:
                raise InvalidRequest(f"policy {parsed.text!r} needs a trained DISCO artifact, "
                                     "but this drafter has no artifact loader")
            path, cost = split_disco_argument(parsed.text, argument)
            policy = self._learned_loader(path)()
            return AutoPolicy(policy, cost, self.calibration(path)) if cost is not None else policy
        raise AssertionError(f"unhandled policy {name}")  # parse_policy_spec rejects the rest
