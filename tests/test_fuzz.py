"""Fuzzing every public method of the three services (hypothesis): random bytes, and
random — mostly absurd — messages of the right type. Every call must end with a clean
status code within its deadline (never INTERNAL, UNKNOWN or a hang), and afterwards
the servers are alive and still exact.

Examples are derandomized (the same ones on every run: no flaky CI) and few per method.
"""

import struct

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import draft_service.server
import orchestrator.server
import target_service.server
from disco.config import SamplingParams, SpeculationConfig
from orchestrator.client import DiscoClient
from protos.disco.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2
from tests.grpc_fixtures import loaded
from tests.helpers import PROMPTS, local_generator

Code = grpc.StatusCode
CALL_TIMEOUT_S = 20.0  # a call still running after this is a hang
#: What a sane server may answer to nonsense.
CLEAN = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION,
         Code.OUT_OF_RANGE}
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BYTES_FUZZ = settings(FUZZ, max_examples=25)
SESSIONS = ("s-greedy", "s-sampled")

INT32 = st.one_of(st.integers(-3, 600), st.sampled_from([-2**31, 2**31 - 1, 511, 512, 4096, 65]),
                  st.integers(-2**31, 2**31 - 1))
TOKENS = st.one_of(st.integers(0, 511), st.sampled_from([-1, 512, 2**31 - 1, -2**31]))
TOKEN_LISTS = st.one_of(st.lists(TOKENS, max_size=12), st.lists(st.integers(0, 511), max_size=40),
                        st.just([7] * 700))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 0.5, -0.0]))
SAMPLING = st.builds(
    common_pb2.SamplingParams,
    max_new_tokens=st.one_of(st.none(), st.integers(-3, 24), st.sampled_from([4096, 2**31 - 1])),
    temperature=FLOATS, top_p=st.one_of(st.none(), FLOATS), top_k=INT32,
    seed=st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), stop=st.lists(st.text(max_size=4), max_size=3),
    ignore_eos=st.booleans())
POLICIES = st.one_of(st.sampled_from(["", "none", "static:3", "static:0", "static:-1", "static:99999999999",
                                      "heuristic:2", "confidence:0.4", "confidence:nan", "entropy", "entropy:lambda=x",
                                      "adaptive-confidence", "oracle", "disco:", "disco:default", "disco:/dev/zero",
                                      "disco:/etc/passwd", "disco:../../etc/passwd", "disco:/nonexistent"]),
                     st.text(max_size=24))
SESSION_IDS = st.one_of(st.sampled_from([*SESSIONS, "", "nope"]), st.text(max_size=40))


def distributions():
    dense = st.builds(lambda vocab, data: common_pb2.Distribution(vocab_size=vocab, dense_f32=data),
                      st.one_of(st.just(512), st.integers(0, 2**32 - 1)), st.binary(max_size=64))
    exact = st.builds(lambda values: common_pb2.Distribution(
        vocab_size=512, dense_f32=b"".join(v.to_bytes(4, "little") for v in values)),
        st.lists(st.integers(0, 2**32 - 1), min_size=512, max_size=512))
    sparse = st.builds(lambda vocab, ids, probs: common_pb2.Distribution(
        vocab_size=vocab, sparse=common_pb2.SparseDistribution(ids_u32=ids, probs_f32=probs)),
        st.one_of(st.just(512), st.integers(0, 2**32 - 1)), st.binary(max_size=32), st.binary(max_size=32))
    return st.one_of(dense, exact, sparse, st.just(common_pb2.Distribution()))


def well_formed_distributions():
    """Valid encodings of any vocabulary size, values anything finite and >= 0."""
    return st.builds(lambda values: common_pb2.Distribution(
        vocab_size=len(values), dense_f32=b"".join(struct.pack("<f", v) for v in values)),
        st.lists(st.floats(0, 1e3, width=32), min_size=1, max_size=600))


FEEDBACK = st.one_of(st.none(), st.builds(common_pb2.Feedback, num_accepted=INT32, bonus_token_id=INT32))

