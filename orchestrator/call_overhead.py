"""What a Draft or Verify call costs the orchestrator beyond the model forwards it runs:
the ``t_rtt`` of ``auto``'s cost model, as observed on the requests this orchestrator served.

``auto`` prices a block of ``k`` draft tokens at ``k * t_draft + t_verify(k) + 2 * t_rtt``
(:mod:`disco.speculation.cost_model`), its forward costs from the services (calibrated at
start, corrected live). ``t_rtt`` was the round trip of an ``Info`` call: a few milliseconds,
while a Verify or Draft call on a 2-core machine cost ~21 ms beyond its forwards (issue 50,
docs/engines.md "auto over gRPC"): serialization, the servicers' threads waking, the batcher's
hand-off, the engines' work around a forward. Priced too low, that per-call cost made ``auto``
choose blocks too short over gRPC (1.46 tokens against ``disco:default``'s 5.2, and 1.061x
against 1.163x none).

So each request served alone (no other request admitted while it ran: under load the calls
also wait for other sessions' forwards, which the live costs' rows price) gives a
sample: its call time left over by the forwards,

    (draft_s - draft_forwards * t_draft) + (verify_s - verify_forward_s)
    --------------------------------------------------------------------
                        draft_calls + target_forwards

with ``t_draft`` the draft's forward cost the model holds (its live value) and
``verify_forward_s`` the forward seconds the target reported per Verify call. The call
overhead is the median of that over the last :data:`WINDOW` such requests (a median: a
process's first request pays one-off costs, lazy allocations and threads starting), and
``auto``'s model takes it as ``t_rtt`` (:meth:`orchestrator.backends.Backends.costs`); until
a request has been observed, the ``Info`` round trip stands. The draft's per-token work beyond
its forward (the stop policy, streaming a token) is counted per call here: a simplification
that prices long blocks slightly too cheap when that work is large.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

from disco.stats import RequestStats

#: Requests whose median is the overhead.
WINDOW = 32


class CallOverhead:
    """The median per-call overhead of the last :data:`WINDOW` requests served alone."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=window)  # a request's seconds beyond forwards per call
        self._lock = threading.Lock()

    def observe(self, stats: RequestStats, t_draft: float) -> None:
        """Add a finished request's calls (``t_draft``: the draft forward's cost in seconds)."""
        calls = stats.draft_calls + stats.target_forwards
        if calls <= 0:
            return
        beyond = (stats.draft_s - stats.draft_forwards * t_draft) + (stats.verify_s - stats.verify_forward_s)
        with self._lock:
            self._samples.append(max(0.0, beyond) / calls)

    def seconds(self) -> float | None:
        """Seconds per call beyond its forwards; ``None`` before any request was observed."""
        with self._lock:
            return statistics.median(self._samples) if self._samples else None

    def requests(self) -> int:
        with self._lock:
            return len(self._samples)
