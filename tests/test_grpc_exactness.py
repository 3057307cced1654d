"""Over real gRPC servers on loopback: remote tokens == in-process tokens == target-only
tokens, for every policy (greedy, float32) and every kind of draft; seeded sampling
gives the same tokens remotely as in process; a stream adds up to the unary result."""

import asyncio

import pytest

from disco.config import SamplingParams, SpeculationConfig
from disco.speculation.policies import POLICY_INFOS
from orchestrator.client import AsyncDiscoClient
from tests.grpc_fixtures import DRAFT_KINDS, grpc_stacks  # noqa: F401 - fixture
from tests.helpers import PROMPTS, local_generator

NEW_TOKENS = 32
#: One spec per policy kind (test_exactness covers more arguments in process); the
#: analysis-only oracle is refused over gRPC (see test_grpc_errors).
REMOTE_POLICIES = ("none", "static:3", "heuristic:2", "confidence:0.4", "adaptive-confidence", "entropy",
                   "entropy:lambda=0.2,adapt=0.05", "auto")
PROMPT_OF = dict(zip(DRAFT_KINDS, PROMPTS))  # one prompt per draft kind keeps the suite fast


def in_process(target_model, draft, tokenizer, prompt, policy, **sampling):
    generator = local_generator(target_model, draft, tokenizer)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
    return generator.generate(tokenizer(prompt)["input_ids"], params, SpeculationConfig(policy=policy))


def test_every_policy_kind_is_covered():
    served = {info.name for info in POLICY_INFOS} - {"oracle", "disco"}  # disco: no trained artifact here
    assert {spec.partition(":")[0] for spec in REMOTE_POLICIES} == served


@pytest.fixture(scope="module")
def target_only(target_model, tokenizer):
    return {kind: in_process(target_model, None, tokenizer, prompt, "none").token_ids
            for kind, prompt in PROMPT_OF.items()}


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_greedy_remote_equals_in_process_and_target_only(kind, grpc_stacks, target_only, target_model, drafts,
                                                         tokenizer):
    reference = target_only[kind]
    assert len(set(reference)) >= 10, "degenerate reference output: the comparison would be vacuous"
    for policy in REMOTE_POLICIES:
        remote = grpc_stacks[kind].client.generate(PROMPT_OF[kind], policy=policy, max_new_tokens=NEW_TOKENS,
                                                   ignore_eos=True)
        local = in_process(target_model, drafts[kind], tokenizer, PROMPT_OF[kind], policy)
        assert remote.token_ids == local.token_ids == reference, (kind, policy)
        assert remote.text == local.text
        # The same speculation decisions were taken on both transports.
        for key in ("iterations", "lookaheads", "accepted_tokens", "draft_forwards", "accepted_per_position"):
            assert remote.stats[key] == getattr(local.stats, key), (kind, policy, key)
        if kind == "same" and policy != "none":
            assert remote.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=40, seed=7),  # sparse distributions
                                      dict(temperature=1.0, seed=11),  # dense distributions
                                      dict(temperature=0.7, top_p=0.9, seed=3)])
@pytest.mark.parametrize("policy", ["static:3", "confidence:0.3"])
def test_seeded_sampling_remote_equals_in_process(sampling, policy, grpc_stacks, target_model, drafts, tokenizer):
    prompt = PROMPTS[0]
    local = in_process(target_model, drafts["noisy"], tokenizer, prompt, policy, **sampling)
    client = grpc_stacks["noisy"].client
    first = client.generate(prompt, policy=policy, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
    again = client.stream(prompt, policy=policy, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
    list(again)
    assert first.token_ids == local.token_ids == again.result.token_ids
    assert 0 < first.stats["accepted_tokens"] < first.stats["draft_tokens"], "expected mixed acceptance"


@pytest.mark.parametrize("request_args", [dict(policy="static:4", max_new_tokens=NEW_TOKENS),
                                          dict(policy="heuristic:2", max_new_tokens=30, stop=["ret"]),
                                          dict(policy="none", max_new_tokens=12)])
def test_stream_concatenation_equals_unary(request_args, grpc_stacks):
    client = grpc_stacks["noisy"].client
    unary = client.generate(PROMPTS[1], **request_args)
    stream = client.stream(PROMPTS[1], **request_args)
    chunks = list(stream)
    assert chunks and all(chunk.token_ids for chunk in chunks)
    assert [t for chunk in chunks for t in chunk.token_ids] == unary.token_ids == stream.result.token_ids
    assert "".join(chunk.text for chunk in chunks) == unary.text == stream.result.text
    assert [chunk.elapsed_ns for chunk in chunks] == sorted(chunk.elapsed_ns for chunk in chunks)
    assert stream.result.finish_reason == unary.finish_reason
    assert len(chunks) == unary.stats["iterations"]


def test_async_client_matches_sync_client(grpc_stacks):
    stack = grpc_stacks["noisy"]
    expected = stack.client.generate(PROMPTS[2], policy="static:3", max_new_tokens=24)

    async def run():
        async with AsyncDiscoClient(stack.orchestrator.address, timeout=60) as client:
            unary = await client.generate(PROMPTS[2], policy="static:3", max_new_tokens=24)
            stream = client.stream(PROMPTS[2], policy="static:3", max_new_tokens=24)
            chunks = [chunk async for chunk in stream]
            return unary, chunks, stream.result, await client.info()

    unary, chunks, streamed, info = asyncio.run(run())
    assert unary.token_ids == expected.token_ids == streamed.token_ids
    assert "".join(chunk.text for chunk in chunks) == expected.text
    assert info["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}
