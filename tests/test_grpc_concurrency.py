"""Eight concurrent clients over real gRPC servers: every one gets exactly the tokens it
would get alone, and every session is freed afterwards."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from disco.config import SamplingParams, SpeculationConfig
from orchestrator.client import AsyncDiscoClient, DiscoClient
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, DRAFT_KINDS, grpc_stacks  # noqa: F401 - fixture
from tests.helpers import PROMPTS, local_generator

NEW_TOKENS = 24
POLICIES = ("static:3", "heuristic:2", "confidence:0.4", "entropy")
CLIENTS = 8


def in_process(target_model, draft, tokenizer, prompt, policy, **sampling):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
    return local_generator(target_model, draft, tokenizer).generate(
        tokenizer(prompt)["input_ids"], params, SpeculationConfig(policy=policy)).token_ids


@pytest.fixture(scope="module")
def target_only(target_model, tokenizer):
    return {prompt: in_process(target_model, None, tokenizer, prompt, "none") for prompt in PROMPTS}


def test_eight_concurrent_clients_are_all_exact(grpc_stacks, target_only):
    jobs = [(DRAFT_KINDS[i % 3], PROMPTS[i % 3], POLICIES[i % 4]) for i in range(CLIENTS)]

    def run(job):
        kind, prompt, policy = job
        with DiscoClient(grpc_stacks[kind].orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            stream = client.stream(prompt, policy=policy, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            chunks = list(stream)
            return [t for chunk in chunks for t in chunk.token_ids], stream.result.token_ids

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(run, jobs))
    for (kind, prompt, policy), (streamed, final) in zip(jobs, results):
        assert streamed == final == target_only[prompt], (kind, policy)
    for stack in grpc_stacks.values():
        assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}


def test_eight_concurrent_async_requests_greedy_and_seeded(grpc_stacks, target_model, drafts, tokenizer, target_only):
    stack = grpc_stacks["noisy"]
    seeded = [dict(temperature=0.8, top_k=50, seed=i) for i in range(CLIENTS // 2)]
    expected = [target_only[PROMPTS[i % 3]] for i in range(CLIENTS // 2)]
    expected += [in_process(target_model, drafts["noisy"], tokenizer, PROMPTS[0], "static:3", **s) for s in seeded]

    async def run():
        async with AsyncDiscoClient(stack.orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            greedy = [client.generate(PROMPTS[i % 3], policy=POLICIES[i], max_new_tokens=NEW_TOKENS, ignore_eos=True)
                      for i in range(CLIENTS // 2)]
            sampled = [client.generate(PROMPTS[0], policy="static:3", max_new_tokens=NEW_TOKENS, ignore_eos=True, **s)
                       for s in seeded]
            return await asyncio.gather(*greedy, *sampled)

    results = asyncio.run(run())
    assert [result.token_ids for result in results] == expected
    assert stack.wait_idle() == {"orchestrator": 0, "draft": 0, "target": 0}
