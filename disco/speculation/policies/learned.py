"""``disco:PATH`` / ``disco:default``: the trained DISCO stop policy and its artifact.

DISCO (Mamou et al. 2024, "Dynamic Speculation Lookahead Accelerates Speculative
Decoding of Large Language Models", arXiv 2405.04304): after each draft token a
classifier on the draft's signals estimates the probability that drafting further pays,
and the block ends when it falls below a threshold tuned for speed by replay.

Artifact format (one file, a zip; nothing in it is ever unpickled):

* ``metadata.json`` — format and feature version, feature spec and names, the label the
  classifier predicts (``current``: the block so far, this token included, is accepted;
  ``next``: so is the next token; ``conditional``: this token is accepted given the
  previous ones were), the decision ``rule`` (``token``, ``cumulative`` or ``gain``, see
  :mod:`disco.speculation.policies.stop_rules`; ``token`` when absent) and its tuned ``threshold``,
  the draft/target identities (weights fingerprint, tokenizer hash), the cost model it
  was tuned for, the validation table, how it was trained;
* ``arrays.npz`` — the classifier compiled to plain arrays (``allow_pickle=False``):
  ``logreg`` (standardize + linear), ``mlp`` (standardize + ReLU layers) or ``gbm``
  (gradient-boosted trees as node arrays), then Platt calibration ``sigmoid(a*s + b)``
  of the raw score ``s``; plus the hidden-state projection when used.

Loading refuses another format/feature version, and — when the loader knows the draft
model it will run with — an artifact trained for another draft (fingerprint) or
tokenizer.
"""

from __future__ import annotations

import io
import json
import logging
import math
import threading
import zipfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from disco.errors import InvalidRequest
from disco.speculation.cost_model import CostModel
from disco.speculation.features import FeatureExtractor, FeatureSpec, Projection
from disco.speculation.policies.base import Decision, StopPolicy
from disco.speculation.policies.stop_rules import StopRule
from disco.speculation.signals import TokenSignals

logger = logging.getLogger(__name__)

ARTIFACT_FORMAT = "disco-artifact"
ARTIFACT_FORMAT_VERSION = 1
DEFAULT_ARTIFACT = "default.disco"
LABELS = ("current", "next", "conditional")


class CompiledClassifier:
    """A fitted classifier as plain numpy arrays: ``raw(x)`` is its log-odds score,
    ``probability(x)`` the calibrated P(label = 1)."""

    def __init__(self, kind: str, arrays: dict[str, np.ndarray]) -> None:
        self.kind = kind
        self.arrays = {name: np.asarray(value) for name, value in arrays.items()}
        a = self.arrays
        self.cal_a, self.cal_b = float(a["calibration"][0]), float(a["calibration"][1])
        if kind in ("logreg", "mlp"):
            self.mean, self.scale = a["scaler_mean"].astype(np.float64), a["scaler_scale"].astype(np.float64)
        if kind == "logreg":
            self.coef, self.intercept = a["coef"].astype(np.float64), float(a["intercept"][0])
        elif kind == "mlp":
            count = int(a["layers"][0])
            self.weights = [a[f"w{i}"].astype(np.float64) for i in range(count)]
            self.biases = [a[f"b{i}"].astype(np.float64) for i in range(count)]
        elif kind == "gbm":
            self.baseline = float(a["baseline"][0])
            self.tree_starts = a["tree_starts"].astype(np.int64)
            self.feature = a["node_feature"].astype(np.int64)
            self.threshold = a["node_threshold"].astype(np.float64)
            self.left, self.right = a["node_left"].astype(np.int64), a["node_right"].astype(np.int64)
            self.leaf = a["node_is_leaf"].astype(bool)
            self.value = a["node_value"].astype(np.float64)
            self.missing_left = a["node_missing_left"].astype(bool)
            # Python lists: per-sample traversal is faster on lists than on numpy scalars.
            self._nodes = [(f, t, l, r, leaf, v, m) for f, t, l, r, leaf, v, m in zip(
                self.feature.tolist(), self.threshold.tolist(), self.left.tolist(), self.right.tolist(),
                self.leaf.tolist(), self.value.tolist(), self.missing_left.tolist())]
            self._starts = self.tree_starts.tolist()
        else:
            raise InvalidRequest(f"unknown DISCO classifier kind {kind!r}")

    @property
    def num_features(self) -> int:
        return int(self.arrays["num_features"][0])

    def raw(self, x: np.ndarray) -> float:  # x: [num_features]
        if self.kind in ("logreg", "mlp"):
            return float(self.raw_batch(x[None, :])[0])
        values = x.tolist()
        total = self.baseline
        nodes = self._nodes
        for start in self._starts:
            node = start
            while True:
                feature, threshold, left, right, leaf, value, missing_left = nodes[node]
                if leaf:
                    total += value
                    break
                v = values[feature]
                go_left = missing_left if v != v else v <= threshold
                node = start + (left if go_left else right)
        return total

    def raw_batch(self, x: np.ndarray) -> np.ndarray:  # [n, num_features] -> [n]
        if self.kind == "logreg":
            return ((x - self.mean) / self.scale) @ self.coef + self.intercept
        if self.kind == "mlp":
            h = (x - self.mean) / self.scale
            for i, (w, b) in enumerate(zip(self.weights, self.biases)):
                h = h @ w + b
                if i < len(self.weights) - 1:
                    h = np.maximum(h, 0.0)
            return h[:, 0]
        return np.asarray([self.raw(row) for row in x])

    def probability(self, x: np.ndarray) -> float:
        z = self.cal_a * self.raw(x) + self.cal_b
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def probability_batch(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self.cal_a * self.raw_batch(x) + self.cal_b)))


