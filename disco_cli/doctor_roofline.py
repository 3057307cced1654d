"""The roofline line of ``disco doctor`` and ``disco models calibrate``: each model's measured
forwards against this machine's floors.

The peaks (read bandwidth, the q4 x q8 instruction's int8 peak) are measured once per doctor run
(:func:`disco.engines.roofline.measure_peaks`); per engine the check reads the forward costs the
``costs`` check just measured and says how far the target's one row and the draft's token are
from the bandwidth floor, and at what share of the int8 peak the target's extra verification
rows run (where its linears are the q4 x q8 kernel's). It informs; it fails only when the
measurement itself fails. CPU only (a GPU's roofline is docs/static_step.md's).
"""

from __future__ import annotations

from typing import Sequence

import torch

from disco.engines.roofline import ForwardWork, MachinePeaks, distances, extra_row_fraction, forward_work


def roofline_report(peaks: MachinePeaks, target: torch.nn.Module, draft: torch.nn.Module,
                    target_ms: Sequence[float], draft_ms: float) -> tuple[str, dict]:
    """The check's line and figures from the peaks and the ``costs`` check's milliseconds."""
    return roofline_of_work(peaks, forward_work(target), forward_work(draft), target_ms, draft_ms)


def roofline_of_work(peaks: MachinePeaks, target_work: ForwardWork, draft_work: ForwardWork,
                     target_ms: Sequence[float], draft_ms: float) -> tuple[str, dict]:
    """:func:`roofline_report` from what the models' forwards read and compute (the models
    need not be loaded any more)."""
    target_rows = distances(target_work, peaks, [ms / 1000 for ms in target_ms])
    draft_row = distances(draft_work, peaks, [draft_ms / 1000])[0]
    fraction = extra_row_fraction(target_work, peaks, [ms / 1000 for ms in target_ms])
    extra = (f"; its extra rows at {fraction:.0%} of the int8 peak" if fraction is not None
             else "; extra rows: not on the q4 x q8 kernel" if not target_work.int8_kernel else "")
    detail = (f"{peaks.describe()}; target 1 row {target_rows[0].ratio:.2f}x its floor "
              f"({target_work.weight_bytes / 1e9:.2f} GB){extra}; draft token {draft_row.ratio:.2f}x its floor "
              f"({draft_work.weight_bytes / 1e9:.2f} GB)")
    return detail, {
        "peaks": peaks.to_json(),
        "target": {"weight_bytes": target_work.weight_bytes, "macs_per_row": target_work.macs_per_row,
                   "kernels": list(target_work.kernels), "rows": [d.to_json() for d in target_rows],
                   "extra_row_peak_fraction": None if fraction is None else round(fraction, 3)},
        "draft": {"weight_bytes": draft_work.weight_bytes, "macs_per_row": draft_work.macs_per_row,
                  "kernels": list(draft_work.kernels), "token": draft_row.to_json()}}
