"""The forward costs a serving engine observes: seconds per forward by rows, while it serves.

The calibration (:mod:`disco.engines.engine_costs`) measures one session's forwards once, at
start; a busy first start, a drifting machine or concurrent load make it wrong for the
forwards the engine actually runs (issue 29). :class:`LiveCosts` keeps, for every row count
of a decoding or verification forward (the new tokens of all sessions packed into it), an
exponentially decaying average of the wall seconds observed: the first observation sets
it, each later one moves it by :attr:`LiveCosts.weight` (0.25: a level change is followed
within a few forwards), an observation above :data:`MAX_JUMP` times the average counted as
that much (one slow outlier moves it at most a quarter of the way to twice its value: on a
2-core Zen 4 the draft's one-row average once read 39 ms against ~23 ms at every other request's
start, and flipped ``auto``'s request to target-only, docs/engines.md).
Prefill forwards are not recorded: their cost is the prompt's, not a step's.

The services report the table in ``Info`` (``live_forward_s``) and ``/metrics``; the
orchestrator's ``auto`` cost model follows it (:func:`disco.speculation.live_model.live_cost_model`).
"""

from __future__ import annotations

import threading

from disco.config import DEFAULT_MAX_LOOKAHEAD
from disco.engines.static_step import SESSION_BUCKETS

#: Row counts tracked: up to the largest packed forward of decoding/verification rows. A
#: forward holds at most ``SESSION_BUCKETS[-1]`` sessions (32: the static step's largest
#: bucket; the batcher packs at most ``disco.engines.batching.DEFAULT_MAX_BATCH``, 16), each
#: with a block of at most the lookahead cap's draft tokens plus the bonus position.
MAX_ROWS = SESSION_BUCKETS[-1] * (DEFAULT_MAX_LOOKAHEAD + 1)
#: How far one observation moves the average.
WEIGHT = 0.25
#: An observation counts as at most this multiple of the average (a sustained slowdown is still
#: followed: each forward may raise the average by up to ``WEIGHT * (MAX_JUMP - 1)``).
MAX_JUMP = 2.0


class LiveCosts:
    """Decaying average of observed forward seconds, by rows in the forward (thread-safe)."""

    def __init__(self, max_rows: int = MAX_ROWS, weight: float = WEIGHT) -> None:
        if max_rows < 1 or not 0.0 < weight <= 1.0:
            raise ValueError(f"need max_rows >= 1 and 0 < weight <= 1, got {max_rows}, {weight}")
        self.max_rows = max_rows
        self.weight = weight
        self._seconds = [0.0] * max_rows  # index rows - 1; 0.0: never observed
        self._lock = threading.Lock()
        self.observations = 0

    def observe(self, rows: int, seconds: float) -> None:
        """Record one forward over ``rows`` new tokens that took ``seconds`` (rows beyond
        :attr:`max_rows` are not tracked)."""
        if not 1 <= rows <= self.max_rows or seconds <= 0:
            return
        with self._lock:
            previous = self._seconds[rows - 1]
            if previous == 0.0:
                self._seconds[rows - 1] = seconds
            else:
                self._seconds[rows - 1] = previous + self.weight * (min(seconds, MAX_JUMP * previous) - previous)
            self.observations += 1

    def seconds_by_rows(self) -> tuple[float, ...]:
        """Seconds per forward over 1, 2, ... rows, up to the largest row count observed
        (0.0 where a row count was not observed)."""
        with self._lock:
            observed = [index for index, value in enumerate(self._seconds) if value > 0.0]
            return tuple(self._seconds[: observed[-1] + 1]) if observed else ()
