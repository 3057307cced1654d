"""The roofline of this machine for the engines' forwards: how far each is from its floors.

A decoding or verification forward of a weight-only model reads every weight once (the
bandwidth floor: weight bytes / read bandwidth) and multiplies each new token's row with all
of them (the compute floor: rows x multiply-adds per row / the int8 dot-product peak). One row
is bandwidth-bound on a CPU; each extra row of a verification block costs at least its
multiply-adds at the peak. Measured here, for the threads in use:

* **read bandwidth**: the best of a few sums over a buffer far larger than the caches
  (float32: torch's reduction streams it with vector loads on every thread);
* **int8 peak**: the q4 x q8 kernel's own instruction (VPDPBUSD, or VPMADDUBSW + VPMADDWD on
  AVX2) issued on every thread with operands in registers (``kernels/int8_peak.cpp``), the
  best of a few short bursts; on VNNI builds also with the kernel's float step after every
  group of 32 inputs (``sub, cvt, mul, fma, fma`` per row and 16 channels): the ceiling the
  kernel's extra rows can reach with its format (Zen 4: ~68% of the instruction's peak).

:func:`forward_work` counts what one forward of a loaded model reads and multiplies (the
linears as they run: the q4 x q8 layout, int8 weights and scales, or dense weights; the LM head
included, the embedding's few rows not). :func:`distances` sets measured forward costs (one
per new-token count, :class:`disco.engines.engine_costs.EngineCosts`) against both floors, and
:func:`extra_row_fraction` gives the share of the int8 peak each row past the first runs at
(issue 50's measure of the verification kernel). ``disco doctor`` prints both per engine;
docs/engines.md holds the table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from disco.models import q4q8
from disco.models.int4 import Int4Linear
from disco.models.quantize import Int8Linear

#: The bandwidth probe's buffer: far past any CPU's last-level cache.
BANDWIDTH_BYTES = 512 * 2**20
#: Repeats of each probe; the best counts (another process can only slow a repeat down).
PROBE_REPEATS = 5
#: Rounds of the int8 probe per repeat (~10-20 ms on one core).
PEAK_ITERATIONS = 200_000

Clock = Callable[[], float]


@dataclass(frozen=True)
class MachinePeaks:
    """What the cores can do at best, for ``threads`` threads. ``int8_gmac_s`` is ``None``
    where no q4 x q8 build runs here (the instruction is then ``""``)."""

    threads: int
    read_gb_s: float  # 10^9 bytes per second
    int8_gmac_s: float | None  # 10^9 u8 x s8 multiply-adds per second
    instruction: str
    #: The same with the kernel's float step after every group of 32 inputs (its instruction
    #: mix in registers): the ceiling of its extra rows. ``None`` where not measured (AVX2).
    int8_group_gmac_s: float | None = None

    def to_json(self) -> dict:
        return {"threads": self.threads, "read_gb_s": round(self.read_gb_s, 2),
                "int8_gmac_s": None if self.int8_gmac_s is None else round(self.int8_gmac_s, 1),
                "int8_group_gmac_s": None if self.int8_group_gmac_s is None else round(self.int8_group_gmac_s, 1),
                "instruction": self.instruction}

    def describe(self) -> str:
        peak = f"int8 peak {self.int8_gmac_s:.0f} G multiply-adds/s ({self.instruction})" \
            if self.int8_gmac_s is not None else "no int8 kernel build here"
        if self.int8_gmac_s and self.int8_group_gmac_s:
            peak += f", {self.int8_group_gmac_s / self.int8_gmac_s:.0%} of it with a float step per group"
        return f"read {self.read_gb_s:.1f} GB/s, {peak}, {self.threads} threads"


@dataclass(frozen=True)
class ForwardWork:
    """What one forward of a model reads and computes: ``weight_bytes`` read whatever the
    rows, ``macs_per_row`` multiply-adds per new token (linears and LM head), ``kernels`` the
    kinds of linear that compute them (a q4 x q8 build's name, ``int4pack``, ``int8``, or a dtype)."""

    weight_bytes: int
    macs_per_row: int
    kernels: tuple[str, ...]

    @property
    def int8_kernel(self) -> bool:
        """Whether every multiply-add runs on the q4 x q8 kernel (the int8 peak is its floor)."""
        return bool(self.kernels) and all(kernel in q4q8.KERNELS for kernel in self.kernels)


@dataclass(frozen=True)
class Distance:
    """One measured forward of ``rows`` new tokens against its floors (seconds)."""

    rows: int
    measured_s: float
    bandwidth_floor_s: float
    compute_floor_s: float | None

    @property
    def floor_s(self) -> float:
        return max(self.bandwidth_floor_s, self.compute_floor_s or 0.0)

    @property
    def ratio(self) -> float:
        """Measured time over the floor (1.0: at the roofline)."""
        return self.measured_s / self.floor_s

    def to_json(self) -> dict:
        return {"rows": self.rows, "measured_ms": round(self.measured_s * 1000, 3),
                "bandwidth_floor_ms": round(self.bandwidth_floor_s * 1000, 3),
                "compute_floor_ms": None if self.compute_floor_s is None else round(self.compute_floor_s * 1000, 3),
                "ratio": round(self.ratio, 3)}


def measure_read_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, repeats: int = PROBE_REPEATS,
                           clock: Clock = time.perf_counter) -> float:
    """Bytes per second a multi-threaded sum streams from memory (the best of ``repeats``)."""
    with _threads(threads):
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        buffer.sum()  # pages touched and the pool started before timing
        best = 0.0
        for _ in range(repeats):
            started = clock()
            buffer.sum()
            best = max(best, nbytes / max(clock() - started, 1e-9))
    return best


