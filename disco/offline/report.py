"""The paper-style replay report (``disco report``): every policy family on the test
split, training-free baselines tuned on the tuning split, DISCO, the oracle, and the
oracle-vs-static lookahead plot (DISCO paper, Fig. 1).

Nothing is tuned on the test split: the "tuned" static K, confidence and entropy
thresholds, and DISCO's threshold (when the cost model differs from the artifact's) are
chosen by replay on the tuning records only. "Best static" is also reported in
hindsight (best K on the test split), the paper's comparison point.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from disco.offline.records import RecordSet
from disco.offline.replay import DEFAULT_REPLAY_LOOKAHEAD, PolicyReplay, replay_policy, summarize, target_only_seconds
from disco.speculation.cost_model import CostModel

STATIC = tuple(f"static:{k}" for k in range(1, 13))
CONFIDENCE = tuple(f"confidence:{t / 20:g}" for t in range(1, 20))
ENTROPY = tuple(f"entropy:{t / 10:g}" for t in range(1, 10))
FIXED = ("heuristic:2", "heuristic:5", "confidence:0.4", "adaptive-confidence", "entropy",
         "entropy:lambda=0.4,adapt=0.05")


def _rows(records: RecordSet, builders: dict, cost: CostModel, max_lookahead: int) -> list[dict]:
    baseline = target_only_seconds(records, cost)
    return [summarize(replay_policy(records, build, max_lookahead, name=name), cost, baseline)
            for name, build in builders.items()]


def _best(rows: list[dict], prefix: str) -> dict:
    family = [row for row in rows if row["policy"].startswith(prefix)]
    return max(family, key=lambda row: row["speedup"])


def paper_report(test: RecordSet, tune: RecordSet, cost: CostModel, artifact=None,
                 max_lookahead: int = DEFAULT_REPLAY_LOOKAHEAD) -> dict:
    """Replay table on ``test`` plus the headline comparisons (see the module docstring)."""
    from disco.offline.training import retune  # noqa: PLC0415

    tuned_rows = _rows(tune, {spec: spec for spec in STATIC + CONFIDENCE + ENTROPY}, cost, max_lookahead)
    tuned = {family: _best(tuned_rows, family)["policy"] for family in ("static:", "confidence:", "entropy:")}
    disco_name, disco_threshold = None, None
    builders: dict = {spec: spec for spec in ("none",) + STATIC + FIXED + CONFIDENCE}
    for spec in tuned.values():
        builders.setdefault(spec, spec)
    if artifact is not None:
        stored = artifact.metadata.get("cost_model")
        if stored is None or CostModel.from_json(stored) != replace(cost, extra={}):
            artifact = _copy(artifact)
            retune(artifact, tune, cost, max_lookahead)
        disco_threshold = artifact.threshold
        disco_name = (f"disco ({artifact.classifier.kind}, {artifact.label}, {artifact.rule}, "
                      f"t={disco_threshold:.3g})")
        builders[disco_name] = lambda record, a=artifact: a.policy()
    builders["oracle"] = "oracle"
    rows = _rows(test, builders, cost, max_lookahead)
    by_name = {row["policy"]: row for row in rows}
    best_static = _best(rows, "static:")
    summary = {
        "best_static_hindsight": best_static["policy"], "best_static_speedup": best_static["speedup"],
        "static_tuned": tuned["static:"], "static_tuned_speedup": by_name[tuned["static:"]]["speedup"],
        "confidence_tuned": tuned["confidence:"], "confidence_tuned_speedup": by_name[tuned["confidence:"]]["speedup"],
        "confidence_hindsight": _best(rows, "confidence:")["policy"],
        "confidence_hindsight_speedup": _best(rows, "confidence:")["speedup"],
        "entropy_tuned": tuned["entropy:"], "entropy_tuned_speedup": by_name[tuned["entropy:"]]["speedup"],
        "oracle_speedup": by_name["oracle"]["speedup"],
    }
    if disco_name:
        d = by_name[disco_name]["speedup"]
        gain = summary["oracle_speedup"] - summary["best_static_speedup"]
        summary.update({
            "disco": disco_name, "disco_threshold": disco_threshold, "disco_speedup": d,
            "disco_vs_best_static": round(d / summary["best_static_speedup"], 4),
            "disco_vs_tuned_confidence": round(d / summary["confidence_tuned_speedup"], 4),
            "disco_vs_hindsight_confidence": round(d / summary["confidence_hindsight_speedup"], 4),
            "disco_share_of_oracle_gain": round((d - summary["best_static_speedup"]) / gain, 4) if gain > 0 else None,
        })
    return {"cost_model": cost.to_json(), "max_lookahead": max_lookahead,
            "test": {"dataset": test.meta.get("dataset"), "prompts": len(test.records),
                     "max_new_tokens": test.max_new_tokens, "horizon": test.horizon},
            "tune": {"dataset": tune.meta.get("dataset"), "prompts": len(tune.records)},
            "summary": summary, "rows": rows, "tuning_rows": tuned_rows}


def _copy(artifact):
    from disco.speculation.policies.learned import DiscoArtifact  # noqa: PLC0415

    return DiscoArtifact(metadata=dict(artifact.metadata), classifier=artifact.classifier, spec=artifact.spec,
                         projection=artifact.projection, path=artifact.path)


def format_summary(report: dict) -> str:
    s = report["summary"]
    lines = [f"best static (hindsight on test): {s['best_static_hindsight']} {s['best_static_speedup']:.3f}x; "
             f"static tuned on the tuning split: {s['static_tuned']} {s['static_tuned_speedup']:.3f}x",
             f"confidence tuned: {s['confidence_tuned']} {s['confidence_tuned_speedup']:.3f}x; "
             f"best confidence in hindsight: {s['confidence_hindsight']} {s['confidence_hindsight_speedup']:.3f}x",
             f"entropy tuned: {s['entropy_tuned']} {s['entropy_tuned_speedup']:.3f}x; oracle {s['oracle_speedup']:.3f}x"]
    if "disco" in s:
        share = s["disco_share_of_oracle_gain"]
        lines.append(f"{s['disco']}: {s['disco_speedup']:.3f}x = {s['disco_vs_best_static']:.3f}x best static, "
                     f"{s['disco_vs_tuned_confidence']:.3f}x tuned confidence, "
                     f"{'n/a' if share is None else f'{share:.0%}'} of the oracle's gain over best static")
    return "\n".join(lines)


def plot_oracle_lookahead(test: RecordSet, index: int, best_static: int, path: Path,
                          max_lookahead: int = DEFAULT_REPLAY_LOOKAHEAD) -> dict:
    """Oracle lookahead per iteration for one prompt vs the best static lookahead
    (the DISCO paper's Fig. 1), saved as PNG."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    one = RecordSet(meta=test.meta, records=[test.records[index]], path=test.path)
    oracle: PolicyReplay = replay_policy(one, "oracle", max_lookahead)
    lookaheads = oracle.records[0].stats.lookaheads
    figure, axis = plt.subplots(figsize=(9, 3.4), dpi=120)
    axis.bar(range(1, len(lookaheads) + 1), lookaheads, color="#4c72b0", label="oracle lookahead")
    axis.axhline(best_static, color="#dd8452", linestyle="--", label=f"best static lookahead ({best_static})")
    axis.set_xlabel("speculation iteration")
    axis.set_ylabel("draft tokens")
    axis.set_title(f"Oracle vs static lookahead — {test.records[index].id} ({len(lookaheads)} iterations)")
    axis.set_ylim(0, max(lookaheads + [best_static]) * 1.25 + 0.5)
    axis.legend(loc="upper center", ncol=2, fontsize=8, frameon=False)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return {"prompt": test.records[index].id, "oracle_lookaheads": lookaheads, "best_static": best_static}


def plot_threshold_curves(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    """Speedup vs threshold (one line per policy family) — e.g. DISCO vs confidence."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    for name, curve in curves.items():
        axis.plot([row["threshold"] for row in curve], [row["speedup"] for row in curve], label=name)
    axis.set_xlabel("threshold")
    axis.set_ylabel("simulated speedup")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
