"""The static path's steps, one per bucket, run eagerly or as CUDA graphs: the graph runner
(SGLang's ``cuda_graph_runner.py`` as the model; issue 40 item 2, issue 49 item 3).

:class:`StepRunner` owns, for one model's :class:`~disco.engines.static_step.StaticCaches`, the
input buffers (:class:`~disco.engines.static_step.StepInputs`, allocated once at the largest
bucket) and a :class:`~disco.engines.static_step.StaticStep` per bucket, built on first use, or,
after :meth:`StepRunner.capture`, a :class:`GraphedStep` per bucket. :meth:`StepRunner.run` picks
the smallest bucket holding the rows (a bucket counts sessions, whatever their slots), fills the
inputs, runs or replays, and hands out copies of the logits. Slots are not its business:
:mod:`disco.engines.static_runner` hands them out.

:class:`GraphedStep` captures :meth:`disco.engines.static_step.StaticStep.compute` (inputs
read from the step's buffers, caches written in place, logits copied into the one output
buffer every graph shares) and replays it after :meth:`~disco.engines.static_step.StaticStep.fill`.
The replay runs the captured kernels on the same addresses, so its logits are the eager step's
bit for bit (``tests/test_gpu.py`` checks it); :meth:`~disco.engines.static_step.StaticStep.read`
hands out copies, as the next replay overwrites the buffer.

:func:`capture_buckets` captures every bucket as SGLang's runner does: largest first, into one
memory pool, with one output buffer ``[largest bucket's rows, vocab]`` (a bucket's logits are
its first rows). Replays never overlap (one forward on a model at a time), so each graph's
intermediates can reuse the blocks the larger graphs captured before it, and the logits are
held once instead of once per graph (~1 GB at 32 slots for a 152k vocabulary). It reports the
time and the device memory the graphs took as the growth of ``torch.cuda.memory_reserved``
(the private pool's blocks count there, ``memory_allocated`` misses what the pool keeps for
the graphs; cached free blocks are handed back before each reading): memory the KV budget must
count besides :attr:`disco.engines.static_step.StaticCaches.nbytes`.

Capture runs the step (warm-up and capture write keys and values of the rows' slots at the
positions their lengths give), so it happens at service start, before any session holds a
slot, and after the model's row plans are settled (:func:`disco.engines.static_runner.static_runner_for`).
NOTE: written without a GPU at hand; not run yet (docs/engines.md, "Static step and CUDA graphs").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from disco.engines.batch_layout import SessionRows
from disco.engines.static_step import BLOCK_BUCKETS, SESSION_BUCKETS, Bucket, StaticCaches, StaticStep, StepInputs, bucket_for
from disco.engines.varlen_attention import AttentionPlan

logger = logging.getLogger(__name__)

#: Eager runs of a step before its capture (lazy initialisations, cuBLAS workspaces).
WARMUP_RUNS = 2


def capture_order(steps: Iterable[StaticStep]) -> list[StaticStep]:
    """The steps largest first (rows, then sessions): each later graph's intermediates fit in
    blocks of the shared pool that a larger one freed."""
    return sorted(steps, key=lambda step: (step.bucket.rows, step.bucket.sessions), reverse=True)


def output_buffer(steps: Sequence[StaticStep]) -> torch.Tensor:  # [max rows, vocab]
    """The one logits buffer of all the steps' graphs: the largest bucket's rows, in the
    activations' dtype (the embeddings'; a weight-only head returns it too), on the steps' device."""
    model = steps[0].lean.model
    head = model.get_output_embeddings()
    vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
    rows = max(step.bucket.rows for step in steps)
    dtype = model.get_input_embeddings().weight.dtype
    return torch.empty(rows, vocab, dtype=dtype, device=steps[0].tokens.device)


def logits_into(step: StaticStep, output: torch.Tensor) -> torch.Tensor:  # [sessions, block, vocab]
    """Run ``step.compute`` and copy its logits into the first rows of ``output`` (what a graph
    captures); returns that view of ``output``.

    NOTE: the copy costs one write and read of the bucket's logits per replay; it is what lets
    every graph share one buffer (the head's own output would stay in the pool, once per graph)."""
    bucket = step.bucket
    logits = output[: bucket.rows].view(bucket.sessions, bucket.block, -1)
    computed = step.compute()  # [sessions, block, vocab]
    if computed.shape != logits.shape or computed.dtype != logits.dtype:  # a cast would change bits
        raise TypeError(f"the step's logits {tuple(computed.shape)} {computed.dtype} do not fit the output "
                        f"buffer's {tuple(logits.shape)} {logits.dtype}")
    logits.copy_(computed)
    return logits


