"""Training DISCO: examples from replay, classifiers, threshold tuned by replay.

1. **Examples.** Reference policies are replayed on the training records
   (:mod:`disco.offline.replay`) with an observer that runs the SAME
   :class:`~disco.speculation.features.FeatureExtractor` as the live policy; every draft token gives
   one feature vector and three labels: ``current`` (the block so far, this token
   included, is accepted), ``next`` (so is the next draft token) and ``conditional``
   (this token is accepted; only for tokens whose block prefix was accepted, -1 else).
   Tokens replayed beyond the records' horizon (proxy signals) are left out. After a
   first fit, one DAgger round replays the DISCO policy itself and adds its own states,
   so the session/block features match what it sees live.
2. **Classifiers** (:mod:`disco.offline.classifiers`, scikit-learn): logistic regression, a small
   MLP and histogram gradient boosting, each calibrated (Platt scaling of its
   cross-validated raw score, folds grouped by prompt) and compiled to plain arrays
   (:class:`~disco.speculation.policies.learned.CompiledClassifier`).
3. **Choice and threshold by replay speed** (cross-validated over train + validation, or
   on the validation split): for every (classifier, label, decision rule — see
   :mod:`disco.speculation.policies.stop_rules`) the stop threshold is swept by replay under the cost
   model; the winner is the highest simulated speedup (of a 3-point moving average over
   the threshold grid, so a lone lucky threshold does not win) — not the best accuracy.
   ``disco tune`` repeats the sweep for another cost model without retraining.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from disco.errors import InvalidRequest
from disco.offline.classifiers import KINDS, Examples, auc, fit_classifier
from disco.offline.datasets import HUMANEVAL, Dataset, load_dataset
from disco.offline.records import OracleRecord, RecordSet
from disco.offline.replay import DEFAULT_REPLAY_LOOKAHEAD, PolicyReplay, replay_policy, summarize, target_only_seconds
from disco.speculation.cost_model import CostModel
from disco.speculation.features import DEFAULT_GROUPS, FEATURE_VERSION, FeatureExtractor, FeatureSpec, Projection
from disco.speculation.policies.learned import LABELS, CompiledClassifier, DiscoArtifact
from disco.speculation.policies.stop_rules import RULES, candidates, threshold_grid
from disco.speculation.signals import TokenSignals

logger = logging.getLogger(__name__)

REFERENCE_POLICIES = ("static:4", "static:8", "static:16", "confidence:0.3", "confidence:0.6")
THRESHOLDS = threshold_grid("token")


# --- 1. examples -----------------------------------------------------------------------------------------


class ExampleCollector:
    """Replay observer: features (by the live extractor) and labels per draft token."""

    def __init__(self, record: OracleRecord, spec: FeatureSpec, projection: Projection | None) -> None:
        self.record = record
        self.extractor = FeatureExtractor(spec, projection, temperature=record.temperature)
        self.rows: list[np.ndarray] = []
        self.current: list[int] = []
        self.next: list[int] = []
        self.conditional: list[int] = []
        self._prefix_alive = True

    def begin_block(self) -> None:
        self.extractor.begin_block()
        self._prefix_alive = True

    def token(self, position: int, token_id: int, signals: TokenSignals, index: int, alive: bool,
              exact: bool) -> None:
        x = self.extractor.token(position, signals)
        prefix_alive, self._prefix_alive = self._prefix_alive, alive
        if not exact:
            return
        matches = self.record.matches
        self.rows.append(x)
        self.current.append(int(alive))
        self.conditional.append(int(alive) if prefix_alive else -1)
        self.next.append(int(alive and index + 1 < len(matches) and bool(matches[index + 1])))

    def feedback(self, num_drafted: int, num_accepted: int) -> None:
        self.extractor.feedback(num_drafted, num_accepted)


def prompt_groups(records: RecordSet) -> np.ndarray:
    """``[records]`` int64: one group per prompt id, so a prompt's greedy and sampled records
    always fall in the same fold (no prompt judges a classifier that trained on it)."""
    order: dict[str, int] = {}
    return np.asarray([order.setdefault(r.id, len(order)) for r in records.records], dtype=np.int64)


def collect_examples(records: RecordSet, builders: dict[str, Callable], spec: FeatureSpec,
                     projection: Projection | None, max_lookahead: int) -> Examples:
    """Replay each policy (name -> per-record builder) and collect every draft token
    (examples grouped by prompt: :func:`prompt_groups`)."""
    record_group = prompt_groups(records)
    rows, current, nxt, conditional, groups = [], [], [], [], []
    for name, build in builders.items():
        collectors: list[ExampleCollector] = []
        it = iter(range(len(records.records)))

        def observer_factory():
            collector = ExampleCollector(records.records[next(it)], spec, projection)
            collectors.append(collector)
            return collector
        replay_policy(records, build, max_lookahead, name=name, observer_factory=observer_factory,
                      with_hidden=spec.needs_hidden)
        for index, collector in enumerate(collectors):
            rows.extend(collector.rows)
            current.extend(collector.current)
            nxt.extend(collector.next)
            conditional.extend(collector.conditional)
            groups.extend([int(record_group[index])] * len(collector.rows))
    width = len(spec.names)
    return Examples(x=np.asarray(rows, dtype=np.float64).reshape(-1, width),
                    labels={"current": np.asarray(current, dtype=np.int64), "next": np.asarray(nxt, dtype=np.int64),
                            "conditional": np.asarray(conditional, dtype=np.int64)},
                    groups=np.asarray(groups, dtype=np.int64))


def reference_builders(records: RecordSet, policies: Sequence[str] = REFERENCE_POLICIES) -> dict[str, Callable]:
    from disco.offline.replay import policy_builder  # noqa: PLC0415

    return {spec: policy_builder(spec, eos_token_ids=records.eos_token_ids) for spec in policies}


def fit_projection(records: RecordSet, dims: int) -> Projection:
    hidden = [r.hidden for r in records.records if r.hidden is not None]
    hidden += [r.branch_hidden for r in records.records if r.branch_hidden is not None and len(r.branch_hidden)]
    if not hidden:
        raise InvalidRequest("hidden-state features need records computed with hidden states (omit --no-hidden)")
    return Projection.fit_pca(np.concatenate(hidden), dims)


# --- 3. choice and threshold by replay -------------------------------------------------------------------


def build_artifact(classifier: CompiledClassifier, spec: FeatureSpec, projection: Projection | None, label: str,
                   threshold: float, metadata: dict | None = None, rule: str = "token",
                   cost: CostModel | None = None) -> DiscoArtifact:
    meta = {"threshold": threshold, "label": label, "rule": rule, **(metadata or {})}
    if cost is not None:
        meta["cost_model"] = cost.to_json()  # the gain rule reads it
    return DiscoArtifact(metadata=meta, classifier=classifier, spec=spec, projection=projection)


def replay_artifact(artifact: DiscoArtifact, records: RecordSet, threshold: float, max_lookahead: int,
                    memo: dict | None = None, observer_factory=None) -> PolicyReplay:
    return replay_policy(records, lambda record: artifact.policy(threshold, memo), max_lookahead,
                         name=f"disco(t={threshold:g})", observer_factory=observer_factory)


def sweep_thresholds(artifact: DiscoArtifact, records: RecordSet, cost: CostModel, max_lookahead: int,
                     thresholds: Sequence[float] | None = None, memo: dict | None = None) -> list[dict]:
    """Simulated speedup per threshold of the artifact's rule (predictions memoized)."""
    memo = {} if memo is None else memo
    thresholds = threshold_grid(artifact.rule) if thresholds is None else thresholds
    baseline = target_only_seconds(records, cost)
    return [{"threshold": t, **summarize(replay_artifact(artifact, records, t, max_lookahead, memo), cost, baseline)}
            for t in thresholds]


