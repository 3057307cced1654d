"""DISCO features: what the stop classifier sees after each draft token.

One :class:`FeatureExtractor` per session turns the draft's per-token signals
(:class:`disco.speculation.signals.TokenSignals`) plus the session's drafting state into a fixed,
versioned vector. The SAME class runs inside the live drafting loop
(:class:`disco.speculation.policies.learned.DiscoPolicy`) and in offline replay, where training
examples are collected (:mod:`disco.offline.training`), so training and serving features cannot
drift apart.

Feature groups (``FEATURE_VERSION`` 1; names in this order, stored in the artifact):

* ``probs`` — ``p1 … p10`` (top-10 draft probabilities), ``entropy`` (nats),
  ``margin`` (p1 - p2), ``logit_p1`` (log p1/(1-p1), clipped), ``tail`` (1 - Σ top-10);
* ``position`` — ``position`` (0-based in the block), ``is_first``;
* ``block`` — ``cum_log_p1`` (Σ log p1 of the block's tokens so far, this one included:
  a running estimate of the block still being accepted), ``cum_p1`` (its exp),
  ``min_p1`` (smallest p1 in the block so far), ``prev_p1`` and ``prev_entropy`` (the
  previous token of the block; 1 and 0 at the block start);
* ``session`` — ``prev_accepted`` and ``prev_drafted`` (last verification),
  ``prev_full`` (1 if it accepted every draft token), ``session_rate`` (accepted /
  drafted so far, with one prior success and one prior failure);
* ``draw`` — which token was drawn (under sampling the draft draws from its warped
  distribution, and a draw that is not its argmax is accepted about half as often:
  docs/bench/sampling): ``token_prob`` (its raw probability), ``log_token_ratio``
  (log token_prob / p1, 0 for the argmax), ``is_argmax``, ``cum_log_token_prob`` (Σ log
  token_prob over the block so far) and ``temperature`` (the request's; 0 when greedy).
  Under greedy decoding they repeat ``p1``/``cum_log_p1`` and are constant otherwise;
* ``hidden`` — ``h0 … h{d-1}``: the draft's last hidden state, centred and projected
  (PCA fitted on training data, as in SpecDec++); needs the hidden state per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from disco.errors import InvalidRequest
from disco.speculation.signals import TOP_K_SIGNALS, TokenSignals

#: Bump when a feature's definition or order changes; artifacts of another version are refused.
FEATURE_VERSION = 1

GROUPS = ("probs", "position", "block", "session", "draw", "hidden")
DEFAULT_GROUPS = ("probs", "position", "block", "session", "draw")

_GROUP_NAMES: dict[str, tuple[str, ...]] = {
    "probs": tuple(f"p{i + 1}" for i in range(TOP_K_SIGNALS)) + ("entropy", "margin", "logit_p1", "tail"),
    "position": ("position", "is_first"),
    "block": ("cum_log_p1", "cum_p1", "min_p1", "prev_p1", "prev_entropy"),
    "session": ("prev_accepted", "prev_drafted", "prev_full", "session_rate"),
    "draw": ("token_prob", "log_token_ratio", "is_argmax", "cum_log_token_prob", "temperature"),
}
#: A drawn token whose raw probability is within this relative distance of p1 is the argmax.
_ARGMAX_TOLERANCE = 1e-6
_EPS = 1e-6


@dataclass(frozen=True)
class Projection:
    """Centring + linear projection of the draft's hidden state: ``(h - mean) @ matrix``."""

    mean: np.ndarray  # [hidden]
    matrix: np.ndarray  # [hidden, dims]

    @property
    def dims(self) -> int:
        return int(self.matrix.shape[1])

    def apply(self, hidden: np.ndarray) -> np.ndarray:  # [..., hidden] -> [..., dims]
        return (np.asarray(hidden, dtype=np.float32) - self.mean) @ self.matrix

    @staticmethod
    def fit_pca(hidden: np.ndarray, dims: int) -> "Projection":
        """PCA on training hidden states ``[n, hidden]`` (numpy SVD, deterministic)."""
        data = np.asarray(hidden, dtype=np.float64)
        mean = data.mean(axis=0)
        _, _, vt = np.linalg.svd(data - mean, full_matrices=False)
        matrix = vt[:dims].T
        # Deterministic sign: the largest-magnitude entry of each component is positive.
        signs = np.sign(matrix[np.argmax(np.abs(matrix), axis=0), np.arange(matrix.shape[1])])
        return Projection(mean=mean.astype(np.float32), matrix=(matrix * signs).astype(np.float32))


