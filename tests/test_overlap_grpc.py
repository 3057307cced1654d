"""Overlapped drafting over gRPC (``disco draft-server --overlap on``): the draft service
pre-drafts each session's next block while the target service verifies the last one.

Output must stay what the target alone produces, the overlap outcome must reach the
client's stats and both services' ``/metrics``, clients and services that predate the
new fields must keep working, and a draft service that stops while a pre-drafted block
is waiting must leave the request to finish target-only, token for token.
"""

from __future__ import annotations

import threading
from typing import Callable

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import draft_service.server
import target_service.server
from disco.config import SamplingParams, SpeculationConfig
from disco.engines.draft import DraftEngine
from disco.engines.predraft import Predraft
from disco.errors import SessionNotFound
from disco.interfaces import DraftSummary
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.learned import make_learned_loader
from disco.stats import RequestStats
from orchestrator.client import DiscoClient, build_request
from protos import convert
from protos.disco.v1 import draft_pb2, orchestrator_pb2
from protos.runtime.metrics import sample_value
from protos.stats import stats_from_pb, stats_to_pb
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator
from tests.helpers import PROMPTS, local_generator

POLICIES = ("none", "static:4", "disco:default")
NEW_TOKENS = 32
OVERLAP_STATS = ("overlap_hits", "overlap_misses", "predrafted_used", "predrafted_wasted")
#: The last field numbers before overlapped drafting (what older peers know).
OLD_LAST_FIELD = {"RequestStats": 22, "DraftSummary": 3}


class _PatientTarget:
    """Stands in for a target service's engine. Before each verify it runs ``before_verify``
    (the fault test stops the draft service there), then, when ``patient``, waits for the
    draft session's pre-draft to finish: a target slow enough for every pre-draft, so hits
    do not depend on thread timing."""

    def __init__(self, engine, drafts: list[DraftEngine]) -> None:
        self.engine, self.drafts = engine, drafts
        self.patient = True
        self.before_verify: Callable[[str, Predraft | None], None] | None = None

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def verify(self, session_id, draft_token_ids, draft_probs, **checks):
        predraft = self.predraft(session_id)
        if self.before_verify is not None:
            self.before_verify(session_id, predraft)
        if self.patient and predraft is not None:
            predraft.thread.join(timeout=10)
        return self.engine.verify(session_id, draft_token_ids, draft_probs, **checks)

    def predraft(self, session_id: str) -> Predraft | None:
        for engine in self.drafts:
            try:
                return engine.sessions.get(session_id).predraft
            except SessionNotFound:
                continue
        return None


class _Stack:
    """Target, draft (overlap on, the learned policies resolvable) and orchestrator."""

    def __init__(self, target_model, draft_model, tokenizer, name: str) -> None:
        self.target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
        self.draft = draft_service.server.serve(loaded(draft_model, tokenizer, f"tiny-{name}"),
                                                policy_factory=PolicyFactory(make_learned_loader()), overlap=True)
        servicer = self.target.servicers[0]
        self.patient = servicer.engine = _PatientTarget(servicer.engine, [self.draft.servicers[0].engine])
        self.orchestrator = start_orchestrator(tokenizer, self.draft.address, self.target.address)
        self.client = DiscoClient(self.orchestrator.address, timeout=CLIENT_TIMEOUT_S)

    def stop(self) -> None:
        self.client.close()
        for server in (self.orchestrator, self.draft, self.target):
            server.stop(0)


@pytest.fixture(scope="module")
def stacks(target_model, drafts, tokenizer):
    """``{"noisy": _Stack, "same": _Stack}`` (``same``: the target is its own draft)."""
    built = {name: _Stack(target_model, drafts[name], tokenizer, name) for name in ("noisy", "same")}
    yield built
    for stack in built.values():
        stack.stop()


@pytest.fixture(scope="module")
def reference(target_model, tokenizer):
    """In-process target-only greedy tokens of a prompt."""
    generator = local_generator(target_model, None, tokenizer)
    cache: dict[tuple[str, int], list[int]] = {}

    def tokens(prompt: str, max_new_tokens: int = NEW_TOKENS) -> list[int]:
        if (prompt, max_new_tokens) not in cache:
            cache[prompt, max_new_tokens] = generator.generate(
                tokenizer(prompt)["input_ids"], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                SpeculationConfig(policy="none")).token_ids
        return cache[prompt, max_new_tokens]

    return tokens