def best_threshold(curve: list[dict]) -> tuple[float, float]:
    """Threshold with the best 3-point moving-average speedup (ties: the lower threshold)."""
    speeds = np.array([row["speedup"] for row in curve])
    smooth = np.convolve(np.pad(speeds, 1, mode="edge"), np.ones(3) / 3, mode="valid")
    best = int(np.argmax(smooth))
    return float(curve[best]["threshold"]), float(speeds[best])


@dataclass
class TrainResult:
    artifact: DiscoArtifact
    table: list[dict] = field(default_factory=list)
    examples: int = 0


def _row(kind: str, label: str, rule: str, threshold: float) -> dict:
    return {"classifier": kind, "label": label, "rule": rule, "threshold": threshold}


def train_disco(train: RecordSet, validation: RecordSet, cost: CostModel, spec: FeatureSpec = FeatureSpec(),
                kinds: Sequence[str] = KINDS, labels: Sequence[str] = LABELS,
                max_lookahead: int = DEFAULT_REPLAY_LOOKAHEAD, dagger_rounds: int = 1,
                reference_policies: Sequence[str] = REFERENCE_POLICIES, metadata: dict | None = None,
                log: Callable[[str], None] = logger.info, rules: Sequence[str] = RULES) -> TrainResult:
    """Fit every (classifier, label), tune each rule's threshold on validation replay, keep
    the fastest; then DAgger rounds on the winner. Test data never enters here."""
    started = time.perf_counter()
    projection = fit_projection(train, spec.hidden_dims) if spec.needs_hidden else None
    examples = collect_examples(train, reference_builders(train, reference_policies), spec, projection, max_lookahead)
    val_examples = collect_examples(validation, reference_builders(validation, reference_policies), spec,
                                    projection, max_lookahead)
    log(f"{len(examples)} training examples ({examples.labels['current'].mean():.1%} accepted), "
        f"{len(val_examples)} validation examples, {len(spec.names)} features")
    table: list[dict] = []
    best: tuple[float, DiscoArtifact] | None = None

    def evaluate(kind: str, label: str, rule_names: Sequence[str], round_: int, fitted_on: Examples) -> None:
        nonlocal best
        classifier, memo = fit_classifier(kind, fitted_on, label), {}
        val_auc = round(auc(val_examples.labels[label], classifier.probability_batch(val_examples.x)), 4)
        for rule in rule_names:
            artifact = build_artifact(classifier, spec, projection, label, 0.5, rule=rule, cost=cost)
            threshold, speedup = best_threshold(sweep_thresholds(artifact, validation, cost, max_lookahead, memo=memo))
            artifact.metadata["threshold"] = threshold
            table.append({**_row(kind, label, rule, threshold), "val_speedup": round(speedup, 4), "val_auc": val_auc,
                          "round": round_})
            log(f"  {'DAgger round %d: ' % round_ if round_ else ''}{kind:<7} {label:<11} {rule:<10} threshold "
                f"{threshold:.4g}: validation speedup {speedup:.4f}x, AUC {val_auc:.3f}")
            if best is None or speedup > best[0] or (round_ and speedup >= best[0]):
                best = (speedup, artifact)

    for kind in kinds:
        for label in labels:
            evaluate(kind, label, [r for lb, r in candidates([label], rules)], 0, examples)
    assert best is not None
    for round_ in range(1, dagger_rounds + 1):
        chosen = best[1]
        own = collect_examples(train, {"disco": lambda record, a=chosen: a.policy()}, spec, projection,
                               max_lookahead)
        examples = Examples.concat([examples, own])
        evaluate(chosen.classifier.kind, chosen.label, [chosen.rule], round_, examples)
    artifact = best[1]
    artifact.metadata.update(metadata or {})
    artifact.metadata.update({
        "cost_model": cost.to_json(), "max_lookahead": max_lookahead, "validation_speedup": round(best[0], 4),
        "validation_table": table, "feature_version": FEATURE_VERSION,
        "training": {**(artifact.metadata.get("training") or {}), "examples": len(examples),
                     "reference_policies": list(reference_policies), "dagger_rounds": dagger_rounds,
                     "train_prompts": len(train.records), "validation_prompts": len(validation.records),
                     "seconds": round(time.perf_counter() - started, 1)},
    })
    return TrainResult(artifact=artifact, table=table, examples=len(examples))


