"""Bad input, faults and cancellation over real gRPC servers: every failure is a clear
status code with a message naming the field, never a crash or a hang, and sessions are
always freed."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import draft_service.server
from disco.errors import Unavailable
from orchestrator.backends import CONNECT_WAIT_S, Backends
from orchestrator.client import DiscoClient, DiscoRpcError
from orchestrator.remote import CallScope
from orchestrator.servicer import SERVICE_NAME, OrchestratorLimits, OrchestratorServicer
from protos import convert
from protos.disco.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc
from protos.runtime.server import Cancelled, DeadlineExceeded, start_server, status_for
from tests.grpc_fixtures import free_port, grpc_stacks, loaded, start_orchestrator  # noqa: F401 - fixture
from tests.helpers import PROMPTS

Code = grpc.StatusCode
LONG = dict(max_new_tokens=400, ignore_eos=True, policy="static:4")  # runs long enough to interrupt

BAD_REQUESTS = [
    (dict(prompt=""), Code.INVALID_ARGUMENT, "prompt is empty"),
    (dict(max_new_tokens=0), Code.INVALID_ARGUMENT, "max_new_tokens"),
    (dict(max_new_tokens=-3), Code.INVALID_ARGUMENT, "max_new_tokens"),
    (dict(max_new_tokens=5000), Code.INVALID_ARGUMENT, "max_new_tokens must be <= 4096"),
    (dict(prompt="x" * 600), Code.INVALID_ARGUMENT, "context"),
    (dict(policy="static:x"), Code.INVALID_ARGUMENT, "policy spec"),
    (dict(policy="bogus:1"), Code.INVALID_ARGUMENT, "unknown policy 'bogus'"),
    (dict(policy="oracle"), Code.INVALID_ARGUMENT, "oracle"),
    (dict(max_lookahead=0), Code.INVALID_ARGUMENT, "max_lookahead"),
    (dict(max_lookahead=65), Code.INVALID_ARGUMENT, "max_lookahead"),
    (dict(temperature=-1.0), Code.INVALID_ARGUMENT, "temperature"),
    (dict(temperature=float("nan")), Code.INVALID_ARGUMENT, "temperature"),
    (dict(temperature=0.5, top_p=0.0), Code.INVALID_ARGUMENT, "top_p"),
    (dict(top_k=-1), Code.INVALID_ARGUMENT, "top_k"),
    (dict(seed=-1), Code.INVALID_ARGUMENT, "seed"),
    (dict(stop=[""]), Code.INVALID_ARGUMENT, "stop strings"),
    (dict(prompt_ids=[1, 10**6]), Code.INVALID_ARGUMENT, "prompt token ids"),
    (dict(chat=True), Code.INVALID_ARGUMENT, "chat template"),
    (dict(messages=[("user", "Hi")]), Code.INVALID_ARGUMENT, "chat template"),
    (dict(messages=[("robot", "Hi")]), Code.INVALID_ARGUMENT, "messages[0].role"),
    (dict(messages=[("user", "Hi"), ("assistant", "Hello")]), Code.INVALID_ARGUMENT, "last message"),
    (dict(messages=[("system", ""), ("user", "")]), Code.INVALID_ARGUMENT, "prompt is empty"),
]


@pytest.mark.parametrize("mode", ["unary", "stream"])
@pytest.mark.parametrize("request_args, code, message", BAD_REQUESTS)
def test_bad_request_gets_its_status_code(request_args, code, message, mode, grpc_stacks):
    stack = grpc_stacks["noisy"]
    request_args = {"prompt": PROMPTS[0], "max_new_tokens": 8, **request_args}
    with pytest.raises(DiscoRpcError) as raised:
        if mode == "unary":
            stack.client.generate(**request_args)
        else:
            list(stack.client.stream(**request_args))
    assert raised.value.code() == code
    assert message in raised.value.details()
    assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}


def test_unknown_session_is_not_found(grpc_stacks):
    stack = grpc_stacks["noisy"]
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(stack.draft.address))
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.target.address))
    with pytest.raises(grpc.RpcError) as raised:
        list(draft.Draft(draft_pb2.DraftRequest(session_id="nope", max_lookahead=3), timeout=10))
    assert raised.value.code() == Code.NOT_FOUND and "session 'nope'" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        target.Verify(target_pb2.VerifyRequest(session_id="nope", draft_token_ids=[1]), timeout=10)
    assert raised.value.code() == Code.NOT_FOUND and "session 'nope'" in raised.value.details()


def test_malformed_distribution_is_invalid_argument(grpc_stacks):
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(grpc_stacks["noisy"].target.address))
    sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    target.StartSession(target_pb2.StartTargetSessionRequest(session_id="s1", prompt_ids=[5, 6], sampling=sampling),
                        timeout=10)
    try:
        for bad, message in [(common_pb2.Distribution(vocab_size=512, dense_f32=b"\0" * 12), "dense_f32 has 12 bytes"),
                             (common_pb2.Distribution(vocab_size=0), "vocab_size"),
                             (common_pb2.Distribution(vocab_size=512), "no values")]:
            with pytest.raises(grpc.RpcError) as raised:
                target.Verify(target_pb2.VerifyRequest(session_id="s1", draft_token_ids=[3], draft_probs=[bad],
                                                       expected_length=2),
                              timeout=10)
            assert raised.value.code() == Code.INVALID_ARGUMENT and message in raised.value.details()
    finally:
        target.EndSession(common_pb2.EndSessionRequest(session_id="s1"), timeout=10)


def test_unexpected_errors_are_internal_with_a_generic_message(target_model, tokenizer, caplog):
    running = draft_service.server.serve(loaded(target_model, tokenizer, "tiny"))

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    running.servicers[0].engine.draft = broken
    running.servicers[0].engine.sessions.get = broken
    running.servicers[0].engine.active_sessions = broken
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(running.address))
    try:
        for call in (lambda: stub.Info(common_pb2.ServiceInfoRequest(), timeout=10),
                     lambda: list(stub.Draft(draft_pb2.DraftRequest(session_id="x"), timeout=10))):
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == Code.INTERNAL
            assert "secret" not in raised.value.details() and "server log" in raised.value.details()
        assert "secret internal detail" in caplog.text  # logged with its traceback
    finally:
        running.stop(0)


def test_health_serving_and_reflection_lists_the_services(grpc_stacks):
    stack = grpc_stacks["noisy"]
    expected = {stack.orchestrator.address: "disco.v1.Orchestrator", stack.draft.address: "disco.v1.DraftService",
                stack.target.address: "disco.v1.TargetService"}
    for address, service in expected.items():
        channel = grpc.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {service, "grpc.health.v1.Health"} <= services
        channel.close()


def test_cancelling_a_stream_frees_every_session(grpc_stacks):
    stack = grpc_stacks["noisy"]
    stream = stack.client.stream(PROMPTS[0], **LONG)
    for count, _ in enumerate(stream, start=1):
        if count == 3:
            break  # leaving the loop cancels the call
    assert stream.result is None
    assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}
    assert stack.client.info()["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}


def test_deadline_is_honoured_and_frees_every_session(grpc_stacks):
    stack = grpc_stacks["noisy"]
    client = DiscoClient(stack.orchestrator.address, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(DiscoRpcError) as raised:
        client.generate(PROMPTS[0], **LONG)
    assert raised.value.code() == Code.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2.0
    assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}
    client.close()


def test_a_passed_deadline_is_deadline_exceeded_whichever_side_notices():
    """The orchestrator may notice the deadline before the client's own timer fires: its
    answer must then be DEADLINE_EXCEEDED too (not CANCELLED, which is the client's act)."""
    scope = CallScope(deadline=time.monotonic() - 0.01)
    with pytest.raises(DeadlineExceeded) as raised:
        scope.timeout()
    assert status_for(raised.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED

    class TimedOut(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return "Deadline Exceeded"

    def backend_timed_out(timeout):
        raise TimedOut()

    with pytest.raises(DeadlineExceeded):  # the backend call was cut by the request's deadline
        CallScope(deadline=time.monotonic() + 0.005).call(lambda t: (time.sleep(0.01), backend_timed_out(t)),
                                                         "target service")
    with pytest.raises(Unavailable):  # cut by the per-call cap, with the request's time left
        CallScope(deadline=time.monotonic() + 60).call(backend_timed_out, "target service")
    scope = CallScope()
    scope.cancel()
    with pytest.raises(Cancelled) as raised:
        scope.timeout()
    assert status_for(raised.value)[0] == grpc.StatusCode.CANCELLED


def test_backend_down_is_unavailable_fast(grpc_stacks, tokenizer):
    stack = grpc_stacks["noisy"]
    dead = f"127.0.0.1:{free_port()}"
    for draft, target, policy in [(stack.draft.address, dead, "none"), (dead, stack.target.address, "static:3")]:
        orch = start_orchestrator(tokenizer, draft, target)
        client = DiscoClient(orch.address, timeout=10)
        started = time.monotonic()
        if target == dead:
            with pytest.raises(DiscoRpcError) as raised:
                client.generate(PROMPTS[0], policy=policy, max_new_tokens=8)
            assert raised.value.code() == Code.UNAVAILABLE and dead in raised.value.details()
        else:  # the draft only speeds things up: without it the request is served target-only
            result = client.generate(PROMPTS[0], policy=policy, max_new_tokens=8, ignore_eos=True)
            assert len(result.token_ids) == 8 and result.stats["draft_fallbacks"] == 1
            assert result.token_ids == client.generate(PROMPTS[0], policy="none", max_new_tokens=8,
                                                       ignore_eos=True).token_ids
        # Fast: at most one reconnect period of the target's channel (a target that is just
        # coming up is waited for that long: test_a_target_that_comes_up_after_...).
        assert time.monotonic() - started < 2.0 + CONNECT_WAIT_S
        with pytest.raises(DiscoRpcError) as raised:  # a bad request is still refused as such
            client.generate(PROMPTS[0], policy=policy, max_new_tokens=0)
        assert raised.value.code() == Code.INVALID_ARGUMENT
        info = client.info()
        assert dead in " ".join(info["errors"]) and -1 in info["active_sessions"].values()
        client.close()
        orch.stop(0)
    assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}


def test_too_many_requests_is_resource_exhausted(grpc_stacks, tokenizer):
    stack = grpc_stacks["noisy"]
    orch = start_orchestrator(tokenizer, stack.draft.address, stack.target.address, OrchestratorLimits(max_sessions=1))
    client = DiscoClient(orch.address, timeout=30)
    try:
        first = iter(client.stream(PROMPTS[0], **LONG))
        next(first)  # one request in flight
        with pytest.raises(DiscoRpcError) as raised:
            client.generate(PROMPTS[1], max_new_tokens=4)
        assert raised.value.code() == Code.RESOURCE_EXHAUSTED and "too many" in raised.value.details()
        first.close()
    finally:
        client.close()
        orch.stop(0)
    assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}


def test_tokenizer_mismatch_is_failed_precondition(grpc_stacks, tokenizer):
    stack = grpc_stacks["noisy"]
    servicer = OrchestratorServicer(tokenizer, Backends(stack.draft.address, stack.target.address, "another-hash"))
    orch = start_server([(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer, SERVICE_NAME)])
    client = DiscoClient(orch.address, timeout=10)
    with pytest.raises(DiscoRpcError) as raised:
        client.generate(PROMPTS[0], max_new_tokens=4)
    assert raised.value.code() == Code.FAILED_PRECONDITION and "tokenizer" in raised.value.details()
    client.close()
    orch.stop(0)


def test_distribution_codec_is_exact_both_ways():
    import torch

    for probs in (torch.softmax(torch.randn(512), -1), torch.zeros(512).index_fill_(0, torch.tensor([3, 77]), 0.5)):
        message = convert.distribution_to_pb(probs)
        assert message.WhichOneof("encoding") == ("sparse" if probs.count_nonzero() < 256 else "dense_f32")
        assert torch.equal(convert.distribution_from_pb(message), probs)


def test_stopping_a_draft_server_ends_its_drafting_threads(grpc_stacks, drafts, tokenizer):
    target = grpc_stacks["noisy"].target
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    orch = start_orchestrator(tokenizer, draft.address, target.address)
    client = DiscoClient(orch.address, timeout=60)
    assert client.generate(PROMPTS[0], policy="static:3", max_new_tokens=8).token_ids
    threads = set(draft.servicers[0].drafting_threads._threads)  # the pool's own threads
    assert threads and all(thread.is_alive() for thread in threads)
    client.close(), orch.stop(0), draft.stop(0)
    for thread in threads:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in threads)