def _generate(stack: _Stack, prompt: str, policy: str, max_new_tokens: int = NEW_TOKENS):
    return stack.client.generate(prompt, policy=policy, max_new_tokens=max_new_tokens, ignore_eos=True)


# -- exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("patient", [True, False], ids=["every-predraft-done", "racing"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_with_overlap_over_grpc_equals_target_only(stacks, reference, policy, patient):
    stack = stacks["noisy"]
    stack.patient.patient = patient
    try:
        for prompt in PROMPTS[:2]:
            result = _generate(stack, prompt, policy)
            assert result.token_ids == reference(prompt), (policy, prompt)
            if policy == "none":
                assert all(result.stats[name] == 0 for name in OVERLAP_STATS)
    finally:
        stack.patient.patient = True


# -- the overlap outcome reaches the client and the metrics ------------------------------

def test_own_draft_hits_and_the_counts_reach_stats_and_metrics(stacks, reference):
    stack = stacks["same"]
    draft_before = stack.draft.metrics.exposition()
    orch_before = stack.orchestrator.metrics.exposition()
    result = _generate(stack, PROMPTS[0], "static:4")
    assert result.token_ids == reference(PROMPTS[0])
    stats = result.stats
    assert stats["overlap_hits"] > 0 and stats["predrafted_used"] > 0, stats
    assert stats["draft_fallbacks"] == 0
    # Both services count exactly what the request's stats say.
    draft_after, orch_after = stack.draft.metrics.exposition(), stack.orchestrator.metrics.exposition()
    for draft_name, orch_name, key in (
            ("disco_overlap_hits_total", "disco_spec_decode_overlap_hits_total", "overlap_hits"),
            ("disco_overlap_misses_total", "disco_spec_decode_overlap_misses_total", "overlap_misses"),
            ("disco_overlap_predrafted_tokens_used_total", "disco_spec_decode_predrafted_tokens_used_total",
             "predrafted_used"),
            ("disco_overlap_predrafted_tokens_wasted_total", "disco_spec_decode_predrafted_tokens_wasted_total",
             "predrafted_wasted")):
        assert sample_value(draft_after, draft_name) - sample_value(draft_before, draft_name) == stats[key], key
        assert sample_value(orch_after, orch_name) - sample_value(orch_before, orch_name) == stats[key], key


def test_the_request_turns_overlap_off_and_on(stacks, reference, drafts, tokenizer):
    """``GenerateRequest.overlap`` overrides the draft service's setting per request."""
    stack = stacks["same"]
    result = stack.client.generate(PROMPTS[0], policy="static:4", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                   overlap=False)
    assert result.token_ids == reference(PROMPTS[0])
    assert all(result.stats[name] == 0 for name in OVERLAP_STATS), result.stats
    # A draft service started without overlap pre-drafts for a request that asks for it.
    plain = draft_service.server.serve(loaded(drafts["same"], tokenizer, "tiny-plain-same"))
    stack.patient.drafts.append(plain.servicers[0].engine)
    orchestrator = start_orchestrator(tokenizer, plain.address, stack.target.address)
    try:
        with DiscoClient(orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            default = client.generate(PROMPTS[0], policy="static:4", max_new_tokens=NEW_TOKENS, ignore_eos=True)
            asked = client.generate(PROMPTS[0], policy="static:4", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                    overlap=True)
        assert default.token_ids == asked.token_ids == reference(PROMPTS[0])
        assert all(default.stats[name] == 0 for name in OVERLAP_STATS), default.stats
        assert asked.stats["overlap_hits"] > 0 and asked.stats["predrafted_used"] > 0, asked.stats
    finally:
        stack.patient.drafts.remove(plain.servicers[0].engine)
        orchestrator.stop(0)
        plain.stop(0)


def test_info_reports_overlap(stacks, target_model, drafts, tokenizer):
    info = stacks["noisy"].client.info()
    assert info["models"]["draft"]["overlap"] is True and info["models"]["target"]["overlap"] is False
    plain = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-plain"))
    try:
        assert plain.servicers[0].engine.overlap is False
        assert plain.servicers[0].Info(None, None).overlap is False
    finally:
        plain.stop(0)


# -- peers that predate the new fields ---------------------------------------------------

def _old_message_class(module, name: str) -> type:
    """Message ``name`` of ``module``'s proto file as compiled before overlapped drafting
    (the fields past ``OLD_LAST_FIELD`` removed), in a pool of its own."""
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(file) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for message in proto.message_type:
            if message.name in OLD_LAST_FIELD:
                kept = [field for field in message.field if field.number <= OLD_LAST_FIELD[message.name]]
                # Oneofs of the removed fields go too (a proto3 optional field is a oneof of its own).
                used = sorted({field.oneof_index for field in kept if field.HasField("oneof_index")})
                oneofs = [message.oneof_decl[index] for index in used]
                for field in kept:
                    if field.HasField("oneof_index"):
                        field.oneof_index = used.index(field.oneof_index)
                del message.field[:], message.oneof_decl[:]
                message.field.extend(kept)
                message.oneof_decl.extend(oneofs)
        pool.Add(proto)
        added.add(file.name)

    add(module.DESCRIPTOR)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"disco.v1.{name}"))