def train_disco_cv(train: RecordSet, validation: RecordSet, cost: CostModel, spec: FeatureSpec = FeatureSpec(),
                   kinds: Sequence[str] = KINDS, labels: Sequence[str] = LABELS,
                   max_lookahead: int = DEFAULT_REPLAY_LOOKAHEAD, folds: int = 4,
                   reference_policies: Sequence[str] = REFERENCE_POLICIES, metadata: dict | None = None,
                   log: Callable[[str], None] = logger.info, rules: Sequence[str] = RULES) -> TrainResult:
    """Like :func:`train_disco`, but (classifier, label, rule, threshold) are chosen by
    cross-validated replay over the train + validation prompts: each fold's prompts are
    replayed with a classifier fitted on the other folds, simulated seconds are summed
    over all folds per threshold. Every prompt then informs the choice (a 6-prompt
    validation split alone is noisy), and no prompt judges a classifier it trained.
    The final classifier is refitted on all prompts with the chosen rule and threshold."""
    started = time.perf_counter()
    pool = RecordSet(meta=train.meta, records=list(train.records) + list(validation.records), path=train.path)
    projection = fit_projection(pool, spec.hidden_dims) if spec.needs_hidden else None
    examples = collect_examples(pool, reference_builders(pool, reference_policies), spec, projection, max_lookahead)
    record_group = prompt_groups(pool)
    folds = max(2, min(folds, int(record_group.max()) + 1))
    fold_of = record_group % folds  # per record; examples.groups holds the same prompt groups
    log(f"{len(examples)} examples from {len(pool.records)} prompts ({examples.labels['current'].mean():.1%} "
        f"accepted), {len(spec.names)} features, {folds}-fold replay selection")
    pairs = candidates(labels, rules)
    seconds = {(kind, label, rule): np.zeros(len(threshold_grid(rule))) for kind in kinds for label, rule in pairs}
    baseline = 0.0
    for fold in range(folds):
        held = RecordSet(meta=pool.meta, records=[r for r, f in zip(pool.records, fold_of) if f == fold],
                         path=pool.path)
        keep = examples.groups % folds != fold
        part = Examples(x=examples.x[keep], labels={k: v[keep] for k, v in examples.labels.items()},
                        groups=examples.groups[keep])
        baseline += target_only_seconds(held, cost)
        for kind in kinds:
            for label in dict.fromkeys(label for label, _ in pairs):
                classifier, memo = fit_classifier(kind, part, label), {}
                for rule in (r for lb, r in pairs if lb == label):
                    artifact = build_artifact(classifier, spec, projection, label, 0.5, rule=rule, cost=cost)
                    for i, threshold in enumerate(threshold_grid(rule)):
                        replayed = replay_artifact(artifact, held, threshold, max_lookahead, memo)
                        seconds[(kind, label, rule)][i] += replayed.seconds(cost)
            log(f"  fold {fold + 1}/{folds}: {kind} fitted and replayed ({len(held.records)} held-out prompts), "
                f"{time.perf_counter() - started:.0f} s elapsed")
    table, best = [], None
    for (kind, label, rule), totals in seconds.items():
        curve = [{"threshold": t, "speedup": baseline / total} for t, total in zip(threshold_grid(rule), totals)]
        threshold, speedup = best_threshold(curve)
        table.append({**_row(kind, label, rule, threshold), "cv_speedup": round(speedup, 4),
                      "cv_peak_speedup": round(max(row["speedup"] for row in curve), 4)})
        log(f"  {kind:<7} {label:<11} {rule:<10} threshold {threshold:.4g}: cross-validated speedup {speedup:.4f}x")
        if best is None or speedup > best[0]:
            best = (speedup, kind, label, rule, threshold)
    assert best is not None
    speedup, kind, label, rule, threshold = best
    artifact = build_artifact(fit_classifier(kind, examples, label), spec, projection, label, threshold, rule=rule)
    artifact.metadata.update(metadata or {})
    artifact.metadata.update({
        "cost_model": cost.to_json(), "max_lookahead": max_lookahead, "validation_speedup": round(speedup, 4),
        "selection": f"{folds}-fold cross-validated replay over train + validation prompts",
        "validation_table": table, "feature_version": FEATURE_VERSION,
        "training": {**(artifact.metadata.get("training") or {}), "examples": len(examples),
                     "reference_policies": list(reference_policies), "dagger_rounds": 0,
                     "train_prompts": len(train.records), "validation_prompts": len(validation.records),
                     "seconds": round(time.perf_counter() - started, 1)},
    })
    log(f"  chose {kind} {label} {rule} threshold {threshold:.4g} ({speedup:.4f}x cross-validated)")
    return TrainResult(artifact=artifact, table=table, examples=len(examples))


