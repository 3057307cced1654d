"""The `disco` CLI contract: --json output, streaming, policies, clean errors."""

import json
import os
import subprocess
import sys

import pytest

from disco_cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def model_args(dirs):
    return ["--target", str(dirs["target"]), "--draft", str(dirs["draft"]), "--dtype", "float32"]


def test_generate_json_contract_and_exactness(capsys, tiny_pair_dirs):
    outputs = {}
    for policy in ("none", "static:4", "heuristic:2"):
        code, out, err = run_cli(capsys, "generate", *model_args(tiny_pair_dirs), "--prompt", "def f(x):",
                                 "--policy", policy, "--max-new-tokens", "24", "--ignore-eos", "--json")
        assert code == 0, err
        payload = json.loads(out)  # exactly one JSON object on stdout
        assert set(payload) >= {"token_ids", "text", "stats"}
        assert set(payload["stats"]) >= {"iterations", "draft_tokens", "accepted_tokens", "acceptance_rate",
                                         "lookaheads", "target_forwards", "draft_forwards", "wall_s",
                                         "tokens_per_s"}
        assert len(payload["token_ids"]) == 24
        outputs[policy] = payload
    assert outputs["static:4"]["token_ids"] == outputs["none"]["token_ids"] == outputs["heuristic:2"]["token_ids"]
    assert outputs["none"]["stats"]["draft_tokens"] == 0
    assert outputs["static:4"]["stats"]["draft_tokens"] > 0


def test_generate_streams_text_and_prints_stats(capsys, tiny_pair_dirs):
    code, out, err = run_cli(capsys, "generate", *model_args(tiny_pair_dirs), "--prompt", "import os",
                             "--policy", "static:3", "--max-new-tokens", "12", "--ignore-eos")
    assert code == 0
    assert out.strip()
    assert "tok/s" in err and "acceptance" in err


def test_policies_json(capsys):
    code, out, _ = run_cli(capsys, "policies", "--json")
    names = {row["name"] for row in json.loads(out)["policies"]}
    assert {"none", "static", "heuristic", "confidence", "adaptive-confidence", "entropy", "disco",
            "oracle"} <= names


@pytest.mark.parametrize("extra, message", [
    (["--policy", "static:zero"], "malformed policy spec"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--prompt", "   "], "prompt is empty"),
    (["--target", "/nonexistent/model"], "does not exist"),
])
def test_errors_are_one_clear_line(capsys, tiny_pair_dirs, extra, message):
    argv = ["generate", *model_args(tiny_pair_dirs), "--prompt", "x", *extra]
    code, _, err = run_cli(capsys, *argv)
    assert code != 0
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_vocabulary_mismatch_is_refused(capsys, tmp_path, tiny_pair_dirs):
    from tests import tiny
    other = tmp_path / "other"
    tiny.qwen2(seed=9, vocab_size=300).save_pretrained(other)
    tiny.build_tokenizer(vocab_size=300, files=("ast.py",)).save_pretrained(other)
    code, _, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dirs["target"]), "--draft", str(other),
                           "--dtype", "float32", "--prompt", "x")
    assert code != 0 and "vocabulary" in err.lower() and "Traceback" not in err


def test_disco_gathers_every_command_the_ray_ones_included():
    from disco_cli.main import COMMAND_MODULES, build_parser

    def commands(parser):
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    ray = {"up", "down", "status", "ray-orchestrator"}
    everything = commands(build_parser())
    without_ray = commands(build_parser(tuple(m for m in COMMAND_MODULES if m != "disco_cli.commands.ray")))
    assert everything == without_ray | ray and not without_ray & ray
    assert {"generate", "serve", "models", "bench"} <= without_ray


def test_entry_point_subprocess_has_no_traceback():
    result = subprocess.run([sys.executable, "-m", "disco_cli.main", "generate", "--prompt", "x", "--policy", "bad"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("error: unknown policy 'bad'")
    assert "Traceback" not in result.stderr


def test_core_imports_without_grpc_or_ray():
    """Every module of the shared core imports with grpc and ray made unimportable."""
    code = (
        "import sys, importlib, pkgutil\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('grpc', 'ray', 'grpc_tools', 'grpc_health', 'grpc_reflection'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import disco\n"
        "names = [m.name for m in pkgutil.walk_packages(disco.__path__, 'disco.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "assert not any(m.split('.')[0] in ('grpc', 'ray') for m in sys.modules)\n"
        "print(len(names))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 15
