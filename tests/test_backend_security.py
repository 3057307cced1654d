"""Backends serve their orchestrator only: the backend credential, sessions bound to their
caller, budgets checked before work, and exposure refused — against real servers on loopback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.errors import DiscoError
from orchestrator.client import DiscoClient
from protos.disco.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from protos.runtime.auth import BACKEND_TOKEN_ENV, auth_metadata, check_session_id, is_loopback, session_key
from protos.runtime.backend_security import BackendSecurity
from protos.runtime.metrics import sample_value
from tests.grpc_fixtures import loaded
from tests.helpers import PROMPTS

Code = grpc.StatusCode
TOKEN_A = "backend-token-a-0123456789"
TOKEN_B = "backend-token-b-0123456789"
PUBLIC = "public-token-0123456789abc"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def backends(target_model, drafts, tokenizer):
    """A target and a draft accepting two backend tokens (two callers), on loopback."""
    security = BackendSecurity(tokens=(TOKEN_A, TOKEN_B))
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), security=security)
    draft = draft_service.server.serve(loaded(drafts["same"], tokenizer, "tiny-same"), security=security)
    yield {"target": target, "draft": draft}
    for running in (target, draft):
        running.stop(0)


def stubs(backends):
    return (target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(backends["target"].address)),
            draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(backends["draft"].address)))


def start_target_session(target, session_id: str, token: str, prompt=(5, 6, 7), temperature: float = 0.0):
    sampling = common_pb2.SamplingParams(temperature=temperature, max_new_tokens=8, seed=1)
    target.StartSession(target_pb2.StartTargetSessionRequest(session_id=session_id, prompt_ids=list(prompt),
                                                              sampling=sampling),
                        metadata=auth_metadata(token), timeout=30)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code()


def test_a_backend_refuses_callers_without_its_token(backends):
    target, draft = stubs(backends)
    for metadata in ((), auth_metadata(PUBLIC), auth_metadata("Bearer-but-wrong-0123456789")):
        assert code_of(lambda: target.Info(common_pb2.ServiceInfoRequest(), metadata=metadata, timeout=10)) \
            == Code.UNAUTHENTICATED
        assert code_of(lambda: target.StartSession(target_pb2.StartTargetSessionRequest(
            session_id="x", prompt_ids=[1]), metadata=metadata, timeout=10)) == Code.UNAUTHENTICATED
        assert code_of(lambda: target.Verify(target_pb2.VerifyRequest(session_id="x"), metadata=metadata,
                                             timeout=10)) == Code.UNAUTHENTICATED
        assert code_of(lambda: list(draft.Draft(draft_pb2.DraftRequest(session_id="x"), metadata=metadata,
                                                timeout=10))) == Code.UNAUTHENTICATED
        assert code_of(lambda: draft.EndSession(common_pb2.EndSessionRequest(session_id="x"), metadata=metadata,
                                                timeout=10)) == Code.UNAUTHENTICATED
    info = target.Info(common_pb2.ServiceInfoRequest(), metadata=auth_metadata(TOKEN_A), timeout=10)
    assert info.security == "authenticated (backend token) on loopback"


def test_a_session_belongs_to_the_caller_that_started_it(backends):
    target, _ = stubs(backends)
    start_target_session(target, "victim", TOKEN_A)
    try:
        verify = target_pb2.VerifyRequest(session_id="victim", draft_token_ids=[], expected_length=3)
        # Another authenticated caller neither reads nor extends it...
        assert code_of(lambda: target.Verify(verify, metadata=auth_metadata(TOKEN_B), timeout=10)) == Code.NOT_FOUND
        target.EndSession(common_pb2.EndSessionRequest(session_id="victim"), metadata=auth_metadata(TOKEN_B),
                          timeout=10)  # ends nothing of the victim's
        # ...and its owner finds it as it left it.
        verdict = target.Verify(verify, metadata=auth_metadata(TOKEN_A), timeout=10)
        assert verdict.num_accepted == 0
    finally:
        target.EndSession(common_pb2.EndSessionRequest(session_id="victim"), metadata=auth_metadata(TOKEN_A),
                          timeout=10)


def test_a_call_at_another_length_is_refused_and_changes_nothing(backends):
    target, draft = stubs(backends)
    start_target_session(target, "lengths", TOKEN_A)
    try:
        ahead = target_pb2.VerifyRequest(session_id="lengths", draft_token_ids=[9], expected_length=4)
        with pytest.raises(grpc.RpcError) as raised:
            target.Verify(ahead, metadata=auth_metadata(TOKEN_A), timeout=10)
        assert raised.value.code() == Code.FAILED_PRECONDITION and "expects 4" in raised.value.details()
        missing = target_pb2.VerifyRequest(session_id="lengths", draft_token_ids=[9])
        with pytest.raises(grpc.RpcError) as raised:
            target.Verify(missing, metadata=auth_metadata(TOKEN_A), timeout=10)
        assert raised.value.code() == Code.INVALID_ARGUMENT and "expected_length" in raised.value.details()
        first = target.Verify(target_pb2.VerifyRequest(session_id="lengths", draft_token_ids=[9], expected_length=3),
                              metadata=auth_metadata(TOKEN_A), timeout=10)
        # The same call repeated (a replay) no longer matches: the session grew by the verdict.
        again = target_pb2.VerifyRequest(session_id="lengths", draft_token_ids=[9], expected_length=3)
        assert code_of(lambda: target.Verify(again, metadata=auth_metadata(TOKEN_A), timeout=10)) \
            == Code.FAILED_PRECONDITION
        target.Verify(target_pb2.VerifyRequest(session_id="lengths", expected_length=3 + first.num_accepted + 1),
                      metadata=auth_metadata(TOKEN_A), timeout=10)
    finally:
        target.EndSession(common_pb2.EndSessionRequest(session_id="lengths"), metadata=auth_metadata(TOKEN_A),
                          timeout=10)
    # The draft side: the first block expects the prompt's length; its feedback, one more than accepted.
    metadata = auth_metadata(TOKEN_A)
    draft.StartSession(draft_pb2.StartDraftSessionRequest(session_id="d", prompt_ids=[5, 6, 7], policy="static:2",
                                                          sampling=common_pb2.SamplingParams(max_new_tokens=8)),
                       metadata=metadata, timeout=30)
    try:
        assert code_of(lambda: list(draft.Draft(draft_pb2.DraftRequest(session_id="d", max_lookahead=2,
                                                                       expected_length=2),
                                                metadata=metadata, timeout=10))) == Code.FAILED_PRECONDITION
        events = list(draft.Draft(draft_pb2.DraftRequest(session_id="d", max_lookahead=2, expected_length=3),
                                  metadata=metadata, timeout=10))
        assert sum(event.HasField("token") for event in events) == 2
        feedback = common_pb2.Feedback(num_accepted=1, bonus_token_id=4)
        assert code_of(lambda: list(draft.Draft(draft_pb2.DraftRequest(
            session_id="d", max_lookahead=2, feedback=feedback, expected_length=6), metadata=metadata,
            timeout=10))) == Code.FAILED_PRECONDITION
        events = list(draft.Draft(draft_pb2.DraftRequest(session_id="d", max_lookahead=2, feedback=feedback,
                                                         expected_length=5), metadata=metadata, timeout=10))
        assert events[-1].HasField("summary")
    finally:
        draft.EndSession(common_pb2.EndSessionRequest(session_id="d"), metadata=metadata, timeout=10)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def test_a_huge_claimed_vocabulary_is_refused_before_any_allocation(backends):
    target, _ = stubs(backends)
    sparse = common_pb2.SparseDistribution(ids_u32=(7).to_bytes(4, "little"), probs_f32=b"\0\0\x80\x3f")
    probs = [common_pb2.Distribution(vocab_size=1 << 22, sparse=sparse) for _ in range(32)]
    start_target_session(target, "sampled", TOKEN_A, temperature=1.0)
    try:
        for session_id, expected in (("no-such-session", Code.NOT_FOUND), ("sampled", Code.INVALID_ARGUMENT)):
            request = target_pb2.VerifyRequest(session_id=session_id, draft_token_ids=[7] * 32, draft_probs=probs,
                                               expected_length=3)
            assert len(request.SerializeToString()) < 1024
            before, started = rss_bytes(), time.perf_counter()
            assert code_of(lambda: target.Verify(request, metadata=auth_metadata(TOKEN_A), timeout=10)) == expected
            assert time.perf_counter() - started < 5.0  # generous: a shared machine; the bound is the memory
            assert rss_bytes() - before < 50 * 1024 * 1024
        request = target_pb2.VerifyRequest(session_id="sampled", draft_token_ids=[7], draft_probs=probs[:2],
                                           expected_length=3)
        with pytest.raises(grpc.RpcError) as raised:
            target.Verify(request, metadata=auth_metadata(TOKEN_A), timeout=10)
        assert raised.value.code() == Code.INVALID_ARGUMENT and "2 distributions for 1 draft tokens" in \
            raised.value.details()
    finally:
        target.EndSession(common_pb2.EndSessionRequest(session_id="sampled"), metadata=auth_metadata(TOKEN_A),
                          timeout=10)


@pytest.mark.parametrize("session_id", ["evil\nINFO forged line", "x" * 1_000_000, "", "a b", "é"])
def test_bad_session_ids_are_refused_and_never_logged_raw(backends, session_id, caplog):
    target, _ = stubs(backends)
    caplog.set_level(logging.DEBUG)
    request = target_pb2.StartTargetSessionRequest(session_id=session_id, prompt_ids=[1, 2])
    with pytest.raises(grpc.RpcError) as raised:
        target.StartSession(request, metadata=auth_metadata(TOKEN_A), timeout=10)
    assert raised.value.code() == Code.INVALID_ARGUMENT and "session_id" in raised.value.details()
    assert "forged line" not in caplog.text and len(caplog.text) < 100_000


def test_session_ids_and_keys():
    check_session_id("0123abcdef~2")
    for bad in ("", "a/b", "x" * 129, "tab\t"):
        with pytest.raises(DiscoError):
            check_session_id(bad)
    key = session_key("token:abc", "s1")
    assert key == "token:abc/s1" and repr(key) == "'s1'" and key != session_key("token:def", "s1")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "backend.example"])
def test_an_exposed_backend_is_refused_unless_insecure(host, tmp_path):
    from protos.runtime.tls import TlsFiles

    assert not is_loopback(host)
    with pytest.raises(DiscoError, match="without TLS.*--insecure"):
        BackendSecurity(tokens=(TOKEN_A,)).statement(host, None)
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("cert"), key.write_text("key")
    tls = TlsFiles.from_paths(cert, key)
    with pytest.raises(DiscoError, match="with TLS but no client authentication"):
        BackendSecurity().statement(host, tls)
    assert BackendSecurity(tokens=(TOKEN_A,)).statement(host, tls) == "authenticated (backend token) over TLS"
    assert BackendSecurity(insecure=True).statement(host, None).startswith("INSECURE (--insecure)")


def test_an_insecure_backend_says_so_in_info_and_metrics(target_model, tokenizer, caplog):
    running = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), host="0.0.0.0",
                                          security=BackendSecurity(insecure=True), metrics_port=0)
    try:
        assert "!!!" in caplog.text
        channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        info = target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.ServiceInfoRequest(), timeout=10)
        assert info.security.startswith("INSECURE")
        assert sample_value(running.metrics.exposition(), "disco_insecure") == 1
    finally:
        running.stop(0)


def test_target_server_on_every_interface_without_tls_exits_naming_the_flags(tmp_path):
    env = {**os.environ, "DISCO_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "disco_cli.main", "target-server", "--host", "0.0.0.0",
                             "--model", str(tmp_path / "never-loaded")], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "TLS" in result.stderr and "--insecure" in result.stderr, result.stderr
    assert time.perf_counter() - started < 60  # refused before any model is looked for


def children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_disco_serve_backends_answer_only_the_orchestrator(tiny_pair_dirs, tmp_path):
    """``disco serve --auth-token-file`` on every interface: the backends stay on loopback and
    refuse the public token and anonymous calls; the orchestrator serves; no token on a command line."""
    tokens = tmp_path / "api-keys"
    tokens.write_text(f"# two API keys\n{PUBLIC}\nsecond-public-key-0123456789\n")
    command = [sys.executable, "-m", "disco_cli.main", "serve", "--target", str(tiny_pair_dirs["target"]),
               "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--host", "0.0.0.0", "--port", "0",
               "--json", "--auth-token-file", str(tokens)]
    env = {**os.environ, "DISCO_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("DISCO_AUTH_TOKEN", None)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        addresses = json.loads(process.stdout.readline())
        assert addresses["draft"].startswith("127.0.0.1:") and addresses["target"].startswith("127.0.0.1:")
        orchestrator_port = addresses["orchestrator"].rpartition(":")[2]
        for key in (PUBLIC, "second-public-key-0123456789"):
            with DiscoClient(f"127.0.0.1:{orchestrator_port}", timeout=60, auth_token=key) as client:
                result = client.generate(PROMPTS[0], policy="static:3", max_new_tokens=8, ignore_eos=True)
            assert result.stats["draft_fallbacks"] == 0 and result.stats["draft_tokens"] > 0
        target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(addresses["target"]))
        draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(addresses["draft"]))
        for metadata in ((), auth_metadata(PUBLIC)):
            assert code_of(lambda: target.StartSession(target_pb2.StartTargetSessionRequest(
                session_id="intruder", prompt_ids=[1, 2]), metadata=metadata, timeout=10)) == Code.UNAUTHENTICATED
            assert code_of(lambda: list(draft.Draft(draft_pb2.DraftRequest(session_id="intruder"),
                                                    metadata=metadata, timeout=10))) == Code.UNAUTHENTICATED
        # The backend token lives in the children's environment, never on a command line.
        backend_tokens = {child.environ().get(BACKEND_TOKEN_ENV) for child in children(process.pid)}
        backend_tokens.discard(None)
        assert len(backend_tokens) == 1
        secret = backend_tokens.pop()
        assert secret not in (PUBLIC, "second-public-key-0123456789") and len(secret) >= 32
        for other in psutil.process_iter(["cmdline"]):
            assert not any(secret in part or PUBLIC in part for part in other.info["cmdline"] or ())
    finally:
        process.terminate()
        process.wait(30)