def retune(artifact: DiscoArtifact, validation: RecordSet, cost: CostModel, max_lookahead: int) -> tuple[float, float]:
    """New threshold of the artifact's rule for another cost model (or RTT), no retraining."""
    artifact.metadata["cost_model"] = cost.to_json()  # first: the gain rule prices tokens with it
    threshold, speedup = best_threshold(sweep_thresholds(artifact, validation, cost, max_lookahead))
    artifact.metadata.update(threshold=threshold, validation_speedup=round(speedup, 4), max_lookahead=max_lookahead)
    return threshold, speedup


# --- CLI glue --------------------------------------------------------------------------------------------


def split_datasets(dataset_spec: str, limit: int | None, validation_spec: str | None,
                   validation_limit: int | None) -> tuple[Dataset, Dataset | None, bool]:
    """(train dataset, validation dataset or None to hold out the last 25%, is HumanEval)."""
    name = dataset_spec.partition(":")[0]
    is_humaneval = name == HUMANEVAL and not Path(dataset_spec).exists()
    train_spec = f"{HUMANEVAL}:train" if dataset_spec == HUMANEVAL else dataset_spec
    if is_humaneval and train_spec.endswith((":validation", ":test")):
        raise InvalidRequest("train on humaneval or humaneval:train; validation and test are held out")
    train = load_dataset(train_spec, limit)
    if validation_spec is None and is_humaneval:
        validation_spec = f"{HUMANEVAL}:validation"
    validation = load_dataset(validation_spec, validation_limit) if validation_spec else None
    return train, validation, is_humaneval


