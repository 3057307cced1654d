"""The roofline (disco.engines.roofline): what a forward reads and multiplies, its floors, the
probes' arithmetic on an injected clock, and the int8 probe on this CPU's kernel build."""

from __future__ import annotations

import copy
import itertools
import os
from pathlib import Path

import pytest
import torch

from disco.engines.roofline import (ForwardWork, MachinePeaks, distances, extra_row_fraction, forward_work,
                                    measure_int8_peak, measure_peaks, measure_read_bandwidth)
from disco.models import q4q8
from disco.models.quantize import quantize_model
from tests import tiny

HOME = Path(os.environ.get("DISCO_HOME", "/tmp/disco_q4q8_tests"))


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_a_dense_model_reads_its_linears_weights_and_multiplies_each_once_per_row():
    model = tiny.qwen2(0).to(torch.bfloat16)
    work = forward_work(model)
    linears = _linears(model)
    assert work.weight_bytes == sum(m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in linears)
    assert work.macs_per_row == sum(m.in_features * m.out_features for m in linears)
    assert work.kernels == ("bfloat16",) and not work.int8_kernel


def test_an_int4_model_on_the_q4q8_kernel_reads_its_repacked_weights():
    if q4q8.load(HOME) is not None:
        pytest.skip("no q4 x q8 build on this CPU")
    dense = tiny.qwen2(0, hidden=128)
    macs = sum(m.in_features * m.out_features for m in _linears(dense))
    model = quantize_model(copy.deepcopy(dense), engine="int4", lm_head=True)
    for module in model.modules():
        if hasattr(module, "use_kernel"):
            module.use_kernel(q4q8.loaded_kernel())
    work = forward_work(model)
    assert work.macs_per_row == macs and work.kernels == (q4q8.loaded_kernel(),) and work.int8_kernel
    # The kernel's layout: 320 bytes per 16 channels x 32 inputs (0.625 bytes a weight), plus biases.
    biases = sum(m.bias.nbytes for m in model.modules() if getattr(m, "bias", None) is not None
                 and hasattr(m, "q4q8_weights"))
    assert work.weight_bytes == macs * 320 // 512 + biases


def test_floors_and_the_extra_rows_share_of_the_peak():
    work = ForwardWork(weight_bytes=10**9, macs_per_row=10**9, kernels=("q4q8-vnni",))
    peaks = MachinePeaks(threads=2, read_gb_s=50.0, int8_gmac_s=250.0, instruction="q4q8-vnni")
    rows = distances(work, peaks, [0.030, 0.040, 0.050])
    assert [d.bandwidth_floor_s for d in rows] == [pytest.approx(0.020)] * 3
    assert [d.compute_floor_s for d in rows] == [pytest.approx(0.004), pytest.approx(0.008), pytest.approx(0.012)]
    assert rows[0].ratio == pytest.approx(1.5) and rows[2].ratio == pytest.approx(2.5)
    assert extra_row_fraction(work, peaks, [0.030, 0.040, 0.050]) == pytest.approx(0.4)  # 4 ms at peak / 10 ms
    # A compute-bound forward: the floor is the compute one.
    assert distances(work, peaks, [0.1] * 8)[7].floor_s == pytest.approx(0.032)
    # No compute floor where the linears are not the q4 x q8 kernel's, or no peak was measured.
    bf16 = ForwardWork(10**9, 10**9, ("bfloat16",))
    assert distances(bf16, peaks, [0.03])[0].compute_floor_s is None
    assert extra_row_fraction(bf16, peaks, [0.03, 0.04]) is None
    no_peak = MachinePeaks(2, 50.0, None, "")
    assert extra_row_fraction(work, no_peak, [0.03, 0.04]) is None
    assert extra_row_fraction(work, peaks, [0.03]) is None and extra_row_fraction(work, peaks, [0.03, 0.03]) is None


def test_the_probes_keep_the_best_repeat_on_an_injected_clock():
    ticks = itertools.chain([0.0, 0.5, 1.0, 1.25, 2.0, 3.0], itertools.count(10.0))
    nbytes = 1 << 20
    assert measure_read_bandwidth(1, nbytes=nbytes, repeats=3, clock=lambda: next(ticks)) == nbytes / 0.25
    if q4q8.load(HOME) is not None:
        pytest.skip("no q4 x q8 build on this CPU")
    macs = q4q8.int8_peak(100)
    assert q4q8.int8_peak(200) == 2 * macs > 0
    group = q4q8.int8_group_peak(100)  # the kernel's instruction mix (VNNI builds; -1 elsewhere)
    assert group == -1 and q4q8.loaded_kernel() == "q4q8-avx2" or q4q8.int8_group_peak(200) == 2 * group > 0
    ticks = itertools.chain([0.0, 2.0, 5.0, 6.0], itertools.count(100.0, 4.0))
    assert measure_int8_peak(1, iterations=100, repeats=2, clock=lambda: next(ticks)) == macs / 1.0


def test_measured_peaks_are_positive_and_said_in_one_line():
    peaks = measure_peaks(HOME, threads=1)
    assert peaks.threads == 1 and peaks.read_gb_s > 0
    if q4q8.cpu_supports() and q4q8.ops_loaded():
        assert peaks.int8_gmac_s > 0 and peaks.instruction == q4q8.loaded_kernel()
        assert (peaks.int8_group_gmac_s is None) == (peaks.instruction == "q4q8-avx2")
    assert "GB/s" in peaks.describe() and peaks.to_json()["threads"] == 1
