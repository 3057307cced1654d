"""The cost model ``auto`` decides with while serving: the start-up calibration, corrected
by the forward costs the services observe, at the deployment's current load (issue 29).

Two corrections of the calibrated :class:`~disco.speculation.cost_model.CostModel`:

* **Live costs.** Each service reports the seconds of the forwards it ran, by rows
  (:mod:`disco.engines.live_costs`). A row count observed is taken as observed; one not
  observed yet is the calibration's value scaled by the median ratio observed/calibrated
  over the row counts that were observed: a calibration taken on a busy machine (10x too
  high) or a machine that got slower is corrected by the first few forwards, at every
  row count. A draft with no forward observed yet is scaled by the target's ratio.
* **Load.** With ``n`` sessions in flight the services pack their forwards: a drafting
  step of every session is one draft forward over ``n`` rows, a verification of blocks of
  ``k`` tokens one target forward over ``n * (k + 1)`` rows, and a target-only step one
  over ``n`` rows. The model for one request at concurrency ``n`` is therefore
  ``t_draft = D(n)``, ``t_verify[k] = T(n * (k + 1))`` (``D``/``T``: seconds by rows of the
  draft and the target); maximising each session's tokens per second under it maximises
  the deployment's (all sessions alike), so blocks shrink and speculation stops as the
  batch grows, where a verification row is no longer nearly free.

The calibration measures one session's target forwards over 1..K+1 new tokens (``T`` at
those rows, extrapolated linearly beyond) and the draft at one row; the draft's curve by
rows is assumed to have the target's shape (``D(r) = t_draft * T(r) / T(1)``) until rows
are observed. Limits: a request keeps the model it started with (the spec carries it to
the draft side); sessions of other policies in the same batch are counted alike.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

from disco.speculation.cost_model import CostModel


def observed_ratio(calibrated: Callable[[int], float], live: Sequence[float]) -> float | None:
    """The median ratio observed/calibrated over the row counts observed (``None``: none)."""
    ratios = [seconds / calibrated(rows) for rows, seconds in enumerate(live, start=1) if seconds > 0]
    return statistics.median(ratios) if ratios else None


def corrected_curve(calibrated: Callable[[int], float], live: Sequence[float],
                    fallback_ratio: float = 1.0) -> Callable[[int], float]:
    """Seconds by rows: ``live[rows - 1]`` where observed (> 0), else ``calibrated(rows)``
    times the median ratio observed/calibrated (``fallback_ratio`` when nothing was observed)."""
    ratio = observed_ratio(calibrated, live)
    scale = fallback_ratio if ratio is None else ratio

    def seconds(rows: int) -> float:
        if rows <= len(live) and live[rows - 1] > 0:
            return live[rows - 1]
        return calibrated(rows) * scale
    return seconds


def live_cost_model(calibrated: CostModel, target_live: Sequence[float], draft_live: Sequence[float],
                    sessions: int = 1) -> CostModel:
    """The cost model of one request among ``sessions`` in flight (module docstring), from the
    calibration and the services' observed seconds by rows (``*_live[rows - 1]``, 0: not seen)."""
    sessions = max(1, int(sessions))
    target_calibrated = lambda rows: calibrated.verify(rows - 1)  # noqa: E731 - verify(k): k + 1 rows
    draft_calibrated = lambda rows: calibrated.t_draft * target_calibrated(rows) / target_calibrated(1)  # noqa: E731
    target = corrected_curve(target_calibrated, target_live)
    # A draft not observed yet moves as the target did (a machine slower or faster than
    # calibrated is so for both): mixing a live target with a stale draft would misjudge both.
    draft = corrected_curve(draft_calibrated, draft_live, observed_ratio(target_calibrated, target_live) or 1.0)
    if not any(v > 0 for v in target_live) and not any(v > 0 for v in draft_live) and sessions == 1:
        return calibrated
    observed = "live" if any(v > 0 for v in (*target_live, *draft_live)) else "calibrated"
    # The draft's prefill moves as its forwards do (no live prefill is observed: a prefill's
    # cost is its prompt's, not a step's).
    prefill_scale = draft(sessions) / calibrated.t_draft if calibrated.t_draft > 0 else 1.0
    return CostModel(t_draft=draft(sessions), t_draft_prefill=calibrated.t_draft_prefill * prefill_scale,
                     draft_prefill_window=calibrated.draft_prefill_window,
                     t_verify=tuple(target(sessions * (k + 1)) for k in range(len(calibrated.t_verify))),
                     t_rtt=calibrated.t_rtt, source=f"{calibrated.source}, {observed}, {sessions} session(s)",
                     extra={**calibrated.extra, "sessions": sessions})