def test_an_old_client_reads_the_stats_of_an_overlap_deployment(stacks):
    stack = stacks["same"]
    old_result = _old_message_class(orchestrator_pb2, "GenerateResult")
    assert "overlap_hits" not in old_result.DESCRIPTOR.fields_by_name["stats"].message_type.fields_by_name
    with grpc.insecure_channel(stack.orchestrator.address) as channel:
        call = channel.unary_unary("/disco.v1.Orchestrator/GenerateUnary",
                                   request_serializer=orchestrator_pb2.GenerateRequest.SerializeToString,
                                   response_deserializer=old_result.FromString)
        old = call(build_request(PROMPTS[0], policy="static:4", max_new_tokens=NEW_TOKENS, ignore_eos=True),
                   timeout=CLIENT_TIMEOUT_S)
    new = _generate(stack, PROMPTS[0], "static:4")
    assert list(old.token_ids) == new.token_ids
    assert old.stats.generated_tokens == NEW_TOKENS and old.stats.iterations > 0
    assert old.stats.draft_tokens > 0 and 0 < old.stats.acceptance_rate <= 1
    # The new fields travel as unknown fields: re-read with today's schema, they are there.
    again = stats_from_pb(orchestrator_pb2.RequestStats.FromString(old.stats.SerializeToString()))
    assert again.overlap_hits > 0 and again.predrafted_used > 0


def test_stats_and_summaries_round_trip_and_old_peers_read_as_no_overlap():
    stats = RequestStats(generated_tokens=9, draft_tokens=12, accepted_tokens=7, lookaheads=[4, 4, 4],
                         overlap_hits=2, overlap_misses=1, predrafted_used=5, predrafted_wasted=3)
    assert stats_from_pb(stats_to_pb(stats)) == stats
    summary = DraftSummary(forwards=6, elapsed_ns=11, stop_reason="policy", predrafted_used=3, predrafted_wasted=1,
                           overlap_hit=True)
    assert convert.draft_event_from_pb(convert.draft_event_to_pb(summary, 0)) == summary
    # A new orchestrator reading an old server's messages: no overlap, nothing else lost.
    old_stats, old_summary = (_old_message_class(orchestrator_pb2, "RequestStats"),
                              _old_message_class(draft_pb2, "DraftSummary"))
    message = old_stats(generated_tokens=9, draft_tokens=12, accepted_tokens=7, lookaheads=[4, 4, 4])
    read = stats_from_pb(orchestrator_pb2.RequestStats.FromString(message.SerializeToString()))
    assert read == RequestStats(generated_tokens=9, draft_tokens=12, accepted_tokens=7, lookaheads=[4, 4, 4])
    message = old_summary(forwards=6, elapsed_ns=11, stop_reason="policy")
    event = draft_pb2.DraftEvent(summary=draft_pb2.DraftSummary.FromString(message.SerializeToString()))
    assert convert.draft_event_from_pb(event) == DraftSummary(forwards=6, elapsed_ns=11, stop_reason="policy")
    # An old orchestrator reading a new draft service's summary: its own fields intact.
    old = old_summary.FromString(convert.draft_event_to_pb(summary, 0).summary.SerializeToString())
    assert (old.forwards, old.elapsed_ns, old.stop_reason) == (6, 11, "policy")


# -- faults ------------------------------------------------------------------------------

