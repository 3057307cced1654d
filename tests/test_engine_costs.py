"""Measured engine costs (disco.engines.engine_costs) and `disco models calibrate`: a sane
structure on tiny models, the cache per (model, engine, device, threads), and the CLI.
Timings themselves are never asserted."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from disco.engines import engine_costs
from disco.engines.engine_costs import CostRequest, EngineCosts, load_or_measure, measure_forward_costs
from disco.errors import InvalidRequest
from disco_cli.main import main

SMALL = CostRequest(max_new_tokens=4, context_tokens=24, repeats=2)


def _measure(model, home, request=SMALL, **kwargs) -> EngineCosts:
    return load_or_measure(model, name="tiny", fingerprint="tinyfp", engine="float32", device="cpu", home=home,
                           request=request, progress=False, **kwargs)


def test_measurement_on_a_tiny_model_is_sane(target_model):
    costs = measure_forward_costs(target_model, SMALL, progress=False)
    assert len(costs.forward_s) == 4 and costs.forward in engine_costs.FORWARDS and costs.kernel is None
    assert all(math.isfinite(v) and v > 0 for v in (*costs.forward_s, costs.prefill_s)) and costs.spread >= 1.0


def test_costs_are_cached_per_model_engine_device_and_threads(target_model, tmp_path, monkeypatch):
    first = _measure(target_model, tmp_path)
    assert first.max_new_tokens == 4 and first.context_tokens == 24 and first.threads == torch.get_num_threads()
    assert first.per_token_s == first.forward_s[0] and first.engine == "float32"
    path = engine_costs.costs_path(tmp_path, "tinyfp", "float32", "cpu", torch.get_num_threads(),
                                   forward=first.forward)
    assert EngineCosts.from_json(json.loads(path.read_text())) == first

    calls = []
    real = engine_costs.measure_forward_costs

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_costs, "measure_forward_costs", counting)
    assert _measure(target_model, tmp_path) == first and not calls  # cached
    assert _measure(target_model, tmp_path, CostRequest(2, 24, 2)) == first and not calls  # covered
    longer = _measure(target_model, tmp_path, CostRequest(6, 24, 2))  # more points: measured again
    assert longer.max_new_tokens == 6 and len(calls) == 1
    _measure(target_model, tmp_path, CostRequest(6, 24, 2), force=True)
    assert len(calls) == 2
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)
    try:
        other = _measure(target_model, tmp_path, CostRequest(6, 24, 2))
    finally:
        torch.set_num_threads(previous)
    assert other.threads == previous + 1 and len(calls) == 3


def test_context_is_fitted_to_a_short_model(tmp_path):
    from tests import tiny

    short = tiny.qwen2(seed=5, max_positions=40)
    costs = _measure(short, tmp_path, CostRequest(max_new_tokens=3, context_tokens=200, repeats=1))
    assert costs.context_tokens == 20 and costs.max_new_tokens == 3


@pytest.mark.parametrize("request_, message", [
    (CostRequest(max_new_tokens=0), "new tokens"),
    (CostRequest(context_tokens=0), "context tokens"),
    (CostRequest(repeats=0), "repeats"),
])
def test_bad_requests_are_refused(request_, message, target_model, tmp_path):
    with pytest.raises(InvalidRequest, match=message):
        _measure(target_model, tmp_path, request_)


def test_json_round_trip_extrapolation_and_cost_model():
    costs = EngineCosts(model="m", fingerprint="f", engine="int8", device="cpu", forward="lean", threads=2,
                        context_tokens=200, forward_s=(0.2, 0.25, 0.3), prefill_s=3.0, repeats=5, torch_version="x",
                        measured_at=1.0)
    assert EngineCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    int4 = replace(costs, engine="int4", kernel="q4q8-vnni")
    assert EngineCosts.from_json(json.loads(json.dumps(int4.to_json()))) == int4
    assert costs.forward_seconds(2) == 0.25 and costs.forward_seconds(5) == pytest.approx(0.4)
    with pytest.raises(InvalidRequest, match="malformed"):
        EngineCosts.from_json({**costs.to_json(), "forward_s": []})
    with pytest.raises(InvalidRequest, match="malformed"):
        EngineCosts.from_json({"format": engine_costs.FORMAT_VERSION})
    draft = EngineCosts(**{**costs.__dict__, "forward_s": (0.09,)})
    model = engine_costs.to_cost_model(costs, draft, rtt=0.001)
    assert model.t_draft == 0.09 and model.verify(0) == 0.2 and model.verify(2) == 0.3


def test_calibrate_cli_json_and_table(capsys, tiny_pair_dirs, tmp_path):
    argv = ["models", "calibrate", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
            "--dtype", "int8", "--home", str(tmp_path), "--max-lookahead", "3", "--context-tokens", "16",
            "--repeats", "1", "--quiet"]
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["target"]["forward_s"]) == 4 and len(payload["draft"]["forward_s"]) == 1
    assert payload["target"]["engine"] == payload["draft"]["engine"] == "int8"
    assert all(v > 0 for v in payload["target"]["forward_s"])
    assert "roofline" in payload and payload["roofline"]["peaks"]["read_gb_s"] > 0
    assert payload["roofline"]["target"]["rows_over_one_row"]["rows"] == 4  # 1..4 new tokens timed
    assert main(argv) == 0  # cached now: prints the table
    table = capsys.readouterr().out
    assert "k=4" in table and "target" in table and "draft" in table and "int8" in table
    assert "roofline: read" in table and "target 4 rows = " in table and "draft token" in table
    assert main([*argv, "--no-roofline"]) == 0
    assert "roofline" not in capsys.readouterr().out


def test_calibrate_cli_refuses_bad_flags(capsys, tiny_pair_dirs, tmp_path):
    code = main(["models", "calibrate", "--target", str(tiny_pair_dirs["target"]), "--draft",
                 str(tiny_pair_dirs["draft"]), "--home", str(tmp_path), "--repeats", "0", "--quiet"])
    assert code != 0
    assert "repeats must be >= 1" in capsys.readouterr().err


def test_bench_section_measures_loaded_models_and_reads_the_cache_otherwise(tiny_pair_dirs, tmp_path):
    from disco.config import ModelConfig, PairConfig
    from disco.models.loading import load_model
    from disco_cli.bench.report import engine_costs as bench_costs

    pair = PairConfig(target=ModelConfig(spec=str(tiny_pair_dirs["target"]), dtype="float32"),
                      draft=ModelConfig(spec=str(tiny_pair_dirs["draft"]), dtype="float32"))
    assert bench_costs(pair, tmp_path) == {"target": None, "draft": None}  # nothing cached, nothing loaded
    target = load_model(pair.target, "target", tmp_path, progress=False)
    measured = bench_costs(pair, tmp_path, {"target": target, "draft": None}, progress=False)
    assert len(measured["target"]["forward_s"]) == engine_costs.DEFAULT_TARGET_TOKENS and measured["draft"] is None
    assert measured["target"]["fingerprint"] == target.fingerprint and measured["target"]["engine"] == "float32"
    assert bench_costs(pair, tmp_path)["target"] == measured["target"]  # as the services' cache is read


def test_a_measurement_taken_under_load_is_replaced_when_the_machine_is_quiet(target_model, tmp_path,
                                                                                 monkeypatch):
    import os

    cores = os.cpu_count() or 1
    # The real timings' spread is this machine's business (a busy CI machine makes it large):
    # recorded as steady here, so only the injected load average decides.
    _spread_repeats(monkeypatch, 1.0)
    monkeypatch.setattr(engine_costs, "_load_average", lambda: float(cores) * 2)
    loaded = _measure(target_model, tmp_path)
    assert loaded.load_average == cores * 2
    assert _measure(target_model, tmp_path) == loaded  # still loaded: the cache stands
    monkeypatch.setattr(engine_costs, "_load_average", lambda: 0.1)
    quiet = _measure(target_model, tmp_path)
    assert quiet.load_average == 0.1 and quiet.measured_at > loaded.measured_at
    assert _measure(target_model, tmp_path) == quiet  # a quiet record is kept


def test_a_busy_machine_cannot_set_the_costs():
    """A low percentile of the repeats: a few slowed repeats do not move it (the median of
    five would follow three); the spread flags the measurement as taken on shared cores."""
    repeats = [0.100, 0.101, 0.350, 0.420, 0.390]  # three of five repeats slowed 4x
    assert engine_costs.low_percentile(repeats) == pytest.approx(0.1008)
    assert engine_costs.low_percentile([0.2]) == 0.2
    assert engine_costs.low_percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert max(repeats) / min(repeats) >= engine_costs.CONTENDED_SPREAD


def _spread_repeats(monkeypatch, spread: float) -> None:
    """The real harness's timings, with each size's repeats made ``[fastest, fastest * spread, ...]``."""
    real = engine_costs.time_forwards

    def spread_out(*args, **kwargs):
        samples, prefill_s = real(*args, **kwargs)
        return {k: [min(seconds) * (spread if i else 1.0) for i in range(len(seconds))]
                for k, seconds in samples.items()}, prefill_s
    monkeypatch.setattr(engine_costs, "time_forwards", spread_out)


def test_a_measurement_with_spread_repeats_is_provisional_and_measured_again_when_quiet(target_model, tmp_path,
                                                                                         monkeypatch):
    real = engine_costs.time_forwards
    monkeypatch.setattr(engine_costs, "_load_average", lambda: 0.1)
    _spread_repeats(monkeypatch, 3.0)
    contended = _measure(target_model, tmp_path)
    assert contended.provisional and contended.spread == 3.0
    cached = EngineCosts.from_json(json.loads(engine_costs.costs_path(
        tmp_path, "tinyfp", "float32", "cpu", torch.get_num_threads(), forward=contended.forward).read_text()))
    assert cached == contended and cached.provisional
    monkeypatch.setattr(engine_costs, "time_forwards", real)
    steady = _measure(target_model, tmp_path)  # quiet now: measured again
    assert steady.measured_at > contended.measured_at
    assert steady.provisional == (steady.spread >= engine_costs.CONTENDED_SPREAD)