class GraphedStep:
    """One bucket's step as a CUDA graph (module doc). ``output``: the buffer the graph writes its
    logits into (shared by the graphs of :func:`capture_buckets`; default: one of its own);
    ``pool``: the memory pool to capture into."""

    def __init__(self, step: StaticStep, output: torch.Tensor | None = None, pool=None) -> None:
        if step.tokens.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA step, this one is on {step.tokens.device}")
        self.step = step
        output = output_buffer([step]) if output is None else output
        side = torch.cuda.Stream(step.tokens.device)
        side.wait_stream(torch.cuda.current_stream(step.tokens.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                logits_into(step, output)
        torch.cuda.current_stream(step.tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool):
            self.logits = logits_into(step, output)  # [sessions, block, vocab], a view of the shared output

    @property
    def pool(self):
        return self.graph.pool()

    @torch.inference_mode()
    def forward(self, rows: Sequence[SessionRows]) -> list[torch.Tensor]:
        """:meth:`StaticStep.forward` by a replay of the graph (copies of the logits: the next
        replay of any graph sharing the output overwrites it)."""
        self.step.fill(rows)
        self.graph.replay()
        return self.step.read(self.logits, rows)


@dataclass(frozen=True)
class CaptureReport:
    graphs: int
    seconds: float
    memory_bytes: int  # device memory reserved by the graphs' pool and their output buffer

    def describe(self) -> str:
        return f"{self.graphs} CUDA graphs captured in {self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB"


def _reserved(device: torch.device) -> int:
    """Device memory the caching allocator holds (graph pools included), free cached blocks
    handed back first; 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-ups' freed blocks are not the graphs' (a private pool keeps its own)
    return torch.cuda.memory_reserved(device)


def capture_buckets(steps: Iterable[StaticStep], progress: bool = True) -> tuple[dict[Bucket, GraphedStep], CaptureReport]:
    """Capture every step (one per bucket) largest first into one memory pool, every graph's
    logits in one output buffer (module doc); logs progress."""
    steps = capture_order(steps)
    graphed: dict[Bucket, GraphedStep] = {}
    if not steps:
        return graphed, CaptureReport(0, 0.0, 0)
    device = steps[0].tokens.device
    before, started = _reserved(device), time.perf_counter()
    pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
    output = output_buffer(steps)
    for index, step in enumerate(steps):
        graphed[step.bucket] = GraphedStep(step, output, pool)
        if progress:
            logger.info("captured the CUDA graph of %d sessions x %d tokens (%d of %d)", step.bucket.sessions,
                        step.bucket.block, index + 1, len(steps))
    report = CaptureReport(len(graphed), time.perf_counter() - started, _reserved(device) - before)
    logger.info("%s", report.describe())
    return graphed, report


class StepRunner:
    """The steps of one model's static path, by bucket (module doc).

    Args:
        lean: the model's lean decoder (:meth:`rebuilt` over a new one).
        caches: the slots' keys and values.
        plan: the one-call attention plan the steps attend with.
    """

    def __init__(self, lean, caches: StaticCaches, plan: AttentionPlan) -> None:
        self.lean, self.caches, self.plan = lean, caches, plan
        self.buckets = [Bucket(sessions, block) for sessions in SESSION_BUCKETS if sessions <= caches.slots
                        for block in BLOCK_BUCKETS]
        self.inputs = StepInputs(max(self.buckets, key=lambda bucket: bucket.rows), caches.keys[0].device)
        self._steps: dict[Bucket, StaticStep | GraphedStep] = {}
        self.graphed = False

    def __iter__(self):
        """The buckets whose steps were built (or captured)."""
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        """Forget the built eager steps (they are rebuilt on use); not the captured graphs."""
        if self.graphed:
            raise RuntimeError("captured graphs are kept: they replay into live sessions' slots")
        self._steps.clear()

    def rebuilt(self, lean) -> None:
        """Steps over another lean decoder (eager only: graphs replay the decoder they captured)."""
        if self.graphed:
            raise RuntimeError("captured graphs replay the decoder they captured")
        self.lean, self._steps = lean, {}

    def step(self, bucket: Bucket) -> StaticStep | GraphedStep:
        step = self._steps.get(bucket)
        if step is None:
            step = self._steps[bucket] = StaticStep(self.lean, self.caches, bucket, self.plan, self.inputs)
        return step

    def run(self, rows: Sequence[SessionRows]) -> list[torch.Tensor]:
        """The rows as one step of the smallest bucket holding them (sessions, not slot numbers);
        per row the logits of its last ``num_logits`` tokens (float32 copies). The caches' lengths are
        the caller's to advance."""
        bucket = bucket_for(len(rows), max(len(row.tokens) for row in rows))
        return self.step(bucket).forward(rows)

    def capture(self, buckets: Sequence[Bucket] | None = None) -> CaptureReport:
        """Capture the CUDA graphs of ``buckets`` (default: every bucket the slots allow) largest
        first into one pool and one output buffer (:func:`capture_buckets`); the caller makes sure
        no session holds a slot and the lean decoder is current."""
        steps = [StaticStep(self.lean, self.caches, bucket, self.plan, self.inputs) for bucket in buckets or self.buckets]
        graphed, report = capture_buckets(steps)
        self._steps.update(graphed)
        for run in self.caches.runs:  # the captures' writes are no session's
            run.length = 0
        self.graphed = True
        return report