@dataclass
class DiscoArtifact:
    """A loaded (or freshly trained) DISCO artifact."""

    metadata: dict
    classifier: CompiledClassifier
    spec: FeatureSpec
    projection: Projection | None = None
    path: Path | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def threshold(self) -> float:
        return float(self.metadata["threshold"])

    @property
    def label(self) -> str:
        return str(self.metadata.get("label", "current"))

    @property
    def rule(self) -> str:
        return str(self.metadata.get("rule", "token"))

    def stop_rule(self, threshold: float | None = None) -> StopRule:
        """The decision rule with ``threshold`` (default: the tuned one); ``gain`` reads
        the cost model stored in the metadata."""
        stored = self.metadata.get("cost_model")
        cost = CostModel.from_json(stored) if stored and self.rule == "gain" else None
        return StopRule(self.rule, self.threshold if threshold is None else float(threshold), cost)

    def policy(self, threshold: float | None = None, memo: dict | None = None) -> "DiscoPolicy":
        return DiscoPolicy(self, self.threshold if threshold is None else threshold, memo)

    def factory(self) -> Callable[[], StopPolicy]:
        return lambda: self.policy()

    def check_draft(self, draft_fingerprint: str | None, tokenizer_hash: str | None) -> None:
        """Refuse to run with another draft model or tokenizer than the one trained for."""
        trained = self.metadata.get("draft", {})
        where = f"DISCO artifact {self.path or ''}".strip()
        if tokenizer_hash and trained.get("tokenizer_hash") and trained["tokenizer_hash"] != tokenizer_hash:
            raise InvalidRequest(f"{where} was trained for another tokenizer (hash {trained['tokenizer_hash'][:12]}, "
                                 f"this draft has {tokenizer_hash[:12]}); train one for this pair with `disco train`")
        if draft_fingerprint and trained.get("fingerprint") and trained["fingerprint"] != draft_fingerprint:
            raise InvalidRequest(f"{where} was trained for draft model {trained.get('name', '?')} (fingerprint "
                                 f"{trained['fingerprint']}), not for this draft (fingerprint {draft_fingerprint}); "
                                 "its features would mean something else — train one with `disco train`")

    def save(self, path: Path) -> None:
        arrays = {f"clf_{name}": value for name, value in self.classifier.arrays.items()}
        if self.projection is not None:
            arrays["projection_mean"], arrays["projection_matrix"] = self.projection.mean, self.projection.matrix
        metadata = dict(self.metadata)
        metadata.update(format=ARTIFACT_FORMAT, format_version=ARTIFACT_FORMAT_VERSION,
                        classifier=self.classifier.kind, features=self.spec.to_json())
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("metadata.json", json.dumps(metadata, indent=2, sort_keys=True) + "\n")
            archive.writestr("arrays.npz", buffer.getvalue())
        tmp.replace(path)
        self.metadata, self.path = metadata, path