def measure_int8_peak(threads: int, iterations: int = PEAK_ITERATIONS, repeats: int = PROBE_REPEATS,
                      clock: Clock = time.perf_counter, probe: Callable[[int], int] | None = None) -> float | None:
    """Multiply-adds per second of the loaded q4 x q8 build's instruction on ``threads``
    threads (the best of ``repeats``), or ``None`` where no build is loaded or the ``probe``
    (default :func:`disco.models.q4q8.int8_peak`) does not run on this build."""
    if not q4q8.ops_loaded():
        return None
    probe = probe or q4q8.int8_peak
    with _threads(threads):
        if probe(max(1, iterations // 10)) < 0:  # also starts the pool's threads before timing
            return None
        best = 0.0
        for _ in range(repeats):
            started = clock()
            macs = probe(iterations)
            best = max(best, macs / max(clock() - started, 1e-9))
    return best


def measure_peaks(home: Path, threads: int | None = None, clock: Clock = time.perf_counter) -> MachinePeaks:
    """Both peaks for ``threads`` (default: torch's intra-op threads now); the best q4 x q8
    build this CPU runs is loaded first (built under ``home`` once), as the int4 engine does."""
    threads = threads or torch.get_num_threads()
    if not q4q8.ops_loaded() and q4q8.cpu_supports():
        q4q8.load(home)  # where it cannot, the int8 peak is None (no kernel to measure)
    peak = measure_int8_peak(threads, clock=clock)
    group = None if peak is None else measure_int8_peak(threads, PEAK_ITERATIONS // 8, clock=clock,
                                                        probe=q4q8.int8_group_peak)
    instruction = "" if peak is None else q4q8.loaded_kernel()
    return MachinePeaks(threads, measure_read_bandwidth(threads, clock=clock) / 1e9,
                        None if peak is None else peak / 1e9, instruction, None if group is None else group / 1e9)


def forward_work(model: nn.Module) -> ForwardWork:
    """Bytes of weights a decoding forward of ``model`` reads and multiply-adds per row, over
    its linears as they run now (module doc)."""
    weight_bytes = macs = 0
    kernels = set()
    for module in model.modules():
        read = _decode_read(module)
        if read is None:
            continue
        weight_bytes += read[0]
        kernels.add(read[1])
        macs += module.in_features * module.out_features
    return ForwardWork(weight_bytes, macs, tuple(sorted(kernels)))


def _decode_read(module: nn.Module) -> tuple[int, str] | None:
    """Bytes a one-row forward of ``module`` reads and the kind of its kernel (``None``: not a linear)."""
    bias = module.bias.nbytes if getattr(module, "bias", None) is not None else 0
    if isinstance(module, Int4Linear):
        if module.kernel in q4q8.KERNELS:
            return module.q4q8_weights.nbytes + bias, module.kernel
        return module.packed.nbytes + module.scales_and_zeros.nbytes + bias, module.kernel
    if isinstance(module, Int8Linear):
        return module.weight.nbytes + module.scales.nbytes + bias, "int8"
    if isinstance(module, nn.Linear):
        return module.weight.nbytes + bias, str(module.weight.dtype).removeprefix("torch.")
    return None


def distances(work: ForwardWork, peaks: MachinePeaks,
              forward_s: Sequence[float]) -> list[Distance]:
    """``forward_s[i]``: the measured forward of ``i + 1`` new tokens, against its floors (the
    compute floor only where every multiply-add runs on the q4 x q8 kernel)."""
    bandwidth_floor = work.weight_bytes / (peaks.read_gb_s * 1e9)
    int8 = peaks.int8_gmac_s is not None and work.int8_kernel
    result = []
    for index, seconds in enumerate(forward_s):
        rows = index + 1
        compute = rows * work.macs_per_row / (peaks.int8_gmac_s * 1e9) if int8 else None
        result.append(Distance(rows, seconds, bandwidth_floor, compute))
    return result


def extra_row_fraction(work: ForwardWork, peaks: MachinePeaks, forward_s: Sequence[float]) -> float | None:
    """The share of the int8 peak the rows past the first run at: one row's multiply-adds at
    the peak over the measured cost of an extra row, ``(t(k) - t(1)) / (k - 1)``, for the
    largest ``k`` measured. ``None`` without a peak or the q4 x q8 kernel, fewer than two
    counts, or no extra cost."""
    if peaks.int8_gmac_s is None or not work.int8_kernel or len(forward_s) < 2:
        return None
    extra = (forward_s[-1] - forward_s[0]) / (len(forward_s) - 1)
    if extra <= 0:
        return None
    return work.macs_per_row / (peaks.int8_gmac_s * 1e9) / extra


class _threads:
    """torch's intra-op threads set to ``count`` inside the block, restored after."""

    def __init__(self, count: int) -> None:
        self.count, self.before = count, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.count)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)
