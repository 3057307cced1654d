"""CUDA graphs of the static step (issue 40, item 2): each bucket's fixed-shape forward
captured once, replayed per step, so a step costs one graph launch instead of ~15 kernel
launches per layer.

:class:`GraphedStep` captures :meth:`disco.engines.static_step.StaticStep.compute` (inputs
read from the step's buffers, caches written in place, logits into a buffer of the graph's
pool) and replays it after :meth:`~disco.engines.static_step.StaticStep.fill`. The replay
runs the captured kernels on the same addresses, so its logits are the eager step's bit for
bit (``tests/test_gpu.py`` checks it). :func:`capture_buckets` captures every bucket, with
progress, and reports the time and the device memory the graphs took (memory the KV budget
must count besides :attr:`disco.engines.static_step.StaticCaches.nbytes`).

Capture runs the step (warm-up and capture write keys and values of slots ``0 ..
sessions-1`` at the positions their lengths give), so it happens at service start, before
any session holds a slot. NOTE: written without a GPU at hand; not run yet (docs/engines.md,
"Static step and CUDA graphs").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from disco.engines.static_step import Bucket, SlotRows, StaticStep

logger = logging.getLogger(__name__)

#: Eager runs of a step before its capture (lazy initialisations, cuBLAS workspaces).
WARMUP_RUNS = 2


class GraphedStep:
    """One bucket's step as a CUDA graph (module doc)."""

    def __init__(self, step: StaticStep, pool=None) -> None:
        if step.tokens.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA step, this one is on {step.tokens.device}")
        self.step = step
        side = torch.cuda.Stream(step.tokens.device)
        side.wait_stream(torch.cuda.current_stream(step.tokens.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step.compute()
        torch.cuda.current_stream(step.tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool):
            self.logits = step.compute()  # [sessions, block, vocab], in the graph's pool

    @property
    def pool(self):
        return self.graph.pool()

    @torch.inference_mode()
    def forward(self, rows: Sequence[SlotRows]) -> list[torch.Tensor]:
        """:meth:`StaticStep.forward` by a replay of the graph."""
        self.step.fill(rows)
        self.graph.replay()
        return self.step.read(self.logits, rows)


@dataclass(frozen=True)
class CaptureReport:
    graphs: int
    seconds: float
    memory_bytes: int  # device memory allocated by the graphs' pool and outputs

    def describe(self) -> str:
        return f"{self.graphs} CUDA graphs captured in {self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB"


def capture_buckets(steps: Iterable[StaticStep], progress: bool = True) -> tuple[dict[Bucket, GraphedStep], CaptureReport]:
    """Capture every step (one per bucket), sharing one memory pool; logs progress."""
    steps = list(steps)
    graphed: dict[Bucket, GraphedStep] = {}
    if not steps:
        return graphed, CaptureReport(0, 0.0, 0)
    device = steps[0].tokens.device
    torch.cuda.synchronize(device)
    before, started, pool = torch.cuda.memory_allocated(device), time.perf_counter(), None
    for index, step in enumerate(steps):
        graph = GraphedStep(step, pool)
        pool = graph.pool
        graphed[step.bucket] = graph
        if progress:
            logger.info("captured the CUDA graph of %d sessions x %d tokens (%d of %d)", step.bucket.sessions,
                        step.bucket.block, index + 1, len(steps))
    torch.cuda.synchronize(device)
    report = CaptureReport(len(graphed), time.perf_counter() - started, torch.cuda.memory_allocated(device) - before)
    logger.info("%s", report.describe())
    return graphed, report
