"""Builders shared by the DISCO test modules (records, hand-made artifacts)."""

from __future__ import annotations

import numpy as np

from disco.offline.datasets import Dataset, PromptItem
from disco.offline.records import RecordConfig, build_records
from disco.speculation.features import FeatureSpec, Projection
from disco.speculation.policies.learned import CompiledClassifier, DiscoArtifact
from tests.helpers import EOS_ID, PROMPTS

MAX_NEW_TOKENS = 40
LOOKAHEAD = 8


def tiny_dataset(prompts=PROMPTS) -> Dataset:
    return Dataset(name="tiny", items=tuple(PromptItem(id=f"p{i}", prompt=p) for i, p in enumerate(prompts)))


def tiny_records(target, draft, tokenizer, horizon=LOOKAHEAD - 1, with_hidden=True, prompts=PROMPTS, home=None,
                 max_new_tokens=MAX_NEW_TOKENS):
    config = RecordConfig(max_new_tokens=max_new_tokens, horizon=horizon, with_hidden=with_hidden)
    identity = {"fingerprint": "tiny-target", "tokenizer_hash": "tiny", "dtype": "float32"}
    draft_identity = {"fingerprint": "tiny-draft", "tokenizer_hash": "tiny", "dtype": "float32"}
    return build_records(target, draft, tokenizer, (EOS_ID,), identity, draft_identity, tiny_dataset(prompts),
                         config, home, progress=False)


def handmade_artifact(spec: FeatureSpec = FeatureSpec(), threshold: float = 0.5, hidden_size: int = 64,
                      label: str = "current", draft_fingerprint: str = "tiny-draft") -> DiscoArtifact:
    """A logistic-regression artifact with fixed weights: P(accept) grows with p1, the
    margin, the block's cumulative confidence and the session's rate, shrinks with position (plus a small
    random hidden-state term when the spec has one)."""
    names = spec.names
    coef = np.zeros(len(names))
    # Scaled for the tiny random models (p1 ~ 0.08-0.4): decisions come out mixed.
    weights = {"p1": 10.0, "margin": 5.0, "cum_log_p1": 0.1, "position": -0.4, "session_rate": 1.0}
    for name, weight in weights.items():
        if name in names:
            coef[names.index(name)] = weight
    rng = np.random.default_rng(0)
    projection = None
    if spec.needs_hidden:
        for i in range(spec.hidden_dims):
            coef[names.index(f"h{i}")] = 0.5 * rng.standard_normal()
        projection = Projection(mean=np.zeros(hidden_size, dtype=np.float32),
                                matrix=rng.standard_normal((hidden_size, spec.hidden_dims)).astype(np.float32) / 8)
    classifier = CompiledClassifier("logreg", {
        "num_features": np.array([len(names)]), "calibration": np.array([1.0, 0.0]),
        "scaler_mean": np.zeros(len(names)), "scaler_scale": np.ones(len(names)),
        "coef": coef, "intercept": np.array([0.0]),
    })
    metadata = {"threshold": threshold, "label": label,
                "draft": {"fingerprint": draft_fingerprint, "tokenizer_hash": None, "name": "tiny"}}
    return DiscoArtifact(metadata=metadata, classifier=classifier, spec=spec, projection=projection)
