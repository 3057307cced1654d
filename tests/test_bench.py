"""`disco bench` end to end on tiny models: local + gRPC + the HF peer, reports written."""

import json

import pytest

from disco_cli.main import main


@pytest.fixture
def tiny_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"id": "b", "prompt": "import os\nclass Wrapper:"}) + "\n")
    return path


def test_bench_end_to_end(tiny_pair_dirs, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "bench.json"
    report_dir = tmp_path / "report"
    code = main(["bench", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--dataset", str(tiny_dataset), "--max-new-tokens", "12",
                 "--policies", "static:3,heuristic:2,oracle", "--transport", "both", "--peer", "hf",
                 "--json-out", str(out), "--report-dir", str(report_dir)])
    assert code == 0
    payload = json.loads(out.read_text())
    rows = {(r["policy"], r["transport"]): r for r in payload["rows"]}
    assert set(rows) == {("none", "local"), ("static:3", "local"), ("heuristic:2", "local"), ("oracle", "local"),
                         ("none", "grpc"), ("static:3", "grpc"), ("heuristic:2", "grpc"), ("hf-assisted", "local")}
    for (policy, transport), row in rows.items():
        assert row["prompts"] == 2
        assert row["identical"] == 1.0, (policy, transport)  # float32: every row equals target-only
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    assert rows[("none", "local")]["speedup"] == pytest.approx(1.0)
    assert rows[("static:3", "grpc")]["mean_lookahead"] <= 3
    assert payload["env"]["dataset"] and payload["env"]["cores"]
    for name in ("bench.md", "bench.csv", "bench.json", "speedup.png", "lookahead_trace.png", "lookahead_hist.png"):
        assert (report_dir / name).stat().st_size > 0, name
    assert "| policy |" in capsys.readouterr().out


def test_bench_over_grpc_keeps_the_hf_peer_row_and_names_its_baseline(tiny_pair_dirs, tiny_dataset, tmp_path,
                                                                       capsys):
    """``--transport grpc --peer hf`` once printed and wrote no hf-assisted row (its baseline was
    the in-process none, which did not run): the row is there, compared with our gRPC none."""
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--dataset", str(tiny_dataset), "--max-new-tokens", "8", "--limit", "1",
                 "--policies", "none", "--transport", "grpc", "--peer", "hf", "--json-out", str(out)])
    assert code == 0
    rows = {(r["policy"], r["transport"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("none", "grpc"), ("hf-assisted", "local")}
    assert rows[("hf-assisted", "local")]["baseline_transport"] == "grpc"
    assert rows[("hf-assisted", "local")]["speedup"] > 0
    captured = capsys.readouterr()
    assert "hf-assisted" in captured.out and "its speedup is against our none over grpc" in captured.err


def test_bench_transport_reports_overhead_and_transport_time(tiny_pair_dirs, capsys):
    code = main(["bench-transport", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--limit", "2", "--repeats", "1", "--max-new-tokens", "10", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["runs"] == 2 and summary["iterations"] > 0
    assert summary["identical_rate"] == 1.0  # float32: the services return the in-process tokens
    # the remote calls took longer than the services' own timings of them: that is the transport
    assert summary["transport_ms_per_iteration"] > 0
    assert 0 <= summary["in_process_bookkeeping_ms_per_iteration"] < summary["transport_ms_per_iteration"]
    assert summary["tokens_per_s_ratio"] > 0 and summary["engine_time_ratio"] > 0


def test_grpc_floor_times_every_pattern_against_a_bare_server():
    from disco_cli.bench import grpc_floor

    result = grpc_floor.measure(block_tokens=3, idle_ms=(0.0, 2.0), calls=5)
    assert [row["idle_ms"] for row in result["rows"]] == [0.0, 2.0]
    for row in result["rows"]:
        assert all(row[f"{name}_ms"] > 0 for name in ("unary", "stream", "bidi"))
        assert row["iteration_floor_ms"] == pytest.approx(row["stream_ms"] + row["unary_ms"])
    grpc_floor.print_table(result)


def test_bench_transport_floor_needs_no_models(capsys, monkeypatch):
    from disco_cli.bench import grpc_floor

    measured = {}
    real_measure = grpc_floor.measure
    monkeypatch.setattr(grpc_floor, "measure", lambda block_tokens: measured.setdefault(
        "result", real_measure(block_tokens=block_tokens, idle_ms=(0.0,), calls=3)))
    assert main(["bench-transport", "--floor", "--policy", "static:4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == measured["result"]
    assert measured["result"]["block_tokens"] == 4


def test_bench_concurrency_reports_the_identical_rate_at_every_level(tiny_pair_dirs, tmp_path, capsys):
    """bfloat16, the sensitive dtype: under load every request equals target-only alone."""
    out = tmp_path / "concurrency.json"
    code = main(["bench-concurrency", "--target", str(tiny_pair_dirs["target"]), "--draft",
                 str(tiny_pair_dirs["draft"]), "--dtype", "bfloat16", "--levels", "1,4", "--policy", "static:3",
                 "--max-new-tokens", "8", "--json-out", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["identical_alone"] == 1.0
    assert [row["concurrency"] for row in payload["rows"]] == [1, 4]
    assert all(row["identical"] == 1.0 and row["errors"] == 0 for row in payload["rows"]), payload["rows"]
    assert "| identical |" in capsys.readouterr().out


def test_bench_concurrency_rounds_reverse_the_order_and_pool_the_rounds(tiny_pair_dirs, tmp_path, capsys):
    """``--rounds 2``: every level twice, the policies in order then reversed; a row pools its
    rounds (tokens over wall time, every request's latency, the identical rate)."""
    out = tmp_path / "rounds.json"
    code = main(["bench-concurrency", "--target", str(tiny_pair_dirs["target"]), "--draft",
                 str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--levels", "3", "--policies",
                 "none,static:3", "--max-new-tokens", "6", "--rounds", "2", "--json-out", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["rounds"] == 2
    order = [line.split(": ")[0].split()[-1] for line in capsys.readouterr().err.splitlines()
             if line.startswith("concurrency")]
    assert order == ["none", "static:3", "static:3", "none"]
    for row in payload["rows"]:
        assert row["tokens"] == 2 * 6 * 3 and len(row["outputs"]) == 6 and row["identical"] == 1.0
        assert len(row["rounds_tokens_per_s"]) == 2
        assert min(row["rounds_tokens_per_s"]) <= row["tokens_per_s"] <= max(row["rounds_tokens_per_s"])
        assert "latencies" not in row


def test_bench_concurrency_puts_policies_side_by_side_per_level(tiny_pair_dirs, tmp_path, capsys):
    """``--policies``: every policy at every level in one run, interleaved per level; each row
    names its policy and level, with latency percentiles and the ratio to ``none``."""
    out = tmp_path / "concurrency.json"
    code = main(["bench-concurrency", "--target", str(tiny_pair_dirs["target"]), "--draft",
                 str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--levels", "1,3", "--policies",
                 "none,static:3", "--max-new-tokens", "6", "--json-out", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["policies"] == ["none", "static:3"] and payload["identical_alone"] == {"none": 1.0, "static:3": 1.0}
    assert [(row["policy"], row["concurrency"]) for row in payload["rows"]] == [
        ("none", 1), ("static:3", 1), ("none", 3), ("static:3", 3)]
    for row in payload["rows"]:
        assert row["identical"] == 1.0 and row["errors"] == 0 and row["tokens"] == 6 * row["concurrency"]
        assert 0 < row["latency_p50_s"] <= row["latency_p95_s"] <= row["wall_s"] + 1e-3
        expected = row["tokens_per_s"] / next(r["tokens_per_s"] for r in payload["rows"]
                                              if r["policy"] == "none" and r["concurrency"] == row["concurrency"])
        assert row["vs_none"] == pytest.approx(expected, abs=1e-3)
    assert "| policy | concurrency |" in capsys.readouterr().out
    assert main(["bench-concurrency", "--policies", "none,nonsense:3", "--levels", "1"]) == 2  # refused first


def test_bench_puts_overlap_off_and_on_side_by_side(tiny_pair_dirs, tiny_dataset, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--dataset", str(tiny_dataset), "--max-new-tokens", "12",
                 "--policies", "static:3", "--overlap", "off,on", "--json-out", str(out)])
    assert code == 0
    rows = {(r["policy"], r["transport"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("none", "local"), ("static:3", "local"), ("none", "local+overlap"),
                         ("static:3", "local+overlap")}
    for (policy, transport), row in rows.items():
        assert row["overlap"] == (transport == "local+overlap")
        assert row["identical"] == 1.0, (policy, transport)  # float32: overlap changes no token
    assert rows[("static:3", "local")]["overlap_hit_rate"] is None  # nothing pre-drafted without overlap
    assert rows[("static:3", "local+overlap")]["overlap_hit_rate"] is not None


def test_grpc_bench_runs_one_service_set_per_overlap_mode_pinned_with_added_rtt(tiny_pair_dirs, tiny_dataset,
                                                                                tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--dataset", str(tiny_dataset), "--max-new-tokens", "8",
                 "--policies", "static:3", "--transport", "grpc", "--overlap", "off,on", "--pin-services",
                 "--added-rtt-ms", "5", "--json-out", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    rows = {(r["policy"], r["transport"]): r for r in payload["rows"]}
    assert set(rows) == {("none", "grpc"), ("static:3", "grpc"), ("none", "grpc+overlap"),
                         ("static:3", "grpc+overlap")}
    assert all(row["identical"] == 1.0 for row in rows.values())
    assert rows[("static:3", "grpc+overlap")]["overlap"] and not rows[("static:3", "grpc")]["overlap"]
    assert payload["env"]["pin_services"] and payload["env"]["added_rtt_ms"] == 5


def test_split_cores_gives_target_and_draft_disjoint_halves():
    from disco_cli.launcher import split_cores

    assert split_cores([0, 1]) == {"target": {0}, "draft": {1}}
    assert split_cores([0, 1, 2, 3, 4]) == {"target": {0, 1, 2}, "draft": {3, 4}}
    assert split_cores([7]) == {"target": {7}, "draft": {7}}


def test_added_latency_delays_every_call_to_the_backends():
    import time

    from disco_cli.bench.latency import AddedLatency, main

    with pytest.raises(SystemExit):  # the bench's entry point runs the orchestrator command only
        main(["--added-rtt-ms", "5", "policies"])
    interceptor = AddedLatency(0.05)
    started = time.perf_counter()
    assert interceptor.intercept_unary_unary(lambda details, request: request, None, "ok") == "ok"
    assert interceptor.intercept_unary_stream(lambda details, request: [request], None, "x") == ["x"]
    assert time.perf_counter() - started >= 0.1
