"""PNG plots of a benchmark run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_plots(rows: list[dict], traces: dict[str, list[int]], histograms: dict[str, list[int]],
                out_dir: Path, oracle_speedup: float | None = None) -> list[Path]:
    """``oracle_speedup`` (from replay, or the live in-process oracle row) is drawn as a line."""
    paths = [_speedup_bars(rows, out_dir / "speedup.png", oracle_speedup)]
    if traces:
        paths.append(_lookahead_trace(traces, out_dir / "lookahead_trace.png"))
    if histograms:
        paths.append(_lookahead_histograms(histograms, out_dir / "lookahead_hist.png"))
    return paths


def _speedup_bars(rows: list[dict], path: Path, oracle_speedup: float | None) -> Path:
    rows = sorted((r for r in rows if r["policy"] not in ("none", "oracle")), key=lambda r: (r["transport"], r["policy"]))
    oracle = [oracle_speedup] if oracle_speedup else []
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4))
    labels = [f"{r['policy']}\n({r['transport']})" for r in rows]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:blue")
    ax.errorbar(range(len(rows)), [r["speedup"] for r in rows],
                yerr=[[r["speedup"] - r["speedup_min"] for r in rows], [r["speedup_max"] - r["speedup"] for r in rows]],
                fmt="none", color="black", capsize=3)
    for value in oracle:
        ax.axhline(value, color="tab:red", linestyle="--", label=f"oracle {value:.2f}×")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs target-only (same transport)")
    if oracle:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lookahead_trace(traces: dict[str, list[int]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for policy, lookaheads in traces.items():
        ax.step(range(1, len(lookaheads) + 1), lookaheads, where="mid", label=policy)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lookahead (draft tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lookahead_histograms(histograms: dict[str, list[int]], path: Path) -> Path:
    fig, axes = plt.subplots(len(histograms), 1, figsize=(6, 1.6 * len(histograms) + 0.5), sharex=True, squeeze=False)
    top = max((max(v) for v in histograms.values() if v), default=1)
    for ax, (policy, values) in zip(axes[:, 0], histograms.items()):
        ax.hist(values, bins=range(0, top + 2), align="left", rwidth=0.85)
        ax.set_ylabel(policy, rotation=0, ha="right", fontsize=8)
    axes[-1, 0].set_xlabel("lookahead per iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