MESSAGES = {
    "/disco.v1.Orchestrator/Generate": st.builds(
        orchestrator_pb2.GenerateRequest, prompt=st.one_of(st.sampled_from(PROMPTS), st.text(max_size=60)),
        prompt_ids=st.one_of(st.just([]), TOKEN_LISTS), chat=st.booleans(), policy=POLICIES,
        max_lookahead=st.one_of(st.none(), INT32), sampling=st.one_of(st.none(), SAMPLING)),
    "/disco.v1.Orchestrator/Info": st.just(orchestrator_pb2.InfoRequest()),
    "/disco.v1.DraftService/StartSession": st.builds(
        draft_pb2.StartDraftSessionRequest, session_id=SESSION_IDS, prompt_ids=TOKEN_LISTS,
        sampling=st.one_of(st.none(), SAMPLING), policy=POLICIES, reference_ids=st.lists(TOKENS, max_size=8)),
    "/disco.v1.DraftService/Draft": st.builds(draft_pb2.DraftRequest, session_id=SESSION_IDS, feedback=FEEDBACK,
                                              max_lookahead=INT32),
    "/disco.v1.DraftService/EndSession": st.builds(common_pb2.EndSessionRequest, session_id=SESSION_IDS),
    "/disco.v1.DraftService/Info": st.just(common_pb2.ServiceInfoRequest()),
    "/disco.v1.TargetService/StartSession": st.builds(
        target_pb2.StartTargetSessionRequest, session_id=SESSION_IDS, prompt_ids=TOKEN_LISTS,
        sampling=st.one_of(st.none(), SAMPLING)),
    "/disco.v1.TargetService/Verify": st.one_of(
        st.builds(target_pb2.VerifyRequest, session_id=SESSION_IDS, draft_token_ids=st.lists(TOKENS, max_size=6),
                  draft_probs=st.lists(distributions(), max_size=3)),
        st.integers(1, 3).flatmap(lambda k: st.builds(  # as many distributions as tokens, on a sampling session
            target_pb2.VerifyRequest, session_id=st.just(SESSIONS[1]),
            draft_token_ids=st.lists(TOKENS, min_size=k, max_size=k),
            draft_probs=st.lists(well_formed_distributions(), min_size=k, max_size=k)))),
    "/disco.v1.TargetService/EndSession": st.builds(common_pb2.EndSessionRequest, session_id=SESSION_IDS),
    "/disco.v1.TargetService/Info": st.just(common_pb2.ServiceInfoRequest()),
}
MESSAGES["/disco.v1.Orchestrator/GenerateUnary"] = MESSAGES["/disco.v1.Orchestrator/Generate"]
STREAMING = {"/disco.v1.Orchestrator/Generate", "/disco.v1.DraftService/Draft"}
START_TYPES = {"disco.v1.DraftService": draft_pb2.StartDraftSessionRequest,
               "disco.v1.TargetService": target_pb2.StartTargetSessionRequest}


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    orch = orchestrator.server.serve(tokenizer, draft.address, target.address)
    channels = {name: grpc.insecure_channel(server.address)
                for name, server in (("Orchestrator", orch), ("DraftService", draft), ("TargetService", target))}
    yield {"orchestrator": orch, "draft": draft, "target": target, "channels": channels, "opened": set()}
    for channel in channels.values():
        channel.close()
    for running in (orch, draft, target):
        running.stop(0)


def call(stack, method: str, payload: bytes) -> grpc.StatusCode:
    """Send ``payload`` as the raw request of ``method``; the status it ended with."""
    channel = stack["channels"][method.split("/")[1].split(".")[-1]]
    try:
        if method in STREAMING:
            for _ in channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code()
    return Code.OK


def remember_session(stack, method: str, payload: bytes) -> None:
    """Note session ids a StartSession may have opened, to end them afterwards."""
    if method.endswith("/StartSession"):
        service = method.split("/")[1]
        try:
            stack["opened"].add((service, START_TYPES[service].FromString(payload).session_id))
        except DecodeError:
            pass


def open_sessions(stack) -> None:
    """Give Draft/Verify real sessions to hit: one greedy, one sampling, in each backend."""
    for session_id, sampling in zip(SESSIONS, (common_pb2.SamplingParams(max_new_tokens=64),
                                               common_pb2.SamplingParams(max_new_tokens=64, temperature=0.9, seed=3))):
        for service, message in (("DraftService", draft_pb2.StartDraftSessionRequest(
                session_id=session_id, prompt_ids=[5, 6, 7], sampling=sampling, policy="static:3")),
                ("TargetService", target_pb2.StartTargetSessionRequest(
                    session_id=session_id, prompt_ids=[5, 6, 7], sampling=sampling))):
            call(stack, f"/disco.v1.{service}/StartSession", message.SerializeToString())  # exists: INVALID_ARGUMENT
            stack["opened"].add((f"disco.v1.{service}", session_id))


@pytest.mark.parametrize("method", sorted(MESSAGES))
def test_random_messages_get_clean_status_codes(stack, method):
    open_sessions(stack)

    @FUZZ
    @given(message=MESSAGES[method])
    def check(message):
        payload = message.SerializeToString()
        remember_session(stack, method, payload)
        code = call(stack, method, payload)
        assert code in CLEAN, f"{method} answered {code.name} to {message}"

    check()


@pytest.mark.parametrize("method", sorted(MESSAGES))
def test_random_bytes_get_clean_status_codes(stack, method):
    @BYTES_FUZZ
    @given(payload=st.one_of(st.binary(max_size=64), st.binary(min_size=1, max_size=4).map(lambda b: b * 40)))
    def check(payload):
        remember_session(stack, method, payload)
        code = call(stack, method, payload)
        assert code in CLEAN, f"{method} answered {code.name} to {payload!r}"

    check()


def test_servers_are_alive_and_exact_afterwards(stack, target_model, tokenizer):
    for service, session_id in stack["opened"]:
        call(stack, f"/{service}/EndSession", common_pb2.EndSessionRequest(session_id=session_id).SerializeToString())
    assert stack["draft"].servicers[0].engine.active_sessions() == 0
    assert stack["target"].servicers[0].engine.active_sessions() == 0
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected = local_generator(target_model, None, tokenizer).generate(
        tokenizer(PROMPTS[0])["input_ids"], params, SpeculationConfig("none")).token_ids
    with DiscoClient(stack["orchestrator"].address, timeout=60) as client:
        result = client.generate(PROMPTS[0], policy="static:3", max_new_tokens=24, ignore_eos=True)
        assert result.token_ids == expected and result.stats["draft_tokens"] > 0
        assert client.info()["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}
