"""One cost record and one way from timings to the cost model (issue 49, item 5): costs are
read back only for the forward and the int4 kernel they were timed on, reading them never
builds or times a kernel, the default tables cover blocks up to the lookahead cap, and the
live table covers the largest forward the engines run. Timings are injected, never asserted."""

from __future__ import annotations

import json
import time

import pytest
import torch

from disco.config import DEFAULT_MAX_LOOKAHEAD
from disco.engines import engine_costs
from disco.engines.batching import DEFAULT_MAX_BATCH
from disco.engines.engine_costs import CostRequest, EngineCosts, costs_path, load_or_measure, read_cached
from disco.engines.live_costs import MAX_ROWS, LiveCosts
from disco.models import q4q8

SMALL = CostRequest(max_new_tokens=3, context_tokens=16, repeats=2)


def _record(forward: str, engine: str = "float32", kernel: str | None = None, sizes: int = 3) -> EngineCosts:
    return EngineCosts(model="tiny", fingerprint="fp", engine=engine, device="cpu", forward=forward,
                       threads=torch.get_num_threads(), context_tokens=SMALL.context_tokens,
                       forward_s=tuple(0.01 * k for k in range(1, sizes + 1)), prefill_s=0.1, repeats=2,
                       torch_version=torch.__version__, measured_at=time.time(), kernel=kernel)


def _cache(home, costs: EngineCosts) -> None:
    path = costs_path(home, costs.fingerprint, costs.engine, costs.device, costs.threads, forward=costs.forward,
                      kernel=costs.kernel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs.to_json()))


@pytest.fixture
def fixed_timings(monkeypatch):
    """The harness returns repeats ``[1, 2, 3, 4, 5] * k`` ms for a forward over k new tokens:
    their 20th percentile is 1.8 k ms, their median 3 k ms."""
    def time_forwards(model, context_tokens, sizes, repeats, progress=False, label=""):
        return {k: [0.001 * k * (i + 1) for i in range(5)] for k in sizes}, 0.5
    monkeypatch.setattr(engine_costs, "time_forwards", time_forwards)
    monkeypatch.setattr(engine_costs, "_load_average", lambda: 0.0)


@pytest.fixture
def nothing_compiled_or_timed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("reading costs built, loaded or timed a kernel")
    for name in ("choose_kernel", "build", "load", "_measure_choice"):
        monkeypatch.setattr(q4q8, name, refuse)


def test_reading_cached_costs_never_builds_or_times_a_kernel(tmp_path, nothing_compiled_or_timed):
    record = _record("lean", engine="int4", kernel="q4q8-vnni")
    _cache(tmp_path, record)
    key = (tmp_path, "fp", "int4", "cpu", torch.get_num_threads(), SMALL)
    assert read_cached(*key, forward="lean", kernel="q4q8-vnni") == record
    assert read_cached(*key, forward="lean", kernel=q4q8.TORCH_KERNEL) is None  # timed on the other kernel
    # No model at hand: the kernel already chosen here, read (none cached in a fresh home).
    kernel = engine_costs.cached_kernel(tmp_path, "int4", "cpu")
    assert kernel in (None, q4q8.TORCH_KERNEL)
    assert read_cached(*key, forward=None, kernel=kernel) is None
    assert engine_costs.cached_kernel(tmp_path, "int8", "cpu") is None


def test_the_cached_kernel_choice_is_read_not_measured(tmp_path, monkeypatch, nothing_compiled_or_timed):
    variant = q4q8.VARIANTS[1]
    monkeypatch.setattr(q4q8, "ops_loaded", lambda: False)
    monkeypatch.setattr(q4q8, "variant_for", lambda flags: variant)
    folder = q4q8.kernels_dir(tmp_path, variant)
    folder.mkdir(parents=True)
    (folder / "libdisco_q4q8.so").touch()  # built earlier
    assert q4q8.cached_choice(tmp_path) is None  # nothing chosen yet: not measured here
    (folder / f"choice-t{torch.get_num_threads()}.json").write_text(
        json.dumps(q4q8.KernelChoice(variant.kernel, "measured earlier").to_json()))
    assert q4q8.cached_choice(tmp_path).kernel == variant.kernel
    assert engine_costs.cached_kernel(tmp_path, "int4", "cpu") == variant.kernel
    monkeypatch.setattr(q4q8, "variant_for", lambda flags: None)  # a CPU without a build: torch's, unmeasured
    assert q4q8.cached_choice(tmp_path).kernel == q4q8.TORCH_KERNEL


