"""Replicas behind one orchestrator (real gRPC servers on loopback, tiny models): sessions
spread over the replicas (sticky, least-loaded), and a session whose replica is lost
mid-request is re-prefilled on another replica, or on a replacement at the same
address, with output identical to an undisturbed run.

The Ray path (replicas as actors that Ray restarts) is in test_ray_deploy.py.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import draft_service.server
import target_service.server
from disco.config import SamplingParams, SpeculationConfig
from orchestrator.client import DiscoClient, DiscoRpcError
from orchestrator.routing import ReplicaSet
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator
from tests.helpers import PROMPTS, local_generator

NEW_TOKENS = 40
POLICY = "static:3"


@pytest.fixture(scope="module")
def reference(target_model, tokenizer):
    """Target-only greedy output per prompt (speculation must reproduce it exactly)."""
    generator = local_generator(target_model, None, tokenizer)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return {prompt: generator.generate(tokenizer(prompt)["input_ids"], params, SpeculationConfig(policy="none"))
            .token_ids for prompt in PROMPTS}


@pytest.fixture
def servers(target_model, drafts, tokenizer):
    """Start servers on demand; all are stopped at the end."""
    started = []

    def start(role: str, port: int = 0):
        if role == "target":
            running = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), port=port)
        else:
            running = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"), port=port)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop(0)


def fail_on_call(running, method: str, call_number: int, then=None):
    """Make ``running``'s engine lose the connection on its ``call_number``-th ``method``
    call: the server stops (in-flight calls end UNAVAILABLE), after ``then()`` if given."""
    engine = running.servicers[0].engine
    real = getattr(engine, method)
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == call_number:
            if then is not None:
                then()
            threading.Thread(target=running.stop, args=(0,), daemon=True).start()
            threading.Event().wait(1.0)  # the client sees the server go away first
        return real(*args, **kwargs)

    setattr(engine, method, patched)
    return calls


def generate(address: str, prompt: str):
    with DiscoClient(address, timeout=CLIENT_TIMEOUT_S) as client:
        return client.generate(prompt, policy=POLICY, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def test_concurrent_sessions_spread_over_two_target_replicas(servers, tokenizer, reference):
    targets = [servers("target"), servers("target")]
    draft = servers("draft")
    orch = start_orchestrator(tokenizer, draft.address, ",".join(t.address for t in targets))
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda prompt: generate(orch.address, prompt), prompts))
        for prompt, result in zip(prompts, results):
            assert result.token_ids == reference[prompt]
        routing = orch.servicers[0].backends.routing()
        assert [r["sessions"] for r in routing["target"]] == [2, 2]  # least-loaded, ties alternate
        with pytest.raises(DiscoRpcError):  # refused by the target's StartSession: the placement is released
            generate(orch.address, "x" * 600)
        routing = orch.servicers[0].backends.routing()
        assert [r["active"] for r in routing["target"] + routing["draft"]] == [0, 0, 0]
    finally:
        orch.stop(0)


def test_target_replica_lost_mid_request_moves_the_session(servers, tokenizer, reference):
    first, second = servers("target"), servers("target")
    draft = servers("draft")
    orch = start_orchestrator(tokenizer, draft.address, f"{first.address},{second.address}")
    try:
        calls = fail_on_call(first, "verify", call_number=4)  # the request starts on target-0
        result = generate(orch.address, PROMPTS[0])
        assert len(calls) >= 4
        assert result.token_ids == reference[PROMPTS[0]]
        assert result.stats["draft_tokens"] > 0 and result.stats["draft_fallbacks"] == 0
        assert (result.stats["target_reprefills"], result.stats["draft_reprefills"]) == (1, 0)  # the move is counted
        target_0, target_1 = orch.servicers[0].backends.routing()["target"]
        assert (target_0["failures"], target_0["healthy"]) == (1, False)
        assert target_1["sessions"] == 1 and target_1["failures"] == 0
    finally:
        orch.stop(0)


def test_target_replaced_at_the_same_address_is_reprefilled(servers, tokenizer, reference):
    target = servers("target")
    draft = servers("draft")
    orch = start_orchestrator(tokenizer, draft.address, target.address)
    try:
        # NOTE: gRPC servers bind with SO_REUSEPORT, so the replacement listens on the same
        # port before the old one goes away: the orchestrator finds it on recovery.
        replacement = []
        fail_on_call(target, "verify", call_number=3, then=lambda: replacement.append(servers("target", target.port)))
        result = generate(orch.address, PROMPTS[1])
        assert result.token_ids == reference[PROMPTS[1]]
        assert result.stats["target_reprefills"] == 1
        assert replacement and replacement[0].servicers[0].engine.active_sessions() == 0  # used, then freed
        (state,) = orch.servicers[0].backends.routing()["target"]
        assert state["failures"] == 1 and state["healthy"] and state["generation"] == 1
        assert generate(orch.address, PROMPTS[2]).token_ids == reference[PROMPTS[2]]  # and it keeps serving
    finally:
        orch.stop(0)


def test_draft_replica_lost_mid_request_moves_to_the_other_draft(servers, tokenizer, reference):
    target = servers("target")
    first, second = servers("draft"), servers("draft")
    orch = start_orchestrator(tokenizer, f"{first.address},{second.address}", target.address)
    try:
        fail_on_call(first, "draft", call_number=3)
        result = generate(orch.address, PROMPTS[0])
        assert result.token_ids == reference[PROMPTS[0]]
        assert result.stats["draft_fallbacks"] == 0  # another draft replica took over: no target-only stretch
        assert (result.stats["draft_reprefills"], result.stats["target_reprefills"]) == (1, 0)
        draft_0, draft_1 = orch.servicers[0].backends.routing()["draft"]
        assert draft_0["failures"] == 1 and draft_1["sessions"] == 1
    finally:
        orch.stop(0)


def test_recovery_leaves_the_old_channel_to_calls_in_flight(servers):
    """A replica reported down by one session may still be serving others: recovering it
    must not close the channel their calls are using."""
    target = servers("target")
    replicas = ReplicaSet.static("target", target.address)
    try:
        replica, generation = replicas.acquire()
        old_channel = replica.channel
        replicas.report_failure(replica, generation)
        deadline = time.monotonic() + 10
        while replicas.snapshot()[0]["generation"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replicas.snapshot()[0]["healthy"] and replica.channel is not old_channel
        response = health_pb2_grpc.HealthStub(old_channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        replicas.close()
