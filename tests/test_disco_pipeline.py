"""DISCO end to end on tiny models through the CLI: records -> train -> artifact ->
`disco generate --policy disco:ART` (exact) -> replay -> tune; artifact safety checks."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from disco.errors import InvalidRequest
from disco.speculation.policies.learned import load_learned_policy, read_artifact, resolve_artifact_path
from disco_cli.main import main
from tests import tiny
from tests.helpers import PROMPTS

TRAIN_PROMPTS = PROMPTS + ("def add(a, b):\n    return", "while True:\n", "class Stack:\n    def push(self, x):")


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_pair_dirs):
    root = tmp_path_factory.mktemp("disco_e2e")
    dataset = root / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"t{i}", "prompt": p}) + "\n" for i, p in enumerate(TRAIN_PROMPTS)))
    return {"root": root, "dataset": dataset, "models": ["--target", str(tiny_pair_dirs["target"]),
                                                          "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32"]}


@pytest.fixture(scope="module")
def trained(workspace):
    """`disco train` once for the module (records are computed on the way)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DISCO_HOME", str(workspace["root"] / "home"))
    out = workspace["root"] / "tiny.disco"
    try:
        code = main(["train", "--dataset", str(workspace["dataset"]), *workspace["models"], "--max-new-tokens", "32",
                     "--horizon", "7", "--max-lookahead", "8", "--models", "logreg", "--label", "current",
                     "--out", str(out), "--json"])
    finally:
        mp.undo()
    assert code == 0
    return out


@pytest.fixture
def home(workspace, monkeypatch):
    monkeypatch.setenv("DISCO_HOME", str(workspace["root"] / "home"))