@pytest.mark.parametrize("cached, running", [("hf", "lean"), ("lean", "hf"), ("packed-hf", "lean")])
def test_costs_timed_on_one_forward_are_not_read_back_for_another(cached, running, target_model, tmp_path,
                                                                  monkeypatch, fixed_timings):
    _cache(tmp_path, _record(cached))
    monkeypatch.setattr(engine_costs, "forward_of", lambda model: running)
    key = (tmp_path, "fp", "float32", "cpu", torch.get_num_threads(), SMALL)
    assert read_cached(*key, forward=running) is None and read_cached(*key, forward=cached) is not None
    measured = load_or_measure(target_model, name="tiny", fingerprint="fp", engine="float32", device="cpu",
                               home=tmp_path, request=SMALL, progress=False)
    assert measured.forward == running and measured.forward_s == pytest.approx((0.0018, 0.0036, 0.0054))
    assert read_cached(*key, forward=running) == measured
    assert read_cached(*key, forward=cached).forward == cached  # the other forward's record stays its own


def test_a_measured_record_says_which_forward_and_kernel_ran(target_model, tmp_path, fixed_timings):
    measured = load_or_measure(target_model, name="tiny", fingerprint="fp", engine="float32", device="cpu",
                               home=tmp_path, request=SMALL, progress=False)
    assert measured.forward == engine_costs.forward_of(target_model) == "lean" and measured.kernel is None
    assert costs_path(tmp_path, "fp", "float32", "cpu", torch.get_num_threads(), forward="lean").exists()
    assert json.loads(costs_path(tmp_path, "fp", "float32", "cpu", torch.get_num_threads(),
                                 forward="lean").read_text())["format"] == engine_costs.FORMAT_VERSION == 3


def test_an_older_format_is_not_read_back(tmp_path):
    record = _record("lean")
    path = costs_path(tmp_path, "fp", "float32", "cpu", torch.get_num_threads(), forward="lean")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**record.to_json(), "format": 1}))
    assert read_cached(tmp_path, "fp", "float32", "cpu", torch.get_num_threads(), SMALL, forward="lean") is None


def test_the_default_tables_cover_blocks_up_to_the_lookahead_cap():
    assert engine_costs.request_for("target").max_new_tokens == DEFAULT_MAX_LOOKAHEAD + 1
    assert CostRequest().max_new_tokens == DEFAULT_MAX_LOOKAHEAD + 1
    assert engine_costs.request_for("draft").max_new_tokens == 1


def test_live_costs_record_the_largest_forward_the_batcher_runs():
    rows = DEFAULT_MAX_BATCH * (DEFAULT_MAX_LOOKAHEAD + 1)  # 16 sessions x a full block plus the bonus position
    assert MAX_ROWS >= rows
    live = LiveCosts()
    live.observe(rows, 0.5)
    assert len(live.seconds_by_rows()) == rows and live.seconds_by_rows()[-1] == 0.5


def test_measure_cost_model_is_to_cost_model_over_low_percentile_records(target_model, drafts, fixed_timings):
    model = engine_costs.measure_cost_model(target_model, drafts["noisy"], max_k=3, repeats=5, prompt_len=16,
                                            ks=(0, 1, 3), source="test")
    # 20th percentile of [1..5] * k ms, k = 1..4 (k = 3 interpolated between 2 and 4): not the median (3 k ms).
    assert model.t_verify == pytest.approx((0.0018, 0.0036, 0.0054, 0.0072)) and model.t_draft == pytest.approx(0.0018)
    target = engine_costs.measure_forward_costs(target_model, CostRequest(4, 16, 5), progress=False)
    draft = engine_costs.measure_forward_costs(drafts["noisy"], CostRequest(1, 16, 5), progress=False)
    expected = engine_costs.to_cost_model(target, draft)
    assert model.t_verify == pytest.approx(expected.t_verify) and model.t_draft == pytest.approx(expected.t_draft)
    assert model.source == "test" and model.extra["timed_k"] == [0, 1, 3]
