"""Limits over gRPC: each one refused with its status code and a message naming it; a
full or failing draft service degrades requests to target-only instead of failing them;
a draft service opens only the DISCO artifacts its operator allowed."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.engines.sessions import SessionLimits
from orchestrator.client import DiscoClient, DiscoRpcError
from orchestrator.servicer import OrchestratorLimits
from protos.disco.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.disco_fixtures import handmade_artifact
from tests.grpc_fixtures import loaded
from tests.helpers import PROMPTS

Code = grpc.StatusCode
LONG = dict(policy="static:1", max_new_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def servers(target_model, drafts, tokenizer, tmp_path_factory):
    artifacts = tmp_path_factory.mktemp("artifacts")
    handmade_artifact(draft_fingerprint="tiny-noisy").save(artifacts / "tiny.disco")
    (artifacts / "garbage.disco").write_bytes(b"not a zip")
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), max_prompt_tokens=64)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"), max_prompt_tokens=64,
                                       artifact_dirs=[artifacts])
    yield {"target": target, "draft": draft, "artifacts": artifacts}
    target.stop(0)
    draft.stop(0)


@pytest.fixture(scope="module")
def client(servers, tokenizer):
    orch = orchestrator.server.serve(tokenizer, servers["draft"].address, servers["target"].address,
                                     limits=OrchestratorLimits(max_prompt_tokens=16))
    with DiscoClient(orch.address, timeout=60) as disco:
        yield disco
    orch.stop(0)


def refused(call) -> DiscoRpcError | grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def test_prompt_limit_of_the_orchestrator(client, tokenizer):
    long_prompt = PROMPTS[1] * 3
    assert len(tokenizer(long_prompt)["input_ids"]) > 16
    error = refused(lambda: client.generate(long_prompt, max_new_tokens=4))
    assert error.code() == Code.INVALID_ARGUMENT and "limit of 16" in error.details()
    assert "--max-prompt-tokens" in error.details()
    error = refused(lambda: client.generate(prompt_ids=list(range(17)), max_new_tokens=4))
    assert error.code() == Code.INVALID_ARGUMENT and "17 tokens" in error.details()
    assert client.info()["limits"]["max_prompt_tokens"] == 16
    assert len(client.generate(prompt_ids=list(range(16)), max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_prompt_limit_of_the_backends(servers):
    sampling = common_pb2.SamplingParams(max_new_tokens=4)
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(servers["target"].address))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(servers["draft"].address))
    for call, role in ((lambda: target.StartSession(target_pb2.StartTargetSessionRequest(
            session_id="long", prompt_ids=[3] * 65, sampling=sampling), timeout=10), "target"),
                       (lambda: draft.StartSession(draft_pb2.StartDraftSessionRequest(
                           session_id="long", prompt_ids=[3] * 65, sampling=sampling, policy="static:2"),
                           timeout=10), "draft")):
        error = refused(call)
        assert error.code() == Code.INVALID_ARGUMENT
        assert f"65 tokens, more than the limit of 64 of the {role} service" in error.details()


def test_a_full_target_is_resource_exhausted_a_full_draft_is_skipped(target_model, drafts, tokenizer):
    one = SessionLimits(max_sessions=1)
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), limits=one)
    small_draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"), limits=one)
    big_target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    orchs = [orchestrator.server.serve(tokenizer, small_draft.address, address)
             for address in (target.address, big_target.address)]
    clients = [DiscoClient(orch.address, timeout=60) for orch in orchs]
    try:
        # The target holds one session: a second request is refused, naming the limit.
        first = iter(clients[0].stream(PROMPTS[0], **LONG))
        next(first)
        error = refused(lambda: clients[0].generate(PROMPTS[1], policy="none", max_new_tokens=4))
        assert error.code() == Code.RESOURCE_EXHAUSTED and "too many active sessions (1)" in error.details()
        first.close()
        deadline = time.monotonic() + 10
        while small_draft.servicers[0].engine.active_sessions() and time.monotonic() < deadline:
            time.sleep(0.02)  # the cancellation reaches the draft service asynchronously
        # The draft holds one session: a second request goes on target-only, exactly.
        stream = clients[1].stream(PROMPTS[0], **LONG)
        chunks = iter(stream)
        next(chunks)
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(clients[1].generate, PROMPTS[1], policy="static:3", max_new_tokens=12,
                                 ignore_eos=True).result()
        baseline = clients[1].generate(PROMPTS[1], policy="none", max_new_tokens=12, ignore_eos=True)
        assert second.stats["draft_fallbacks"] == 1 and second.token_ids == baseline.token_ids
        list(chunks)
        assert stream.result.stats["draft_fallbacks"] == 0
    finally:
        for disco in clients:
            disco.close()
        for running in (*orchs, target, small_draft, big_target):
            running.stop(0)


@pytest.mark.parametrize("name", ["/dev/zero", "/etc/passwd", "../../../../etc/passwd", "/nonexistent.disco",
                                  "missing.disco", "nested/../../x.disco", "/proc/self/environ"])
def test_the_draft_opens_only_allowed_artifacts(client, name):
    error = refused(lambda: client.generate(PROMPTS[0], policy=f"disco:{name}", max_new_tokens=4))
    assert error.code() == Code.INVALID_ARGUMENT
    assert "not available on this draft service" in error.details() and "--artifact-dir" in error.details()


def test_allowed_artifacts_are_served(client, servers):
    baseline = client.generate(PROMPTS[2], policy="none", max_new_tokens=12, ignore_eos=True)
    for name in ("tiny.disco", str(servers["artifacts"] / "tiny.disco")):
        result = client.generate(PROMPTS[2], policy=f"disco:{name}", max_new_tokens=12, ignore_eos=True)
        assert result.token_ids == baseline.token_ids and result.stats["draft_tokens"] > 0
    error = refused(lambda: client.generate(PROMPTS[2], policy="disco:garbage.disco", max_new_tokens=4))
    assert error.code() == Code.INVALID_ARGUMENT and "not a DISCO artifact" in error.details()  # reached the reader


def test_idle_sessions_expire(target_model, tokenizer):
    running = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"),
                                          limits=SessionLimits(idle_ttl_s=0.3))
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(running.address))
    try:
        stub.StartSession(target_pb2.StartTargetSessionRequest(
            session_id="idle", prompt_ids=[1, 2], sampling=common_pb2.SamplingParams(max_new_tokens=4)), timeout=10)
        assert stub.Info(common_pb2.ServiceInfoRequest(), timeout=10).active_sessions == 1
        time.sleep(0.5)
        assert stub.Info(common_pb2.ServiceInfoRequest(), timeout=10).active_sessions == 0
        error = refused(lambda: stub.Verify(target_pb2.VerifyRequest(session_id="idle"), timeout=10))
        assert error.code() == Code.NOT_FOUND and "expired" in error.details()
    finally:
        running.stop(0)


def test_an_erroring_draft_is_skipped(target_model, drafts, tokenizer):
    """A draft service that answers INTERNAL mid-request: the request goes on target-only, exactly."""
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    engine = draft.servicers[0].engine
    real_draft, calls = engine.draft, []

    def failing_draft(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError("draft bug")
        return real_draft(*args, **kwargs)

    engine.draft = failing_draft
    orch = orchestrator.server.serve(tokenizer, draft.address, target.address)
    try:
        with DiscoClient(orch.address, timeout=60) as disco:
            result = disco.generate(PROMPTS[0], policy="static:3", max_new_tokens=20, ignore_eos=True)
            baseline = disco.generate(PROMPTS[0], policy="none", max_new_tokens=20, ignore_eos=True)
            assert result.token_ids == baseline.token_ids
            assert result.stats["draft_fallbacks"] == 1 and result.stats["lookaheads"][:2] == [3, 3]
            assert disco.info()["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}
    finally:
        for running in (orch, draft, target):
            running.stop(0)