@dataclass(frozen=True)
class FeatureSpec:
    """Which groups are on (fixed order of :data:`GROUPS`) and the hidden projection size."""

    groups: tuple[str, ...] = DEFAULT_GROUPS
    hidden_dims: int = 0  # > 0 exactly when "hidden" is in groups

    def __post_init__(self) -> None:
        unknown = set(self.groups) - set(GROUPS)
        if unknown:
            raise InvalidRequest(f"unknown feature groups {sorted(unknown)} (known: {', '.join(GROUPS)})")
        if ("hidden" in self.groups) != (self.hidden_dims > 0):
            raise InvalidRequest("the hidden feature group needs hidden_dims > 0 (and only it)")
        object.__setattr__(self, "groups", tuple(g for g in GROUPS if g in self.groups))

    @property
    def names(self) -> tuple[str, ...]:
        names: list[str] = []
        for group in self.groups:
            names.extend(_GROUP_NAMES[group] if group != "hidden" else
                         tuple(f"h{i}" for i in range(self.hidden_dims)))
        return tuple(names)

    @property
    def needs_hidden(self) -> bool:
        return "hidden" in self.groups

    def to_json(self) -> dict:
        return {"version": FEATURE_VERSION, "groups": list(self.groups), "hidden_dims": self.hidden_dims,
                "names": list(self.names)}

    @staticmethod
    def from_json(data: dict) -> "FeatureSpec":
        version = data.get("version")
        if version != FEATURE_VERSION:
            raise InvalidRequest(f"DISCO artifact uses feature version {version}, this build computes "
                                 f"version {FEATURE_VERSION}; retrain it with `disco train`")
        spec = FeatureSpec(groups=tuple(data["groups"]), hidden_dims=int(data.get("hidden_dims", 0)))
        if list(spec.names) != list(data.get("names", [])):
            raise InvalidRequest("DISCO artifact's feature names differ from this build's "
                                 f"(version {FEATURE_VERSION}); retrain it with `disco train`")
        return spec


@dataclass
class _BlockState:
    cum_log_p1: float = 0.0
    cum_log_token_prob: float = 0.0
    min_p1: float = 1.0
    prev_p1: float = 1.0
    prev_entropy: float = 0.0


@dataclass
class FeatureExtractor:
    """Per-session feature state. Call :meth:`begin_block`, then :meth:`token` after
    every draft token, then :meth:`feedback` with the verification outcome — exactly
    the :class:`~disco.speculation.policies.base.StopPolicy` call sequence."""

    spec: FeatureSpec = field(default_factory=FeatureSpec)
    projection: Projection | None = None
    temperature: float = 0.0  # the request's sampling temperature (0: greedy); the draw group reads it
    _block: _BlockState = field(default_factory=_BlockState)
    prev_accepted: int = 0
    prev_drafted: int = 0
    prev_full: float = 0.0
    accepted_total: int = 0
    drafted_total: int = 0

    def __post_init__(self) -> None:
        if self.spec.needs_hidden and (self.projection is None or self.projection.dims != self.spec.hidden_dims):
            raise InvalidRequest("hidden-state features need a projection of the declared size")

    def begin_block(self) -> None:
        self._block = _BlockState()

    def token(self, position: int, signals: TokenSignals) -> np.ndarray:
        """Feature vector ``[len(spec.names)]`` of the token just drafted at ``position``."""
        probs = signals.topk_probs
        p1 = float(probs[0])
        block = self._block
        cum_log_p1 = block.cum_log_p1 + math.log(max(p1, _EPS))
        log_token_prob = math.log(max(float(signals.token_prob), _EPS))
        cum_log_token_prob = block.cum_log_token_prob + log_token_prob
        values: list[float] = []
        for group in self.spec.groups:
            if group == "probs":
                clipped = min(max(p1, _EPS), 1 - _EPS)
                values.extend(float(p) for p in probs)
                values += [signals.entropy, p1 - float(probs[1]), math.log(clipped / (1 - clipped)),
                           max(0.0, 1.0 - float(sum(probs)))]
            elif group == "position":
                values += [float(position), 1.0 if position == 0 else 0.0]
            elif group == "block":
                values += [cum_log_p1, math.exp(cum_log_p1), min(block.min_p1, p1), block.prev_p1,
                           block.prev_entropy]
            elif group == "session":
                values += [float(self.prev_accepted), float(self.prev_drafted), self.prev_full,
                           (self.accepted_total + 1) / (self.drafted_total + 2)]
            elif group == "draw":
                is_argmax = float(signals.token_prob) >= p1 * (1 - _ARGMAX_TOLERANCE)
                values += [float(signals.token_prob), min(0.0, log_token_prob - math.log(max(p1, _EPS))),
                           1.0 if is_argmax else 0.0, cum_log_token_prob, float(self.temperature)]
            elif group == "hidden":
                if signals.hidden is None:
                    raise InvalidRequest("hidden-state features need the draft's hidden state per token")
                hidden = signals.hidden
                # NOTE: the drafting loop hands the hidden state over on the host already (numpy,
                # moved with the token's other values in one transfer); a tensor (offline
                # records, or one on a device) is moved here.
                if not isinstance(hidden, np.ndarray):
                    hidden = hidden.detach().float().cpu().numpy()
                assert self.projection is not None
                values.extend(float(v) for v in self.projection.apply(hidden))
        block.cum_log_p1 = cum_log_p1
        block.cum_log_token_prob = cum_log_token_prob
        block.min_p1 = min(block.min_p1, p1)
        block.prev_p1, block.prev_entropy = p1, signals.entropy
        return np.asarray(values, dtype=np.float64)

    def feedback(self, num_drafted: int, num_accepted: int) -> None:
        self.prev_accepted, self.prev_drafted = num_accepted, num_drafted
        self.prev_full = 1.0 if num_drafted > 0 and num_accepted == num_drafted else 0.0
        self.accepted_total += num_accepted
        self.drafted_total += num_drafted


def feature_names(groups: Sequence[str] = DEFAULT_GROUPS, hidden_dims: int = 0) -> tuple[str, ...]:
    return FeatureSpec(tuple(groups), hidden_dims).names
