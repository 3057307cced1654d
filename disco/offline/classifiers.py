"""DISCO's classifiers: scikit-learn models fitted on replayed draft tokens, Platt-calibrated
on out-of-fold scores (folds grouped by prompt) and compiled to plain arrays
(:class:`~disco.speculation.policies.learned.CompiledClassifier`), so an artifact never holds a pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from disco.errors import InvalidRequest
from disco.speculation.policies.learned import LABELS, CompiledClassifier

KINDS = ("logreg", "mlp", "gbm")


@dataclass
class Examples:
    x: np.ndarray  # [n, features]
    labels: dict[str, np.ndarray]  # label name -> [n] {0, 1}; -1: not an example of that label
    groups: np.ndarray  # [n] prompt index (for grouped folds)

    def __len__(self) -> int:
        return len(self.x)

    @staticmethod
    def concat(parts: Sequence["Examples"]) -> "Examples":
        parts = [p for p in parts if len(p)]
        return Examples(x=np.concatenate([p.x for p in parts]),
                        labels={k: np.concatenate([p.labels[k] for p in parts]) for k in LABELS},
                        groups=np.concatenate([p.groups for p in parts]))




def make_estimator(kind: str):
    from sklearn.ensemble import HistGradientBoostingClassifier  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.neural_network import MLPClassifier  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415
    from sklearn.preprocessing import StandardScaler  # noqa: PLC0415

    if kind == "logreg":
        return make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=3000))
    if kind == "mlp":
        return make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(32, 16), alpha=1e-3,
                                                             max_iter=800, early_stopping=True,
                                                             n_iter_no_change=20, random_state=0))
    if kind == "gbm":
        return HistGradientBoostingClassifier(max_iter=150, learning_rate=0.05, max_leaf_nodes=15,
                                              min_samples_leaf=20, l2_regularization=1.0, random_state=0)
    raise InvalidRequest(f"unknown classifier {kind!r} (known: {', '.join(KINDS)})")


def compile_estimator(kind: str, estimator, num_features: int, calibration: tuple[float, float]) -> CompiledClassifier:
    """Copy a fitted scikit-learn model into plain arrays."""
    arrays: dict[str, np.ndarray] = {"num_features": np.array([num_features]),
                                     "calibration": np.array(calibration, dtype=np.float64)}
    if kind in ("logreg", "mlp"):
        scaler, model = estimator[0], estimator[-1]
        arrays["scaler_mean"], arrays["scaler_scale"] = scaler.mean_, scaler.scale_
        if kind == "logreg":
            arrays["coef"], arrays["intercept"] = model.coef_[0], model.intercept_
        else:
            arrays["layers"] = np.array([len(model.coefs_)])
            for i, (w, b) in enumerate(zip(model.coefs_, model.intercepts_)):
                arrays[f"w{i}"], arrays[f"b{i}"] = w, b
    elif kind == "gbm":
        starts, fields = [], {name: [] for name in ("feature", "threshold", "left", "right", "is_leaf", "value",
                                                    "missing_left")}
        offset = 0
        for predictors in estimator._predictors:  # one list (of one tree) per boosting iteration
            nodes = predictors[0].nodes
            starts.append(offset)
            fields["feature"].append(nodes["feature_idx"])
            fields["threshold"].append(nodes["num_threshold"])
            fields["left"].append(nodes["left"])
            fields["right"].append(nodes["right"])
            fields["is_leaf"].append(nodes["is_leaf"])
            fields["value"].append(nodes["value"])
            fields["missing_left"].append(nodes["missing_go_to_left"])
            offset += len(nodes)
        arrays["baseline"] = np.ravel(estimator._baseline_prediction)[:1].astype(np.float64)
        arrays["tree_starts"] = np.asarray(starts, dtype=np.int64)
        for name, parts in fields.items():
            arrays[f"node_{name}"] = np.concatenate(parts)
    else:
        raise InvalidRequest(f"unknown classifier {kind!r}")
    return CompiledClassifier(kind, arrays)


def raw_score(kind: str, estimator, x: np.ndarray) -> np.ndarray:
    if kind == "logreg":
        return estimator.decision_function(x)
    if kind == "gbm":
        return estimator.decision_function(x)
    p = np.clip(estimator.predict_proba(x)[:, 1], 1e-12, 1 - 1e-12)
    return np.log(p / (1 - p))


def fit_classifier(kind: str, examples: Examples, label: str, folds: int = 3) -> CompiledClassifier:
    """Fit on all examples; Platt-calibrate on out-of-fold raw scores (folds by prompt)."""
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    # NOTE: one thread: OpenMP/BLAS worker threads spin, and on a shared small CPU that
    # makes gradient boosting ~20x slower than single-threaded on these small data sets.
    with threadpool_limits(1):
        return _fit_classifier(kind, examples, label, folds)


def _fit_classifier(kind: str, examples: Examples, label: str, folds: int) -> CompiledClassifier:
    from sklearn.base import clone  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.model_selection import GroupKFold  # noqa: PLC0415

    keep = examples.labels[label] >= 0
    x, y, groups = examples.x[keep], examples.labels[label][keep], examples.groups[keep]
    if len(np.unique(y)) < 2:
        raise InvalidRequest(f"training examples have only one class for label {label!r}; use more prompts")
    base = make_estimator(kind)
    out_of_fold = np.zeros(len(y))
    splits = min(folds, len(np.unique(groups)))
    if splits >= 2:
        for train_idx, test_idx in GroupKFold(n_splits=splits).split(x, y, groups):
            if len(np.unique(y[train_idx])) < 2:
                out_of_fold[test_idx] = 0.0
                continue
            model = clone(base).fit(x[train_idx], y[train_idx])
            out_of_fold[test_idx] = raw_score(kind, model, x[test_idx])
        platt = LogisticRegression(C=1e4, max_iter=1000).fit(out_of_fold[:, None], y)
        calibration = (float(platt.coef_[0, 0]), float(platt.intercept_[0]))
    else:
        calibration = (1.0, 0.0)
    estimator = clone(base).fit(x, y)
    return compile_estimator(kind, estimator, x.shape[1], calibration)


def auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score  # noqa: PLC0415

    keep = y >= 0
    return float(roc_auc_score(y[keep], p[keep])) if len(np.unique(y[keep])) == 2 else float("nan")