def _split(pair_records, train_ds: Dataset, val_ds: Dataset | None, record_config) -> tuple[RecordSet, RecordSet]:
    train = pair_records.get(train_ds, record_config)
    if val_ds is not None:
        return train, pair_records.get(val_ds, record_config)
    cut = max(1, len(train.records) * 3 // 4)
    if cut >= len(train.records):
        raise InvalidRequest("need at least 2 prompts to hold out a validation part (or pass --validation)")
    return (RecordSet(meta=train.meta, records=train.records[:cut], path=train.path),
            RecordSet(meta=train.meta, records=train.records[cut:], path=train.path))


def run_train_command(args: argparse.Namespace, pair_records, record_configs: Sequence, cost: CostModel) -> int:
    """``disco train``: records at each of ``record_configs`` (greedy and sampled
    temperatures) pooled, the same prompts held out of every one."""
    from disco.offline.records import merge  # noqa: PLC0415

    train_ds, val_ds, _ = split_datasets(args.dataset, args.limit, args.validation, args.validation_limit)
    splits = [_split(pair_records, train_ds, val_ds, config) for config in record_configs]
    train, validation = merge([t for t, _ in splits]), merge([v for _, v in splits])
    record_config = record_configs[0]
    groups = tuple(args.groups.split(",")) if args.groups else DEFAULT_GROUPS
    spec = FeatureSpec(groups=groups, hidden_dims=args.hidden_dims if "hidden" in groups else 0)
    kinds = tuple(k.strip() for k in args.models.split(",") if k.strip())
    labels = LABELS if args.label == "auto" else (args.label,)
    rules = RULES if getattr(args, "rule", "auto") == "auto" else (args.rule,)
    candidates(labels, rules)  # refuse an impossible combination before any work
    max_lookahead = args.max_lookahead or DEFAULT_REPLAY_LOOKAHEAD
    metadata = {
        "draft": {**train.meta["draft"], "name": args.draft or "default pair draft (Qwen2.5-Coder-0.5B-Instruct)"},
        "target": {**train.meta["target"], "name": args.target or "default pair target (Qwen2.5-Coder-1.5B-Instruct)"},
        "training": {"dataset": train_ds.name, "validation_dataset": val_ds.name if val_ds else "held-out 25%",
                     "max_new_tokens": record_config.max_new_tokens, "horizon": record_config.horizon,
                     "temperatures": [config.temperature for config in record_configs],
                     "command": "disco " + " ".join(sys.argv[1:]) if "train" in sys.argv[1:] else None},
    }
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.select == "cv":
        result = train_disco_cv(train, validation, cost, spec, kinds, labels, max_lookahead, folds=args.folds,
                                metadata=metadata, log=log, rules=rules)
    else:
        result = train_disco(train, validation, cost, spec, kinds, labels, max_lookahead,
                             dagger_rounds=args.dagger_rounds, metadata=metadata, log=log, rules=rules)
    result.artifact.save(args.out)
    summary = {"out": str(args.out), "classifier": result.artifact.classifier.kind, "label": result.artifact.label,
               "rule": result.artifact.rule, "threshold": result.artifact.threshold,
               "validation_speedup": result.artifact.metadata["validation_speedup"],
               "examples": result.examples, "features": list(spec.names), "table": result.table}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {summary['classifier']} ({summary['label']}, rule {summary['rule']}), "
              f"threshold {summary['threshold']:.4g}, "
              f"validation speedup {summary['validation_speedup']:.4f}x under {cost.source}")
    return 0