def test_records_command_reuses_cache(capsys, workspace, trained, home):
    code, out, err = run_cli(capsys, "records", "--dataset", str(workspace["dataset"]), *workspace["models"],
                             "--max-new-tokens", "32", "--horizon", "7", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["prompts"] == len(TRAIN_PROMPTS) and summary["tokens"] == 32 * len(TRAIN_PROMPTS)
    assert "computing" not in err  # all cached by the training run


def test_artifact_metadata_and_round_trip(trained, tiny_pair_dirs, tmp_path):
    artifact = read_artifact(trained)
    meta = artifact.metadata
    assert meta["features"]["names"] == list(artifact.spec.names)
    assert meta["draft"]["fingerprint"] and meta["target"]["fingerprint"]
    assert 0 < meta["threshold"] < 1 and meta["cost_model"]["t_draft"] > 0 and meta["validation_table"]
    copy = tmp_path / "copy.disco"
    artifact.save(copy)
    again = read_artifact(copy)
    x = np.linspace(0, 1, len(artifact.spec.names))
    assert again.classifier.probability(x) == artifact.classifier.probability(x)
    assert again.metadata["threshold"] == meta["threshold"]
    with zipfile.ZipFile(trained) as archive:  # nothing pickled: JSON + .npz readable without pickle
        assert sorted(archive.namelist()) == ["arrays.npz", "metadata.json"]
        np.load(io.BytesIO(archive.read("arrays.npz")), allow_pickle=False)


def test_generate_with_trained_policy_is_exact(capsys, workspace, trained, home):
    """Under the measured costs of the tiny pair (``disco:PATH``; the draft costs about what
    the target does, so little or nothing is drafted) and at the artifact's own threshold
    (``@tuned``, which drafts): target-only's tokens either way."""
    outputs = {}
    for policy in ("none", f"disco:{trained}", f"disco:{trained}@tuned"):
        code, out, err = run_cli(capsys, "generate", *workspace["models"], "--prompt", "def f(x):", "--policy", policy,
                                 "--max-new-tokens", "24", "--ignore-eos", "--json")
        assert code == 0, err
        outputs[policy] = json.loads(out)
    assert outputs[f"disco:{trained}"]["token_ids"] == outputs["none"]["token_ids"]
    assert outputs[f"disco:{trained}@tuned"]["token_ids"] == outputs["none"]["token_ids"]
    assert outputs[f"disco:{trained}@tuned"]["stats"]["draft_tokens"] > 0


def test_replay_command_json_contract(capsys, workspace, trained, home, tmp_path):
    report_path = tmp_path / "replay.json"
    code, out, err = run_cli(capsys, "replay", "--dataset", str(workspace["dataset"]), *workspace["models"],
                             "--max-new-tokens", "32", "--horizon", "7", "--max-lookahead", "8",
                             "--policies", f"none,static:1-3,confidence:0.2,disco:{trained},oracle",
                             "--json-out", str(report_path))
    assert code == 0, err
    report = json.loads(report_path.read_text())
    assert set(report["cost_model"]) >= {"t_draft", "t_verify", "t_rtt"}
    rows = {row["policy"]: row for row in report["rows"]}
    assert set(rows) == {"none", "static:1", "static:2", "static:3", "confidence:0.2", f"disco:{trained}", "oracle"}
    for row in rows.values():
        assert set(row) >= {"policy", "speedup", "target_forwards", "draft_tokens", "mean_lookahead"}
        assert row["approx_tokens"] == 0
    assert rows["none"]["speedup"] == 1.0 and rows["none"]["draft_tokens"] == 0
    assert rows["oracle"]["speedup"] >= max(r["speedup"] for r in rows.values())
    assert "static:2" in out


def test_tune_for_another_cost_model(capsys, workspace, trained, home, tmp_path):
    slow_link = tmp_path / "tuned.disco"
    code, out, err = run_cli(capsys, "tune", "--artifact", str(trained), "--out", str(slow_link),
                             "--dataset", str(workspace["dataset"]), *workspace["models"], "--max-new-tokens", "32",
                             "--horizon", "7", "--cost-model", "orientation", "--rtt", "0.5")
    assert code == 0, err
    tuned = read_artifact(slow_link)
    assert tuned.metadata["cost_model"]["t_rtt"] == 0.5
    assert tuned.classifier.probability(np.ones(len(tuned.spec.names))) == \
        read_artifact(trained).classifier.probability(np.ones(len(tuned.spec.names)))  # same model, new threshold


def test_wrong_draft_model_is_refused(capsys, workspace, trained, tmp_path, tiny_pair_dirs, tokenizer, home):
    other = tmp_path / "other_draft"
    tiny.qwen2(seed=7, hidden=32, layers=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    code, _, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dirs["target"]), "--draft", str(other),
                           "--dtype", "float32", "--prompt", "x", "--policy", f"disco:{trained}")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trained for draft model" in errors[0] and "Traceback" not in err


def test_other_feature_version_is_refused(trained, tmp_path):
    with zipfile.ZipFile(trained) as archive:
        meta = json.loads(archive.read("metadata.json"))
        arrays = archive.read("arrays.npz")
    meta["features"]["version"] = 999
    bad = tmp_path / "future.disco"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("metadata.json", json.dumps(meta))
        archive.writestr("arrays.npz", arrays)
    with pytest.raises(InvalidRequest, match="feature version 999"):
        read_artifact(bad)
    with pytest.raises(InvalidRequest, match="not a DISCO artifact"):
        read_artifact(tmp_path.joinpath("junk.disco").write_bytes(b"junk") and tmp_path / "junk.disco")


def test_default_artifact_ships_and_refuses_tiny_draft(tiny_pair_dirs):
    path = resolve_artifact_path("default")
    if not path.is_file():
        pytest.skip("no shipped default artifact in this checkout")
    artifact = read_artifact(path)
    assert artifact.metadata["training"]["dataset"].startswith("humaneval:train")
    assert path.stat().st_size < 5 * 1024 * 1024
    with pytest.raises(InvalidRequest, match="trained for"):
        load_learned_policy("default", draft_fingerprint="0000tinydraft000", tokenizer_hash=None)


