"""TLS everywhere, mutual TLS between the orchestrator and its backends, and the bearer
token of the public API — with certificates made by a throwaway CA in the test."""

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import draft_service.server
import orchestrator.server
import target_service.server
from disco_cli.main import main
from orchestrator.client import AsyncDiscoClient, DiscoClient, DiscoRpcError
from protos.disco.v1 import common_pb2, target_pb2_grpc
from protos.runtime.tls import TlsFiles, secure_channel
from tests.grpc_fixtures import loaded
from tests.helpers import PROMPTS
from tests.pki import Authority

Code = grpc.StatusCode
TOKEN = "s3cret-token"
REQUEST = dict(policy="static:3", max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, rogue = Authority(folder, "ca"), Authority(folder, "rogue")
    return {"ca": ca, "rogue": rogue, "server": ca.issue("server"), "orchestrator": ca.issue("orchestrator"),
            "client": ca.issue("client"), "rogue_client": rogue.issue("intruder")}


@pytest.fixture(scope="module")
def secure_stack(pki, target_model, drafts, tokenizer):
    """Backends requiring client certificates (mTLS); a TLS orchestrator with a token."""
    server = pki["server"]
    backend_tls = TlsFiles.from_paths(server.cert, server.key, pki["ca"].ca)
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), tls=backend_tls)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"), tls=backend_tls)
    identity = pki["orchestrator"]
    orch = orchestrator.server.serve(tokenizer, draft.address, target.address, auth_tokens=TOKEN,
                                     tls=TlsFiles.from_paths(identity.cert, identity.key, pki["ca"].ca))
    yield {"orchestrator": orch, "draft": draft, "target": target}
    for running in (orch, draft, target):
        running.stop(0)


def client(stack, pki, **kwargs):
    options = dict(tls_ca=str(pki["ca"].ca), auth_token=TOKEN, timeout=30)
    options.update(kwargs)
    return DiscoClient(stack["orchestrator"].address, **options)


def test_round_trip_over_tls_and_mtls(secure_stack, pki):
    assert all(secure_stack[name].tls for name in ("orchestrator", "draft", "target"))
    with client(secure_stack, pki) as disco:
        speculative = disco.generate(PROMPTS[0], **REQUEST)
        baseline = disco.generate(PROMPTS[0], **{**REQUEST, "policy": "none"})
        info = disco.info()
    assert speculative.token_ids == baseline.token_ids and speculative.stats["draft_tokens"] > 0
    assert speculative.stats["draft_fallbacks"] == 0  # the draft was reached through mTLS
    assert info["errors"] == [] and info["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}


def test_async_client_over_tls(secure_stack, pki):
    async def run():
        async with AsyncDiscoClient(secure_stack["orchestrator"].address, tls_ca=str(pki["ca"].ca),
                                    auth_token=TOKEN, timeout=30) as disco:
            return await disco.generate(PROMPTS[1], **REQUEST)

    assert len(asyncio.run(run()).token_ids) == REQUEST["max_new_tokens"]


@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated(secure_stack, pki, token, monkeypatch):
    monkeypatch.delenv("DISCO_AUTH_TOKEN", raising=False)
    with client(secure_stack, pki, auth_token=token) as disco:
        for call in (lambda: disco.generate(PROMPTS[0], **REQUEST), lambda: list(disco.stream(PROMPTS[0], **REQUEST)),
                     disco.info):
            with pytest.raises(DiscoRpcError) as raised:
                call()
            assert raised.value.code() == Code.UNAUTHENTICATED and "bearer token" in raised.value.details()


def test_token_from_the_environment(secure_stack, pki, monkeypatch):
    monkeypatch.setenv("DISCO_AUTH_TOKEN", TOKEN)
    with client(secure_stack, pki, auth_token=None) as disco:
        assert disco.info()["errors"] == []


def test_health_checks_need_no_token(secure_stack, pki):
    tls = TlsFiles.from_paths(ca=pki["ca"].ca)
    channel = secure_channel(secure_stack["orchestrator"].address, tls)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_clients_that_do_not_speak_tls_or_distrust_the_server_are_refused(secure_stack, pki):
    address = secure_stack["orchestrator"].address
    for disco in (DiscoClient(address, timeout=10, auth_token=TOKEN),  # plaintext to a TLS port
                  DiscoClient(address, timeout=10, auth_token=TOKEN, tls_ca=str(pki["rogue"].ca))):
        with pytest.raises(DiscoRpcError) as raised:
            disco.info()
        assert raised.value.code() == Code.UNAVAILABLE
        disco.close()


@pytest.mark.parametrize("identity", ["none", "rogue"])
def test_backends_refuse_clients_without_a_certificate_from_the_ca(secure_stack, pki, identity):
    """mTLS: a client that verifies the backend but has no (or a foreign) certificate gets nowhere."""
    rogue = pki["rogue_client"]
    tls = (TlsFiles.from_paths(ca=pki["ca"].ca) if identity == "none"
           else TlsFiles.from_paths(rogue.cert, rogue.key, pki["ca"].ca))
    channel = secure_channel(secure_stack["target"].address, tls)
    with pytest.raises(grpc.RpcError) as raised:
        target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.ServiceInfoRequest(), timeout=10)
    assert raised.value.code() == Code.UNAVAILABLE
    channel.close()
    good = pki["client"]
    channel = secure_channel(secure_stack["target"].address, TlsFiles.from_paths(good.cert, good.key, pki["ca"].ca))
    assert target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.ServiceInfoRequest(), timeout=10).role == "target"
    channel.close()