def run_tune_command(args: argparse.Namespace, pair_records, record_configs: Sequence | None,
                     cost_from_args) -> int:
    from disco.speculation.policies.learned import read_artifact  # noqa: PLC0415

    artifact = read_artifact(args.artifact)
    stored = artifact.metadata.get("cost_model")
    cost = cost_from_args(args, CostModel.from_json(stored) if stored else None)
    if pair_records is None:
        raise InvalidRequest("disco tune needs --dataset (the validation split to replay, e.g. humaneval:validation)")
    if args.dataset.endswith(":test"):
        raise InvalidRequest("tune on a validation split, never on test")
    from disco.offline.records import merge  # noqa: PLC0415

    dataset = load_dataset(args.dataset, args.limit)
    validation = merge([pair_records.get(dataset, config) for config in record_configs or ()])
    max_lookahead = args.max_lookahead or int(artifact.metadata.get("max_lookahead", DEFAULT_REPLAY_LOOKAHEAD))
    old = artifact.threshold
    threshold, speedup = retune(artifact, validation, cost, max_lookahead)
    artifact.save(args.out)
    print(f"wrote {args.out}: {artifact.rule} rule threshold {old:.4g} -> {threshold:.4g}, "
          f"validation speedup {speedup:.4f}x under {cost.source}")
    return 0
