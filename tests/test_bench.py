"""`disco bench` end to end on tiny models: local + gRPC + the HF peer, reports written."""

import json

import pytest

from orchestrator.cli import main


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