def test_orchestrator_without_a_client_certificate_cannot_use_the_backends(secure_stack, pki, tokenizer):
    stack = secure_stack
    orch = orchestrator.server.serve(tokenizer, stack["draft"].address, stack["target"].address,
                                     tls=TlsFiles.from_paths(ca=pki["ca"].ca))  # verifies them, presents nothing
    try:
        with DiscoClient(orch.address, timeout=10) as disco:  # its own public side is plaintext here
            with pytest.raises(DiscoRpcError) as raised:
                disco.generate(PROMPTS[0], **REQUEST)
            assert raised.value.code() == Code.UNAVAILABLE
            assert len(disco.info()["errors"]) == 2
    finally:
        orch.stop(0)


def test_public_client_certificates_can_be_required(secure_stack, pki, tokenizer):
    stack, identity, good, rogue = secure_stack, pki["orchestrator"], pki["client"], pki["rogue_client"]
    orch = orchestrator.server.serve(tokenizer, stack["draft"].address, stack["target"].address,
                                     tls=TlsFiles.from_paths(identity.cert, identity.key, pki["ca"].ca),
                                     require_client_cert=True)
    try:
        ca = str(pki["ca"].ca)
        with DiscoClient(orch.address, timeout=10, tls_ca=ca, tls_cert=str(good.cert), tls_key=str(good.key)) as ok:
            assert ok.info()["errors"] == []
        for cert in (None, rogue):
            kwargs = dict(tls_cert=str(cert.cert), tls_key=str(cert.key)) if cert else {}
            with DiscoClient(orch.address, timeout=10, tls_ca=ca, **kwargs) as refused:
                with pytest.raises(DiscoRpcError) as raised:
                    refused.info()
                assert raised.value.code() == Code.UNAVAILABLE
    finally:
        orch.stop(0)


def test_cli_client_flags(secure_stack, pki, capsys, monkeypatch):
    monkeypatch.delenv("DISCO_AUTH_TOKEN", raising=False)
    address, ca = secure_stack["orchestrator"].address, str(pki["ca"].ca)
    assert main(["info", "--server", address, "--tls-ca", ca, "--auth-token", TOKEN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["active_sessions"]["target"] == 0
    assert main(["info", "--server", address, "--tls-ca", ca, "--json"]) == 1
    assert capsys.readouterr().err.startswith("UNAUTHENTICATED: ")
    monkeypatch.setenv("DISCO_AUTH_TOKEN", TOKEN)
    assert main(["generate", "--server", address, "--tls-ca", ca, "--prompt", PROMPTS[0], "--max-new-tokens", "5",
                 "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 5
    assert main(["info", "--server", address, "--tls-ca", "/nonexistent/ca.pem"]) == 2
    assert "cannot read --tls-ca" in capsys.readouterr().err


@pytest.mark.slow  # NOTE: three Python processes importing torch take ~40 s on 2 busy cores
def test_disco_serve_with_tls_token_metrics_and_json_logs(pki, tiny_pair_dirs, tmp_path):
    """The flags reach the three children: mTLS inside, TLS + token outside, /metrics, JSON logs."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from protos.runtime.metrics import sample_value

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server, log = pki["server"], tmp_path / "serve.log"
    command = [sys.executable, "-m", "disco_cli.main", "serve", "--target", str(tiny_pair_dirs["target"]),
               "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--port", "0", "--json",
               "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(pki["ca"].ca),
               "--metrics-port", "0", "--log-format", "json"]
    env = {**os.environ, "DISCO_AUTH_TOKEN": TOKEN, "DISCO_HOME": str(tmp_path), "PYTHONPATH": repo}
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        addresses = json.loads(process.stdout.readline())
        assert set(addresses["metrics"]) == {"orchestrator", "draft", "target"}
        with DiscoClient(addresses["orchestrator"], timeout=60, tls_ca=str(pki["ca"].ca), auth_token=TOKEN) as disco:
            result = disco.generate(PROMPTS[0], **REQUEST)
            assert result.stats["draft_fallbacks"] == 0 and result.stats["draft_tokens"] > 0
        for name, address in addresses["metrics"].items():
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                text = response.read().decode()
            assert sample_value(text, "disco_service_info", {"role": name}) == 1
            if name == "orchestrator":
                assert sample_value(text, "disco_generation_tokens_total") == REQUEST["max_new_tokens"]
        with DiscoClient(addresses["orchestrator"], timeout=10, tls_ca=str(pki["ca"].ca), auth_token="") as anonymous:
            with pytest.raises(DiscoRpcError) as raised:
                anonymous.info()
            assert raised.value.code() == Code.UNAUTHENTICATED
        # The backends refuse a client without the CA's certificate.
        channel = secure_channel(addresses["target"], TlsFiles.from_paths(ca=pki["ca"].ca))
        with pytest.raises(grpc.RpcError):
            target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.ServiceInfoRequest(), timeout=10)
        channel.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert entries and all({"ts", "level", "logger", "message"} <= set(entry) for entry in entries)
    assert any(e["message"].startswith("request finished") and e.get("session_id") for e in entries)
