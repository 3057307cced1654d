"""Wall time that means what the device did: on CUDA, kernels run asynchronously, so a
timer read without waiting for the device measures only the Python that queued them.

Every engine-cost, live-cost and cost-model timer reads :func:`now` with the device it
times; on a CPU it is ``time.perf_counter`` (the work is already done when the call
returns), on CUDA it first waits for the device's queued kernels
(``torch.cuda.synchronize``).
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` has finished the work queued on it (a no-op off CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after the device's queued work is done (seconds)."""
    synchronize(device)
    return time.perf_counter()


def now_ns(device: torch.device | str | None = None) -> int:
    """:func:`now` in integer nanoseconds (``time.perf_counter_ns``)."""
    synchronize(device)
    return time.perf_counter_ns()