def test_draft_stopped_with_a_predraft_in_flight_finishes_target_only(target_model, drafts, tokenizer, reference):
    """The draft service stops while the target verifies (its pre-draft of the next block
    running or waiting): the next Draft call fails, the request goes on target-only."""
    stack = _Stack(target_model, drafts["same"], tokenizer, "same")
    stack.patient.patient = False  # the pre-draft is still running when the draft stops
    seen: list[Predraft | None] = []
    stopped = threading.Event()

    def stop_draft_at_third_verify(session_id: str, predraft: Predraft | None) -> None:
        seen.append(predraft)
        if len(seen) == 3:
            stack.draft.stop(0)
            stopped.set()

    stack.patient.before_verify = stop_draft_at_third_verify
    try:
        result = _generate(stack, PROMPTS[1], "static:4")
        assert stopped.is_set() and seen[2] is not None  # a pre-drafted block was pending
        assert result.token_ids == reference(PROMPTS[1])
        stats = result.stats
        assert stats["draft_fallbacks"] == 1 and stats["generated_tokens"] == NEW_TOKENS
        assert stats["lookaheads"][:3] == [4, 4, 4] and set(stats["lookaheads"][3:]) == {0}
        assert stats["overlap_hits"] <= 2  # only the blocks drafted before the stop
        seen[2].thread.join(timeout=10)  # the orphaned worker ends on its own
        assert not seen[2].thread.is_alive()
    finally:
        stack.stop()


# -- the flag reaches the draft engine: CLI, local launcher, Ray actor -------------------

class _Started(Exception):
    """Raised by a stand-in for the function that would start something."""


def test_draft_server_and_serve_pass_overlap_on(monkeypatch, tmp_path, tiny_pair_dirs):
    from disco_cli import launcher
    from disco_cli.main import main

    monkeypatch.setenv("DISCO_HOME", str(tmp_path))
    calls: list[dict] = []

    def record(*args, **kwargs):
        calls.append(kwargs)
        raise _Started

    monkeypatch.setattr(draft_service.server, "serve", record)
    monkeypatch.setattr(launcher, "launch", record)
    draft = ["draft-server", "--model", str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--no-engine-costs",
             "--port", "0"]
    serve = ["serve", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
             "--dtype", "float32", "--port", "0"]
    for argv, expected in ((draft, False), ([*draft, "--overlap", "on"], True), ([*draft, "--overlap", "off"], False),
                           (serve, False), ([*serve, "--overlap", "on"], True)):
        with pytest.raises(_Started):
            main(argv)
        assert calls.pop()["overlap"] is expected, argv


def test_launch_passes_overlap_to_the_draft_child_only(monkeypatch):
    from disco.config import ModelConfig, PairConfig
    from disco_cli import launcher

    spawned: list[list[str]] = []

    def spawn(argv, env=None, cores=None, program=None):
        spawned.append(argv)
        return argv[0]

    monkeypatch.setattr(launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher, "_await_announcement",
                        lambda name, process, timeout_s: {"address": f"127.0.0.1:{len(spawned)}"})
    pair = PairConfig(target=ModelConfig(spec="t"), draft=ModelConfig(spec="d"))
    for kwargs, expected in (({}, False), ({"overlap": True}, True), ({"overlap": False}, False)):
        spawned.clear()
        launcher.launch(pair, **kwargs)
        argv = {args[0]: args for args in spawned}
        assert set(argv) == {"target-server", "draft-server", "orchestrator"}
        assert ("--overlap" in argv["draft-server"]) is expected
        if expected:
            index = argv["draft-server"].index("--overlap")
            assert argv["draft-server"][index + 1] == "on"
        assert "--overlap" not in argv["target-server"] and "--overlap" not in argv["orchestrator"]


def test_disco_up_and_the_ray_actor_pass_overlap(monkeypatch, tmp_path, tiny_pair_dirs):
    pytest.importorskip("ray")
    from deploy import ray_actors, ray_head, ray_launcher
    from disco_cli.main import main

    monkeypatch.setenv("DISCO_HOME", str(tmp_path))
    monkeypatch.setattr(ray_head, "use_token_auth", lambda generate: False)
    configs: list = []

    def up(config, home, *credentials, **named):
        configs.append(config)
        raise _Started

    monkeypatch.setattr(ray_launcher, "up", up)
    for extra, expected in (([], False), (["--overlap", "on"], True)):
        with pytest.raises(_Started):
            main(["up", "--address", "auto", *extra])
        assert configs.pop().overlap is expected
    # The actor class itself (run here as a plain object, no Ray runtime needed).
    for overlap in (False, True):
        service = ray_actors.ModelService("draft", {"spec": str(tiny_pair_dirs["draft"]), "dtype": "float32"},
                                          host="127.0.0.1", overlap=overlap)
        try:
            assert service._running.servicers[0].engine.overlap is overlap
        finally:
            service.stop(0)
