"""Sustained load on loopback: waves of 32 concurrent streams over the tiny pair. Every
stream is exact (equal to target-only decoding), none fails, every session is freed
after each wave, and resident memory stops growing once the servers are warm."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.config import SamplingParams, SpeculationConfig
from orchestrator.client import DiscoClient
from tests.grpc_fixtures import loaded
from tests.helpers import PROMPTS, local_generator

STREAMS = 32
NEW_TOKENS = 20
WAVES = 3  # the first one warms up (allocator pools, lazy imports); the others must not grow RSS
WAVE_TIMEOUT_S = 90.0
RSS_GROWTH_LIMIT_MB = 64.0
POLICIES = ("static:3", "heuristic:2", "confidence:0.4", "entropy", "static:6", "none")
LOAD_PROMPTS = (*PROMPTS, "class Queue:\n    def __init__(self", "for i in range(10):\n", "# utilities\nimport re",
                "def wrap(text, width=70):\n    ", "return")


def rss_mb() -> float:
    """Resident memory of this process (the servers run in it), from /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status here")


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    orch = orchestrator.server.serve(tokenizer, draft.address, target.address)
    clients = [DiscoClient(orch.address, timeout=WAVE_TIMEOUT_S) for _ in range(4)]  # channels shared by threads
    yield {"orchestrator": orch, "draft": draft, "target": target, "clients": clients}
    for client in clients:
        client.close()
    for running in (orch, draft, target):
        running.stop(0)


@pytest.fixture(scope="module")
def target_only(target_model, tokenizer):
    generator = local_generator(target_model, None, tokenizer)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return {prompt: generator.generate(tokenizer(prompt)["input_ids"], params, SpeculationConfig("none")).token_ids
            for prompt in LOAD_PROMPTS}


def active(stack) -> dict[str, int]:
    return {"orchestrator": stack["orchestrator"].servicers[0].active_sessions,
            "draft": stack["draft"].servicers[0].engine.active_sessions(),
            "target": stack["target"].servicers[0].engine.active_sessions()}


def run_wave(stack) -> list[tuple[str, list[int], list[int]]]:
    def one(i: int):
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        stream = stack["clients"][i % 4].stream(prompt, policy=POLICIES[i % len(POLICIES)],
                                                 max_new_tokens=NEW_TOKENS, ignore_eos=True)
        streamed = [token for chunk in stream for token in chunk.token_ids]
        return prompt, streamed, stream.result.token_ids

    with ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(one, range(STREAMS)))


def test_waves_of_32_concurrent_streams(stack, target_only):
    rss = []
    for wave in range(WAVES):
        started = time.monotonic()
        results = run_wave(stack)  # any failed stream raises here: zero errors allowed
        elapsed = time.monotonic() - started
        assert len(results) == STREAMS and elapsed < WAVE_TIMEOUT_S
        for prompt, streamed, final in results:
            assert streamed == final == target_only[prompt], (wave, prompt)
        deadline = time.monotonic() + 5
        while any(active(stack).values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert active(stack) == {"orchestrator": 0, "draft": 0, "target": 0}
        rss.append(rss_mb())
    assert rss[-1] - rss[0] < RSS_GROWTH_LIMIT_MB, f"resident memory grew under load: {rss} MB"
    # Concurrent sessions really shared forward passes (cross-session batching).
    batch_sizes = stack["target"].servicers[0].engine.batcher.batch_sizes
    assert max(batch_sizes) > 1
    info = stack["clients"][0].info()
    assert info["active_sessions"] == {"orchestrator": 0, "draft": 0, "target": 0}