def test_train_with_validation_selection_and_dagger(capsys, workspace, trained, home, tmp_path):
    out = tmp_path / "val.disco"
    code, stdout, err = run_cli(capsys, "train", "--dataset", str(workspace["dataset"]), *workspace["models"],
                                "--max-new-tokens", "32", "--horizon", "7", "--max-lookahead", "8",
                                "--models", "logreg", "--label", "next", "--select", "validation",
                                "--dagger-rounds", "1", "--out", str(out), "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["label"] == "next" and {row["round"] for row in summary["table"]} == {0, 1}
    assert read_artifact(out).metadata["training"]["dagger_rounds"] == 1


def test_train_and_tune_a_cumulative_rule(capsys, workspace, trained, home, tmp_path):
    from disco.speculation.policies.stop_rules import threshold_grid

    out, retuned = tmp_path / "cumulative.disco", tmp_path / "cumulative_rtt.disco"
    code, stdout, err = run_cli(capsys, "train", "--dataset", str(workspace["dataset"]), *workspace["models"],
                                "--max-new-tokens", "32", "--horizon", "7", "--max-lookahead", "8",
                                "--models", "logreg", "--label", "conditional", "--rule", "cumulative",
                                "--out", str(out), "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["rule"] == "cumulative" and summary["label"] == "conditional"
    assert [(row["label"], row["rule"]) for row in summary["table"]] == [("conditional", "cumulative")]
    artifact = read_artifact(out)
    assert artifact.rule == "cumulative" and artifact.threshold in threshold_grid("cumulative")
    code, stdout, err = run_cli(capsys, "tune", "--artifact", str(out), "--out", str(retuned),
                                "--dataset", str(workspace["dataset"]), *workspace["models"], "--max-new-tokens", "32",
                                "--horizon", "7", "--cost-model", "orientation", "--rtt", "0.5")
    assert code == 0, err
    assert "cumulative rule threshold" in stdout
    tuned = read_artifact(retuned)
    assert tuned.rule == "cumulative" and tuned.threshold in threshold_grid("cumulative")
    code, _, err = run_cli(capsys, "train", "--dataset", str(workspace["dataset"]), *workspace["models"],
                           "--label", "next", "--rule", "gain", "--out", str(tmp_path / "x.disco"))
    assert code == 2 and "need label conditional" in err


def test_train_on_greedy_and_sampled_records(capsys, workspace, trained, home, tmp_path):
    """`disco train --temperatures 0,0.9`: both record sets pooled; the artifact reads the
    draw features, and a seeded sampled request under it gives the target-only text."""
    out = tmp_path / "sampled.disco"
    code, stdout, err = run_cli(capsys, "train", "--dataset", str(workspace["dataset"]), *workspace["models"],
                                "--max-new-tokens", "32", "--horizon", "7", "--max-lookahead", "8",
                                "--models", "logreg", "--label", "conditional", "--temperatures", "0,0.9",
                                "--top-p", "0.95", "--out", str(out), "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert {"is_argmax", "temperature", "log_token_ratio"} <= set(summary["features"])
    artifact = read_artifact(out)
    assert artifact.metadata["training"]["temperatures"] == [0.0, 0.9]
    texts = {}
    for policy in ("none", f"disco:{out}"):
        code, stdout, err = run_cli(capsys, "generate", *workspace["models"], "--prompt", TRAIN_PROMPTS[0],
                                    "--max-new-tokens", "24", "--temperature", "0.9", "--top-p", "0.95",
                                    "--seed", "5", "--policy", policy, "--json")
        assert code == 0, err
        texts[policy] = json.loads(stdout)["token_ids"]
    assert texts["none"] == texts[f"disco:{out}"]
    code, _, err = run_cli(capsys, "records", "--dataset", str(workspace["dataset"]), *workspace["models"],
                           "--temperatures", "0.9,0.9")
    assert code != 0 and "distinct" in err
