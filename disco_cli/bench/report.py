"""Benchmark output: the environment, a Markdown table, CSV, JSON and PNG plots."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
from pathlib import Path

COLUMNS = ("policy", "transport", "tokens_per_s", "speedup", "speedup_min", "speedup_max", "identical",
           "mean_first_divergence", "acceptance_rate", "mean_lookahead", "target_forwards", "draft_forwards",
           "generated_tokens", "prompts", "repeats")
# shown only when some row has them (decode rates; the llama.cpp peer's extra measurements)
OPTIONAL_COLUMNS = ("decode_tokens_per_s", "decode_speedup", "verify_call_ms", "verify_forward_ms", "draft_call_ms",
                    "prompt_tokens_per_s", "prompt_tokens", "note")


def columns(rows: list[dict]) -> tuple[str, ...]:
    """:data:`COLUMNS`, plus the optional ones some row has."""
    return COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if any(r.get(c) is not None for r in rows))


def environment(extra: dict) -> dict:
    import torch  # noqa: PLC0415

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo", encoding="utf-8")
                if line.startswith("model name")), platform.processor()) if os.path.exists("/proc/cpuinfo") else ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "mkl_cbwr": os.environ.get("MKL_CBWR"), "python": platform.python_version(), **extra}


def engine_costs(pair, home: Path, loaded: dict | None = None, progress: bool = True) -> dict:
    """Per role, the measured forward costs (:mod:`disco.engines.engine_costs`) of the engine the
    benchmark ran, as JSON (or ``None``).

    Args:
        pair: the resolved :class:`disco.config.PairConfig` (concrete dtypes).
        home: the disco cache folder.
        loaded: ``{"target": LoadedModel, "draft": LoadedModel}`` when the models run in
            this process: measured here if not cached yet.
        progress: show a progress bar while measuring.

    Without ``loaded`` (services started by the benchmark) the costs are read from the
    cache the services filled at startup, for this process's thread count (the newest record,
    whatever forward timed it; nothing is measured, not even the int4 kernel choice).
    """
    import torch  # noqa: PLC0415

    from disco.engines import engine_costs as costs_module  # noqa: PLC0415
    from disco.models.loading import model_fingerprint  # noqa: PLC0415

    result = {}
    for role, config in (("target", pair.target), ("draft", pair.draft)):
        model = (loaded or {}).get(role)
        if model is not None:
            costs = costs_module.measure_loaded(model, config, role, home, progress=progress)
        else:
            fingerprint = model_fingerprint(config, role, home)
            costs = costs_module.read_cached(
                home, fingerprint, config.dtype, config.device, torch.get_num_threads(), None, forward=None,
                kernel=costs_module.cached_kernel(home, config.dtype, config.device)) if fingerprint else None
        result[role] = costs.to_json() if costs is not None else None
    return result


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    shown = columns(rows)
    header = "| " + " | ".join(shown) + " |\n|" + "---|" * len(shown) + "\n"
    ordered = sorted(rows, key=lambda r: (r["transport"], -r["speedup"]))
    return header + "".join("| " + " | ".join(_cell(row.get(c)) for c in shown) + " |\n" for row in ordered)


def write_reports(rows: list[dict], env: dict, json_out: Path | None, report_dir: Path | None,
                  plots: dict | None = None) -> None:
    payload = {"env": env, "rows": rows}
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(payload, indent=2))
    if report_dir:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "bench.json").write_text(json.dumps(payload, indent=2))
        (report_dir / "bench.md").write_text(
            f"# disco bench\n\n`{env.get('command', '')}`\n\n{markdown_table(rows)}\n"
            + "".join(f"- {key}: {value}\n" for key, value in env.items() if key != "command"))
        with open(report_dir / "bench.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns(rows), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        if plots:
            from disco_cli.bench.plots import write_plots  # noqa: PLC0415 - matplotlib is slow to import

            write_plots(rows, plots["traces"], plots["histograms"], report_dir, plots.get("oracle_speedup"))
