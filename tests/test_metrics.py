"""Prometheus ``/metrics`` of the three services move as a generation says they should,
each server has its own registry, and log lines carry the call's context."""

import io
import json
import logging
import urllib.request

import grpc
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from orchestrator.client import DiscoClient, DiscoRpcError
from protos.runtime.logs import ContextFilter, JsonFormatter, TextFormatter
from protos.runtime.metrics import sample_value
from tests.grpc_fixtures import free_port, loaded
from tests.helpers import PROMPTS

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), metrics_port=0)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"), metrics_port=0)
    orch = orchestrator.server.serve(tokenizer, draft.address, target.address, metrics_port=0)
    yield {"orchestrator": orch, "draft": draft, "target": target}
    for running in (orch, draft, target):
        running.stop(0)


def scrape(running) -> str:
    with urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def values(stack) -> dict[str, str]:
    return {name: scrape(running) for name, running in stack.items()}


def delta(before: str, after: str, name: str, **labels) -> float:
    return (sample_value(after, name, labels) or 0.0) - (sample_value(before, name, labels) or 0.0)


def rpc_count(text: str, method: str, code: str = "OK") -> float:
    return sample_value(text, "disco_grpc_server_handling_seconds_count", {"grpc_method": method,
                                                                           "grpc_code": code}) or 0.0


