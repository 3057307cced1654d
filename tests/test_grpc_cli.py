"""The CLI over gRPC: ``disco generate --server`` prints what the in-process run prints,
``disco info``, ``CODE_NAME: message`` errors, and ``disco serve`` as real processes."""

import json
import os
import signal
import subprocess
import sys

import pytest

import draft_service.server
import target_service.server
from disco.config import ModelConfig
from disco.models.loading import load_model
from disco_cli.main import main
from orchestrator.client import DiscoClient
from orchestrator.server import load_tokenizer
from tests.grpc_fixtures import free_port, start_orchestrator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def served_pair(tiny_pair_dirs, tmp_path_factory):
    """The tiny pair loaded from its HF folders, as `disco *-server` would load it."""
    home = tmp_path_factory.mktemp("home")
    def load(role):
        return load_model(ModelConfig(str(tiny_pair_dirs[role]), "float32"), role, home)

    target = target_service.server.serve(load("target"))
    draft = draft_service.server.serve(load("draft"))
    orch = start_orchestrator(load_tokenizer(str(tiny_pair_dirs["target"]), home), draft.address, target.address)
    yield orch.address
    for server in (orch, draft, target):
        server.stop(0)


def test_generate_server_json_equals_in_process(capsys, tiny_pair_dirs, served_pair):
    request = ["--prompt", "def f(x):", "--policy", "static:4", "--max-new-tokens", "24", "--ignore-eos", "--json"]
    code, out, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dirs["target"]),
                             "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", *request)
    assert code == 0, err
    local = json.loads(out)
    code, out, err = run_cli(capsys, "generate", "--server", served_pair, *request)
    assert code == 0, err
    remote = json.loads(out)
    assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]
    assert set(remote) == set(local) and set(remote["stats"]) == set(local["stats"])
    for key in ("iterations", "lookaheads", "accepted_tokens", "draft_tokens"):
        assert remote["stats"][key] == local["stats"][key]


@pytest.mark.parametrize("flags", [
    ["--json-schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false}'],
    ["--choice", "yes", "--choice", "no"],
    ["--regex", "[a-c]{2,4}!", "--temperature", "0.9", "--seed", "4"],
    ["--repetition-penalty", "0.7", "--presence-penalty", "1.0", "--frequency-penalty", "0.5", "--min-p", "0.1",
     "--logit-bias", "5=-100", "--bad-word", "def", "--stop-token-id", "7", "--min-tokens", "3",
     "--include-stop-str-in-output", "--temperature", "0.8", "--seed", "2"],
])
def test_generate_controls_and_structured_outputs_server_equals_in_process(capsys, tiny_pair_dirs, served_pair,
                                                                           flags):
    request = ["--prompt", "def f(x):", "--policy", "static:4", "--max-new-tokens", "24", "--json", *flags]
    code, out, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dirs["target"]),
                             "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", *request)
    assert code == 0, err
    local = json.loads(out)
    code, out, err = run_cli(capsys, "generate", "--server", served_pair, *request)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == local["token_ids"]
    if "--json-schema" in flags:
        assert isinstance(json.loads(local["text"])["ok"], bool)
    if "--choice" in flags:
        assert local["text"] in ("yes", "no")
    code, _, err = run_cli(capsys, "generate", "--server", served_pair, *request[:-len(flags)], "--logit-bias", "x")
    assert code != 0 and "ID=BIAS" in err


def test_generate_server_streams_and_reports_errors_as_code_and_message(capsys, served_pair):
    code, out, err = run_cli(capsys, "generate", "--server", served_pair, "--prompt", "import os",
                             "--max-new-tokens", "8", "--ignore-eos")
    assert code == 0 and out.strip() and "acceptance" in err
    code, out, err = run_cli(capsys, "generate", "--server", served_pair, "--prompt", "", "--json")
    assert code != 0 and out == "" and err.strip() == "INVALID_ARGUMENT: prompt is empty"


def test_info_json_and_unreachable_server(capsys, served_pair):
    code, out, err = run_cli(capsys, "info", "--server", served_pair, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}
    assert info["models"]["target"]["model_name"] == "target" and info["models"]["draft"]["dtype"] == "float32"
    assert "oracle" not in {policy["name"] for policy in info["policies"]}
    code, out, err = run_cli(capsys, "info", "--server", served_pair)
    assert code == 0 and "sessions" in out
    code, out, err = run_cli(capsys, "info", "--server", f"127.0.0.1:{free_port()}", "--timeout", "5")
    assert code != 0 and err.startswith("UNAVAILABLE: ")


@pytest.mark.slow  # NOTE: four Python processes importing torch take ~40 s on 2 busy cores
def test_serve_runs_three_processes_and_stops_on_sigterm(tiny_pair_dirs):
    command = [sys.executable, "-m", "disco_cli.main", "serve", "--target", str(tiny_pair_dirs["target"]),
               "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--port", "0", "--json"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addresses = json.loads(process.stdout.readline())
        assert set(addresses) == {"orchestrator", "draft", "target"}
        with DiscoClient(addresses["orchestrator"], timeout=60) as client:
            result = client.generate("def f(x):", policy="static:3", max_new_tokens=8, ignore_eos=True)
            assert len(result.token_ids) == 8
            assert client.info()["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