def read_artifact(path: Path) -> DiscoArtifact:
    """Read and validate an artifact file (no pickle involved)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            metadata = json.loads(archive.read("metadata.json"))
            blob = archive.read("arrays.npz")
    except FileNotFoundError:
        raise InvalidRequest(f"DISCO artifact {path} does not exist") from None
    except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as error:
        raise InvalidRequest(f"{path} is not a DISCO artifact ({error})") from None
    if metadata.get("format") != ARTIFACT_FORMAT:
        raise InvalidRequest(f"{path} is not a DISCO artifact")
    if metadata.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise InvalidRequest(f"DISCO artifact {path} has format version {metadata.get('format_version')}, "
                             f"this build reads version {ARTIFACT_FORMAT_VERSION}")
    spec = FeatureSpec.from_json(metadata.get("features", {}))
    with np.load(io.BytesIO(blob), allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    classifier = CompiledClassifier(
        metadata["classifier"], {name[4:]: value for name, value in arrays.items() if name.startswith("clf_")})
    if classifier.num_features != len(spec.names):
        raise InvalidRequest(f"DISCO artifact {path}: classifier expects {classifier.num_features} features, "
                             f"the feature spec names {len(spec.names)}")
    projection = None
    if spec.needs_hidden:
        projection = Projection(mean=arrays["projection_mean"], matrix=arrays["projection_matrix"])
    if metadata.get("label", "current") not in LABELS:
        raise InvalidRequest(f"DISCO artifact {path}: unknown label {metadata.get('label')!r}")
    artifact = DiscoArtifact(metadata=metadata, classifier=classifier, spec=spec, projection=projection, path=path)
    try:
        artifact.stop_rule()  # a known rule, with the cost model the gain rule needs
    except InvalidRequest as error:
        raise InvalidRequest(f"DISCO artifact {path}: {error}") from None
    return artifact


class DiscoPolicy(StopPolicy):
    """Stop after a draft token when the artifact's rule statistic is below the threshold.

    The classifier's calibrated probability (about the artifact's label) and the block's
    running product of it feed the :class:`~disco.speculation.policies.stop_rules.StopRule`
    (``token``: the probability itself, the original DISCO rule; ``cumulative``: the
    product, SpecDec++; ``gain``: the cost-aware expected gain). Features are computed by
    :class:`~disco.speculation.features.FeatureExtractor` (shared with training); offline replay runs
    this very class.
    """

    needs_signals = True

    def __init__(self, artifact: DiscoArtifact, threshold: float, memo: dict | None = None) -> None:
        self.artifact = artifact
        self.threshold = threshold
        self.rule = artifact.stop_rule(threshold)
        self.needs_hidden = artifact.spec.needs_hidden
        self.features = FeatureExtractor(artifact.spec, artifact.projection)
        self.last_features: np.ndarray | None = None
        self.last_probability: float | None = None
        self.last_statistic: float | None = None
        self._cumulative = 1.0  # product of the block's probabilities so far
        self._memo = memo  # feature bytes -> probability (replay sweeps share one)

    def bind_sampling(self, temperature: float) -> None:
        self.features.temperature = temperature

    def begin_block(self, max_lookahead: int) -> int:
        self.features.begin_block()
        self._cumulative = 1.0
        return max_lookahead

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        assert signals is not None
        x = self.features.token(position, signals)
        if self._memo is not None:
            key = x.tobytes()
            probability = self._memo.get(key)
            if probability is None:
                probability = self._memo[key] = self.artifact.classifier.probability(x)
        else:
            probability = self.artifact.classifier.probability(x)
        self._cumulative *= probability
        statistic = self.rule.statistic(position, probability, self._cumulative)
        self.last_features, self.last_probability, self.last_statistic = x, probability, statistic
        return Decision.STOP if statistic < self.rule.threshold else Decision.CONTINUE

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        self.features.feedback(num_drafted, num_accepted)


_cache: dict[tuple, DiscoArtifact] = {}
_cache_lock = threading.Lock()


def resolve_artifact_path(argument: str) -> Path:
    """``default`` → the artifact shipped in the package; anything else is a path."""
    if argument == "default":
        return Path(str(resources.files("disco") / "artifacts" / DEFAULT_ARTIFACT))
    return Path(argument).expanduser()


def load_artifact(argument: str) -> DiscoArtifact:
    """Load (cached per path, size and mtime) the artifact named by a ``disco:`` argument."""
    path = resolve_artifact_path(argument)
    try:
        stat = path.stat()
    except OSError:
        hint = " (the shipped default artifact is missing from this install)" if argument == "default" else ""
        raise InvalidRequest(f"DISCO artifact {path} does not exist{hint}") from None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        artifact = _cache.get(key)
        if artifact is None:
            artifact = _cache[key] = read_artifact(path)
            logger.info("loaded DISCO artifact %s (%s, label %s, rule %s, threshold %.4g, %d features)", path,
                        artifact.classifier.kind, artifact.label, artifact.rule, artifact.threshold,
                        len(artifact.spec.names))
    return artifact


def load_learned_policy(argument: str, draft_fingerprint: str | None = None,
                        tokenizer_hash: str | None = None) -> Callable[[], StopPolicy]:
    """The :data:`~disco.speculation.policies.spec.LearnedPolicyLoader`: a per-session policy factory.

    With ``draft_fingerprint``/``tokenizer_hash`` (what the drafter runs), an artifact
    trained for another draft model or tokenizer is refused.
    """
    artifact = load_artifact(argument)
    artifact.check_draft(draft_fingerprint, tokenizer_hash)
    return artifact.factory()


def make_learned_loader(draft_fingerprint: str | None = None,
                        tokenizer_hash: str | None = None) -> Callable[[str], Callable[[], StopPolicy]]:
    """A loader bound to the draft model a drafter runs (what services should use)."""
    def loader(argument: str) -> Callable[[], StopPolicy]:
        return load_learned_policy(argument, draft_fingerprint, tokenizer_hash)
    return loader