def test_counters_move_with_a_generation(stack):
    before = values(stack)
    with DiscoClient(stack["orchestrator"].address, timeout=60) as client:
        result = client.generate(PROMPTS[0], policy="static:3", max_new_tokens=NEW_TOKENS, ignore_eos=True)
    stats = result.stats
    after = values(stack)
    o0, o1 = before["orchestrator"], after["orchestrator"]
    assert delta(o0, o1, "disco_generation_tokens_total") == NEW_TOKENS
    assert delta(o0, o1, "disco_prompt_tokens_total") == stats["prompt_tokens"] > 0
    assert delta(o0, o1, "disco_spec_decode_num_draft_tokens_total") == stats["draft_tokens"] > 0
    assert delta(o0, o1, "disco_spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    assert delta(o0, o1, "disco_spec_decode_num_drafts_total") == sum(1 for k in stats["lookaheads"] if k)
    per_position = [delta(o0, o1, "disco_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(3)]
    assert per_position == stats["accepted_per_position"][:3]
    assert delta(o0, o1, "disco_spec_decode_lookahead_count") == stats["iterations"]
    assert delta(o0, o1, "disco_spec_decode_lookahead_sum") == stats["draft_tokens"]
    assert delta(o0, o1, "disco_spec_decode_num_target_forwards_total") == stats["target_forwards"]
    assert delta(o0, o1, "disco_request_success_total", finished_reason="length") == 1
    assert delta(o0, o1, "disco_e2e_request_latency_seconds_count") == 1
    assert delta(o0, o1, "disco_request_generation_tokens_per_second_count") == 1
    assert 0 < sample_value(o1, "disco_spec_decode_draft_acceptance_rate") <= 1
    assert rpc_count(o1, "GenerateUnary") - rpc_count(o0, "GenerateUnary") == 1
    assert sample_value(o1, "disco_active_sessions") == 0 and sample_value(o1, "disco_max_sessions") == 64
    assert sample_value(o1, "disco_service_info", {"role": "orchestrator"}) == 1
    # The backends count their own calls: one session each, a Verify per iteration.
    t0, t1, d0, d1 = before["target"], after["target"], before["draft"], after["draft"]
    assert rpc_count(t1, "Verify") - rpc_count(t0, "Verify") == stats["iterations"]
    assert rpc_count(t1, "StartSession") - rpc_count(t0, "StartSession") == 1
    assert rpc_count(d1, "Draft") - rpc_count(d0, "Draft") == sum(1 for k in stats["lookaheads"] if k)
    assert delta(t0, t1, "disco_prompt_tokens_total") == stats["prompt_tokens"]
    assert sample_value(t1, "disco_active_sessions") == sample_value(d1, "disco_active_sessions") == 0
    assert sample_value(d1, "disco_service_info", {"role": "draft", "model": "tiny-noisy"}) == 1
    assert sample_value(t1, "disco_forward_batch_size_recent_mean") >= 1


def test_errors_and_fallbacks_are_counted(stack, tokenizer):
    with DiscoClient(stack["orchestrator"].address, timeout=60) as client:
        before = scrape(stack["orchestrator"])
        with pytest.raises(DiscoRpcError):
            client.generate("", max_new_tokens=4)
        assert rpc_count(scrape(stack["orchestrator"]), "GenerateUnary", "INVALID_ARGUMENT") - rpc_count(
            before, "GenerateUnary", "INVALID_ARGUMENT") == 1
    # A second orchestrator whose draft is down: served target-only, one fallback; its
    # registry is its own (the first orchestrator's counters do not move).
    orch = orchestrator.server.serve(tokenizer, f"127.0.0.1:{free_port()}", stack["target"].address,
                                     metrics_port=0, auth_tokens="t")
    try:
        first = scrape(stack["orchestrator"])
        with DiscoClient(orch.address, timeout=60, auth_token="t") as client:
            result = client.generate(PROMPTS[1], policy="static:3", max_new_tokens=6, ignore_eos=True)
        with DiscoClient(orch.address, timeout=60, auth_token="wrong") as client, pytest.raises(DiscoRpcError):
            client.info()
        text = scrape(orch)
        assert result.stats["draft_fallbacks"] == 1
        assert sample_value(text, "disco_spec_decode_draft_fallbacks_total") == 1
        assert sample_value(text, "disco_spec_decode_num_draft_tokens_total") == 0
        assert sample_value(text, "disco_spec_decode_lookahead_bucket", {"le": "0.0"}) == result.stats["iterations"]
        assert rpc_count(text, "Info", "UNAUTHENTICATED") == 1
        assert sample_value(scrape(stack["orchestrator"]), "disco_generation_tokens_total") == sample_value(
            first, "disco_generation_tokens_total")
    finally:
        orch.stop(0)
    assert orch.metrics_address is not None
    with pytest.raises(OSError):  # stopping the server stops its /metrics endpoint
        urllib.request.urlopen(f"http://{orch.metrics_address}/metrics", timeout=2)


def test_metrics_are_off_unless_a_port_is_given(target_model, tokenizer):
    running = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    try:
        assert running.metrics_address is None
        assert "disco_active_sessions 0.0" in running.metrics.exposition()  # collected, not served
    finally:
        running.stop(0)


@pytest.mark.parametrize("formatter", [JsonFormatter, TextFormatter])
def test_log_lines_carry_the_call_and_session(stack, tokenizer, formatter):
    """A draft fallback is logged with the request's rpc and session id, in both formats."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter())
    logging.getLogger().addHandler(handler)
    orch = orchestrator.server.serve(tokenizer, f"127.0.0.1:{free_port()}", stack["target"].address)
    try:
        with DiscoClient(orch.address, timeout=60) as client:
            client.generate(PROMPTS[0], policy="static:2", max_new_tokens=4)
    finally:
        logging.getLogger().removeHandler(handler)
        orch.stop(0)
    lines = [line for line in out.getvalue().splitlines() if "continuing target-only" in line]
    assert lines, out.getvalue()
    if formatter is JsonFormatter:
        entry = json.loads(lines[0])
        assert entry["level"] == "WARNING" and entry["logger"] == "disco.speculation.loop"
        assert entry["rpc"] == "/disco.v1.Orchestrator/GenerateUnary" and len(entry["session_id"]) >= 32
        assert entry["session_id"] in entry["message"]
    else:
        assert "rpc=/disco.v1.Orchestrator/GenerateUnary" in lines[0] and "session_id=" in lines[0]


def test_backend_log_lines_carry_the_session_id_of_the_request(stack):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter())
    logging.getLogger().addHandler(handler)
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    try:
        from protos.disco.v1 import target_pb2, target_pb2_grpc  # noqa: PLC0415

        channel = grpc.insecure_channel(stack["target"].address)
        with pytest.raises(grpc.RpcError):
            target_pb2_grpc.TargetServiceStub(channel).Verify(
                target_pb2.VerifyRequest(session_id="no-such-session"), timeout=10)
        channel.close()
    finally:
        logging.getLogger().setLevel(level)
        logging.getLogger().removeHandler(handler)
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    refused = [e for e in entries if "NOT_FOUND" in e["message"]]
    assert refused and refused[0]["session_id"] == "no-such-session"
    assert refused[0]["rpc"] == "/disco.v1.TargetService/Verify" and refused[0]["peer"]