def test_a_target_that_comes_up_after_the_orchestrator_serves_its_first_request(target_model, drafts, tokenizer):
    """The orchestrator starts first and its first request arrives while the target is still
    loading: the request waits for the target's channel to connect (its reconnect backoff)
    instead of failing UNAVAILABLE at once (as ../shared/repro/batch_exact showed on a busy
    machine). A target that never comes is UNAVAILABLE after the wait."""
    import threading  # noqa: PLC0415

    import target_service.server  # noqa: PLC0415

    port = free_port()
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    orch = start_orchestrator(tokenizer, draft.address, f"127.0.0.1:{port}")
    client = DiscoClient(orch.address, timeout=60)
    started: list = []
    try:
        with pytest.raises(DiscoRpcError) as raised:  # no target yet: UNAVAILABLE after the wait, not a hang
            client.generate(PROMPTS[0], max_new_tokens=4)
        assert raised.value.code() == Code.UNAVAILABLE and "target service" in raised.value.details()
        later = threading.Timer(0.5, lambda: started.append(target_service.server.serve(
            loaded(target_model, tokenizer, "tiny-target"), port=port)))
        later.start()  # the channel is backing off from the failed attempts when the target comes up
        result = client.generate(PROMPTS[0], max_new_tokens=4)
        later.join()
        assert len(result.token_ids) == 4
    finally:
        client.close()
        orch.stop(0)
        draft.stop(0)
        for target in started:
            target.stop(0)
