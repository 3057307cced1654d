"""``disco doctor``: the JSON report on the tiny pair, its schema, and a failing check's exit code."""

import json

import pytest

from disco_cli import doctor_checks
from disco_cli.main import main

#: The checks every engine gets, in order.
ENGINE_CHECKS = ["load", "costs", "roofline", "greedy-alone", "greedy-batched", "sampled"]


def run_doctor(capsys, *argv):
    code = main(["doctor", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def pair_args(dirs):
    return ["--target", str(dirs["target"]), "--draft", str(dirs["draft"])]


def test_doctor_json_on_the_tiny_pair_passes_with_the_documented_schema(capsys, tiny_pair_dirs):
    code, out, err = run_doctor(capsys, "--device", "cpu", "--json", *pair_args(tiny_pair_dirs))
    report = json.loads(out)  # exactly one JSON object on stdout
    assert code == 0 and report["ok"] is True, err
    names = [(check["name"], check["engine"]) for check in report["checks"]]
    engines = ["float32", "bfloat16", "int8", "int4"]  # every engine a CPU supports
    assert names == [("device", None), ("engines", None), *[(name, e) for e in engines for name in ENGINE_CHECKS]]
    for check in report["checks"]:
        assert {"name", "ok", "engine", "seconds", "detail"} <= set(check) and check["ok"] is True
    assert report["checks"][1]["supported"] == report["checks"][1]["checked"] == engines
    by_name = {(c["name"], c["engine"]): c for c in report["checks"]}
    for engine in engines:
        costs = by_name["costs", engine]
        assert len(costs["target_forward_ms"]) == 5 and all(ms > 0 for ms in costs["target_forward_ms"])
        assert costs["draft_token_ms"] > 0
        roofline = by_name["roofline", engine]  # the costs just measured against the machine's floors
        assert roofline["peaks"]["read_gb_s"] > 0 and roofline["target"]["weight_bytes"] > 0
        assert [row["measured_ms"] for row in roofline["target"]["rows"]] == pytest.approx(costs["target_forward_ms"])
        assert roofline["draft"]["token"]["measured_ms"] == pytest.approx(costs["draft_token_ms"])
        assert roofline["target"]["kernels"] == [engine] if engine in ("float32", "bfloat16") else engine in "".join(
            roofline["target"]["kernels"]) or "q4q8" in "".join(roofline["target"]["kernels"])
        alone = by_name["greedy-alone", engine]
        assert alone["identical"] == alone["compared"] == 2 and alone["draft_tokens"] > 0
        assert alone["distinct_reference_tokens"] > 8  # varied output: the comparison can fail
        batched = by_name["greedy-batched", engine]
        assert batched["identical"] == batched["sessions"] == 8 and batched["identical_to_alone"] == 4
        assert batched["largest_target_batch"] >= 2  # the sessions were packed together
        sampled = by_name["sampled", engine]
        assert sampled["same_again"] and sampled["same_under_load"] and len(sampled["tokens"]) == 16
        assert sampled["other_seed_differs"]  # the request really samples
    assert "doctor:" in err  # progress lines on stderr


def test_doctor_table_and_a_failing_check_exit_non_zero(capsys, tiny_pair_dirs, monkeypatch):
    """A speculative output that differs from target-only by one token fails the greedy
    checks: the comparison is real, and the exit code says so."""
    generate = doctor_checks.SpeculativeGenerator.generate

    def corrupt_speculative(self, prompt_ids, sampling, speculation):
        result = generate(self, prompt_ids, sampling, speculation)
        if speculation.policy != "none" and sampling.is_greedy:
            result.token_ids[-1] = (result.token_ids[-1] + 1) % self.verifier.vocab_size
        return result

    monkeypatch.setattr(doctor_checks.SpeculativeGenerator, "generate", corrupt_speculative)
    code, out, _ = run_doctor(capsys, *pair_args(tiny_pair_dirs), "--engines", "float32")
    assert code == 1
    lines = {line.split()[0]: line for line in out.splitlines()[2:-1]}
    assert " FAIL " in lines["greedy-alone"] and " FAIL " in lines["greedy-batched"]
    assert " ok " in lines["load"] and " ok " in lines["sampled"]
    assert out.splitlines()[-1].startswith("FAILED: 2 of 8 checks (greedy-alone[float32], greedy-batched[float32])")


def test_doctor_refuses_a_pair_with_different_vocabularies(capsys, tmp_path, tiny_pair_dirs):
    from tests import tiny

    other = tmp_path / "other"
    tiny.qwen2(seed=9, vocab_size=300).save_pretrained(other)
    tiny.build_tokenizer(vocab_size=300, files=("ast.py",)).save_pretrained(other)
    code, out, _ = run_doctor(capsys, "--json", "--target", str(tiny_pair_dirs["target"]), "--draft", str(other),
                              "--engines", "float32")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    load = report["checks"][-1]
    assert (load["name"], load["ok"]) == ("load", False) and "vocabulary" in load["detail"]


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "device must be cpu or cuda"),
    (["--target", "x"], "--target and --draft go together"),
    (["--real", "--target", "x", "--draft", "y"], "--real checks the default pair"),
    (["--engines", "float32,int3"], "--engines takes engines of"),
    (["--policy", "none"], "--policy must draft"),
    (["--sessions", "1"], "--sessions must be >= 2"),
])
def test_doctor_bad_flags_are_one_clear_line(capsys, argv, message):
    code, out, err = run_doctor(capsys, *argv)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_doctor_without_cuda_says_so(capsys, tiny_pair_dirs, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, out, _ = run_doctor(capsys, "--device", "cuda", "--json", *pair_args(tiny_pair_dirs))
    report = json.loads(out)
    assert code == 1 and [c["name"] for c in report["checks"]] == ["device"]
    assert "finds no CUDA device" in report["checks"][0]["detail"]


def test_engines_a_cuda_device_supports_are_what_config_validation_allows():
    from disco_cli.doctor_setup import engine_support

    supported, refused = engine_support("cuda")
    assert supported == ("float32", "bfloat16")
    assert set(refused) == {"int8", "int4", "float16"} and "runs on a CPU only" in refused["int8"]
    assert "refused on cuda" in refused["float16"] and "decoding" in refused["float16"]


def test_the_random_default_pair_architectures_match_the_default_pair():
    """The shapes the doctor builds without downloads (checked against the figures of the
    prepared models' config.json, copied into the code as data)."""
    from disco.models.architectures import default_pair_architectures

    shapes = {role: (a.hidden_size, a.intermediate_size, a.num_hidden_layers, a.num_attention_heads,
                     a.num_key_value_heads, a.vocab_size, a.rope_theta, a.tie_word_embeddings)
              for role, a in default_pair_architectures().items()}
    assert shapes == {"target": (1536, 8960, 28, 12, 2, 151936, 1e6, False),
                      "draft": (896, 4864, 24, 14, 2, 151936, 1e6, False)}
    config = default_pair_architectures()["draft"].config(eos_token_id=256)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.initializer_range == 0.3


def test_the_byte_tokenizer_round_trips_text_and_ignores_ids_past_its_vocabulary():
    from disco_cli.doctor_setup import byte_tokenizer

    tokenizer = byte_tokenizer()
    ids = tokenizer("def f(x):\n    return x")["input_ids"]
    assert tokenizer.decode(ids) == "def f(x):\n    return x" and len(tokenizer) == 257
    assert tokenizer.decode([*ids[:3], 151000]) == "def"
