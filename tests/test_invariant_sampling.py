"""Drafter-invariant speculative sampling (issue 47; Daliri, Musco & Suresh 2024, arXiv
2408.07978): the token at each position is the target's Gumbel-max sample under noise keyed
by (seed, position), so a seed gives one text whatever the policy, lookahead, load and
transport, and that text is a sample of the target's (warped) distribution.

* The noise: a function of (seed, position, token id) alone, bit for bit; Exp(1) distributed.
* The rule, with hand-made tensors: the emitted tokens are the target-only samples whatever
  the draft; an identical draft is always accepted.
* Statistics, with hand-made tensors: small vocabularies, temperature / top-k / top-p, a draft
  close to and far from the target: each emitted token follows the target's distribution, and
  the acceptance rate lies between (1 - TV) / (1 + TV) and 1 - TV.
* The issue's done-when on the tiny pair (float32): 4 prompts x 2 seeds at temperature 0.9 /
  top_p 0.95 give one text per (prompt, seed) for none, static:1, static:4, heuristic:3,
  confidence:0.4 and auto — in process (the local pipeline of ``disco generate``), over one
  ``disco serve`` alone, and there 8 at a time with mixed policies beside 8 greedy requests;
  an identical draft is fully accepted; an unseeded request reports the seed that reproduces
  it, over gRPC and HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from disco.config import RANDOM_SEED_BOUND, ModelConfig, PairConfig, SamplingParams, SpeculationConfig
from disco.speculation.sampling import (UNIFORM_BITS, exponential_noise, greedy_accept, gumbel_argmax,
                                        gumbel_noise, gumbel_sample, invariant_verify, logits_to_probs)
from orchestrator.client import DiscoClient
from tests.grpc_fixtures import grpc_stacks  # noqa: F401 - fixture
from tests.helpers import local_generator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_VOCAB = 151_936  # the real pair's

# -- the noise ----------------------------------------------------------------------------


def test_noise_is_a_function_of_seed_position_and_token_only():
    full = gumbel_noise(7, [40, 41, 42], QWEN_VOCAB)  # [3, vocab]
    assert full.shape == (3, QWEN_VOCAB) and full.dtype == torch.float32
    # One position alone, or among others: the same row (batch composition does not matter).
    assert torch.equal(gumbel_noise(7, [41], QWEN_VOCAB)[0], full[1])
    # Another vocabulary size (a padded draft vocabulary): the same values on the shared ids.
    assert torch.equal(gumbel_noise(7, [42], 1000)[0], full[2, :1000])
    # Any subset of token ids, in any order: the same values (the CPU support-only path).
    ids = torch.randperm(QWEN_VOCAB, generator=torch.Generator().manual_seed(0))[:5000]
    assert torch.equal(exponential_noise(7, [40], ids)[0], full[0, ids])
    # Another seed or another position: other noise.
    assert not torch.equal(gumbel_noise(8, [40], QWEN_VOCAB)[0], full[0])
    assert not torch.equal(full[0], full[1])
    assert (full > 0).all() and torch.isfinite(full).all()


def test_noise_is_exponential_and_independent():
    values = gumbel_noise(3, range(20), 5000)  # [20, 5000]
    assert kstest(values.flatten().double().numpy(), "expon").pvalue > 1e-3
    across_positions = np.corrcoef(values.numpy())[np.triu_indices(20, 1)]
    assert np.abs(across_positions).max() < 0.06  # 5000 pairs each: |r| ~ 0.014 when independent
    across_seeds = np.corrcoef(torch.cat([gumbel_noise(seed, [5], 5000) for seed in range(20)]).numpy())
    assert np.abs(across_seeds[np.triu_indices(20, 1)]).max() < 0.06
    # Consecutive seeds and positions (the usual choices) are as unrelated as any others.
    assert kstest(torch.stack([gumbel_noise(seed, [0], 1)[0, 0] for seed in range(2000)]).double().numpy(),
                  "expon").pvalue > 1e-3


def test_the_log_gives_the_same_bits_in_every_layout():
    """The noise's one floating-point function, on all 2**23 uniforms it can see: the vectorized
    loop, the scalar loop (a strided view) and short tensors (a tail) agree bit for bit on this
    machine, so a token's noise does not depend on what it is computed with."""
    uniform = (torch.arange(1 << UNIFORM_BITS, dtype=torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))
    vectorized = uniform.log()
    strided = torch.stack([uniform, uniform], dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(strided.log(), vectorized)
    picks = torch.randint(0, 1 << UNIFORM_BITS, (3000,), generator=torch.Generator().manual_seed(1))
    tails = torch.cat([uniform[picks[i:i + 7]].log() for i in range(0, len(picks), 7)])
    assert torch.equal(tails, vectorized[picks])


@pytest.mark.parametrize("warp", [dict(temperature=0.9), dict(temperature=0.9, top_p=0.95),
                                  dict(temperature=0.7, top_k=50)])
def test_the_support_only_sample_is_the_whole_vocabularys(warp):
    logits = torch.randn(4, QWEN_VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    probs = logits_to_probs(logits, SamplingParams(**warp))  # [4, vocab]
    positions = [10, 11, 12, 13]
    dense = gumbel_argmax(probs, gumbel_noise(5, positions, QWEN_VOCAB))
    assert torch.equal(gumbel_sample(probs, 5, positions), dense)


# -- the rule -----------------------------------------------------------------------------


def one_hot(tokens, vocab=6):
    probs = torch.zeros(len(tokens), vocab)
    for row, token in enumerate(tokens):
        probs[row, token] = 1.0
    return probs


@pytest.mark.parametrize("draft, target_tokens, expected", [
    ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, the target's token after them
    ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # first mismatch at 1: the target's token there
    ([1, 2, 3], [0, 2, 3, 4], (0, 0)),
    ([], [3], (0, 3)),  # empty block: a target-only step
])
def test_invariant_verify_on_certain_targets(draft, target_tokens, expected):
    """A target sure of its token samples it under any noise: the rule is then greedy's."""
    probs = one_hot(target_tokens)
    assert invariant_verify(draft, probs, seed=11, first_position=30) == expected
    assert greedy_accept(draft, probs.log()) == expected


def test_the_emitted_tokens_are_the_target_only_samples_whatever_the_draft():
    vocab, k, rng = 9, 4, torch.Generator().manual_seed(3)
    for seed in range(300):
        target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=rng) * 2, -1)  # [k + 1, vocab]
        target_only = gumbel_sample(target_probs, seed, range(100, 100 + k + 1)).tolist()
        close = torch.softmax(target_probs[:k].log() + 0.3 * torch.randn(k, vocab, generator=rng), -1)
        drafts = [gumbel_sample(close, seed, range(100, 100 + k)).tolist(),  # the invariant draft
                  torch.randint(0, vocab, (k,), generator=rng).tolist(),  # any tokens at all
                  target_only[:k]]  # the target's own
        for draft in drafts:
            num_accepted, next_token = invariant_verify(draft, target_probs, seed, first_position=100)
            assert draft[:num_accepted] + [next_token] == target_only[:num_accepted + 1]
        assert invariant_verify(target_only[:k], target_probs, seed, 100) == (k, target_only[k])


def test_an_identical_draft_is_always_accepted():
    for seed in range(200):
        probs = logits_to_probs(torch.randn(5, 40, generator=torch.Generator().manual_seed(seed)),
                                SamplingParams(temperature=1.2, top_p=0.9))
        draft = gumbel_sample(probs[:4], seed, range(7, 11)).tolist()
        assert invariant_verify(draft, probs, seed, first_position=7)[0] == 4


# -- statistics ---------------------------------------------------------------------------

WARPS = {
    "temperature": SamplingParams(temperature=1.0),
    "cold+top_k": SamplingParams(temperature=0.6, top_k=4),
    "hot+top_p": SamplingParams(temperature=1.4, top_p=0.85),
    "top_k+top_p": SamplingParams(temperature=0.9, top_k=5, top_p=0.9),
}
DRAFT_NOISE = {"close": 0.25, "far": 2.5}  # scale of the draft's logits' difference from the target's


def _chi_square_pvalue(counts: np.ndarray, probs: torch.Tensor) -> float:
    """Chi-square of ``counts`` against ``probs`` on its support (no count outside it)."""
    probs = probs.double().numpy()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the warped support was emitted"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("draft_kind", list(DRAFT_NOISE))
@pytest.mark.parametrize("warp", list(WARPS))
def test_the_invariant_rule_keeps_the_target_distribution(warp, draft_kind):
    """Over 3000 seeds: the first emitted token follows target row 0, the second (when the first
    was accepted) row 1; the acceptance rate at position 0 lies between the coupling's bound
    (1 - TV) / (1 + TV) and the best any coupling can do, 1 - TV."""
    vocab, k, trials, first = 7, 2, 3000, 50
    rng = torch.Generator().manual_seed(sorted(WARPS).index(warp) * 10 + len(draft_kind))
    target_logits = torch.randn(k + 1, vocab, generator=rng) * 1.5
    draft_logits = target_logits[:k] + DRAFT_NOISE[draft_kind] * torch.randn(k, vocab, generator=rng)
    params = WARPS[warp]
    target_probs, draft_probs = logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)
    first_counts, second_counts, accepted_first = np.zeros(vocab), np.zeros(vocab), 0
    for seed in range(trials):
        draft = gumbel_sample(draft_probs, seed, range(first, first + k)).tolist()
        num_accepted, next_token = invariant_verify(draft, target_probs, seed, first)
        emitted = draft[:num_accepted] + [next_token]
        first_counts[emitted[0]] += 1
        if num_accepted >= 1:
            accepted_first += 1
            second_counts[emitted[1]] += 1
    assert _chi_square_pvalue(first_counts, target_probs[0]) > 1e-3, (first_counts / trials, target_probs[0])
    assert _chi_square_pvalue(second_counts, target_probs[1]) > 1e-3
    tv = 0.5 * float((target_probs[0] - draft_probs[0]).abs().sum())
    rate, slack = accepted_first / trials, 3 * 0.5 / trials ** 0.5  # three standard deviations at most
    assert (1 - tv) / (1 + tv) - slack <= rate <= 1 - tv + slack, (rate, tv)


# -- the done-when on the tiny pair ---------------------------------------------------------

PROMPTS = ("def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Wrapper(object):", "for item in items:",
           "x = ")
SEEDS = (11, 2024)
POLICIES = ("none", "static:1", "static:4", "heuristic:3", "confidence:0.4", "auto")
NEW_TOKENS = 48
SAMPLED = dict(temperature=0.9, top_p=0.95)


def sampling(seed: int | None, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, **{**SAMPLED, **extra})


@pytest.fixture(scope="module")
def in_process(tiny_pair_dirs, tmp_path_factory):
    """The local pipeline ``disco generate`` builds without ``--server`` (costs measured for auto)."""
    from disco.engines.in_process import build_local_pipeline  # noqa: PLC0415

    pair = PairConfig(target=ModelConfig(spec=str(tiny_pair_dirs["target"]), dtype="float32"),
                      draft=ModelConfig(spec=str(tiny_pair_dirs["draft"]), dtype="float32"))
    return build_local_pipeline(pair, tmp_path_factory.mktemp("invariant_home"), measure_costs=True)


@pytest.fixture(scope="module")
def reference(in_process):
    """``{(prompt, seed): token ids}`` of target-only sampling in process."""
    pipeline = in_process
    return {(prompt, seed): pipeline.generator.generate(pipeline.tokenizer(prompt)["input_ids"], sampling(seed),
                                                        SpeculationConfig(policy="none")).token_ids
            for prompt in PROMPTS for seed in SEEDS}


def test_in_process_every_policy_gives_the_target_only_text(in_process, reference):
    pipeline = in_process
    for (prompt, seed), expected in reference.items():
        assert len(set(expected)) > 10, "the reference must vary (a degenerate model hides bugs)"
        for policy in POLICIES[1:]:
            result = pipeline.generator.generate(pipeline.tokenizer(prompt)["input_ids"], sampling(seed),
                                                 SpeculationConfig(policy=policy))
            assert result.token_ids == expected, (prompt, seed, policy)
            assert result.stats.seed == seed
    assert len(set(map(tuple, reference.values()))) == len(reference)  # each (prompt, seed) its own text


def test_an_identical_draft_is_fully_accepted_when_sampling(target_model, drafts, tokenizer, grpc_stacks):  # noqa: F811
    generator = local_generator(target_model, drafts["same"], tokenizer)
    for prompt in PROMPTS[:2]:
        for policy in ("static:1", "static:4", "heuristic:3"):
            stats = generator.generate(tokenizer(prompt)["input_ids"], sampling(SEEDS[0]),
                                       SpeculationConfig(policy=policy)).stats
            assert stats.draft_tokens > 0 and stats.acceptance_rate == 1.0, (prompt, policy)
    over_grpc = grpc_stacks["same"].client.generate(PROMPTS[0], policy="static:4", max_new_tokens=NEW_TOKENS,
                                                    seed=SEEDS[1], ignore_eos=True, **SAMPLED).stats
    assert over_grpc["draft_tokens"] > 0 and over_grpc["acceptance_rate"] == 1.0


@pytest.fixture(scope="module")
def served(tiny_pair_dirs, tmp_path_factory):
    """One ``disco serve`` (float32 tiny pair, HTTP gateway on): its announced addresses."""
    command = [sys.executable, "-m", "disco_cli.main", "serve", "--target", str(tiny_pair_dirs["target"]),
               "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--port", "0", "--http-port", "0",
               "--json"]
    env = {**os.environ, "DISCO_HOME": str(tmp_path_factory.mktemp("served_home")), "PYTHONPATH": REPO}
    env.pop("DISCO_AUTH_TOKEN", None)
    # Its own process group: the services it starts go with it, whatever its shutdown does.
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = process.stdout.readline()
        assert line, f"disco serve exited ({process.wait(30)}) before announcing its address"
        yield json.loads(line)
    finally:
        process.terminate()
        try:
            process.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def _generate(client: DiscoClient, prompt: str, seed: int | None, policy: str, **extra):
    return client.generate(prompt, policy=policy, max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True,
                           **{**SAMPLED, **extra})


def test_served_alone_every_policy_gives_the_in_process_text(served, reference):
    with DiscoClient(served["orchestrator"], timeout=120) as client:
        for (prompt, seed), expected in reference.items():
            for policy in POLICIES:
                completion = _generate(client, prompt, seed, policy)
                assert completion.token_ids == expected, (prompt, seed, policy)
                assert completion.stats["seed"] == seed


def test_served_under_load_mixed_policies_beside_greedy_give_the_same_texts(served, reference, in_process):
    """Waves of the 8 sampled requests, each with another policy, beside 8 greedy ones: 16 at
    once, so ``auto`` sees the load; every (prompt, seed, policy) runs once under load."""
    pipeline = in_process
    greedy = {prompt: pipeline.generator.generate(pipeline.tokenizer(prompt)["input_ids"],
                                                  SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                                  SpeculationConfig(policy="none")).token_ids for prompt in PROMPTS}
    keys = list(reference)
    with DiscoClient(served["orchestrator"], timeout=180) as client, ThreadPoolExecutor(16) as pool:
        for wave in range(len(POLICIES)):
            sampled = [pool.submit(_generate, client, prompt, seed, POLICIES[(index + wave) % len(POLICIES)])
                       for index, (prompt, seed) in enumerate(keys)]
            greedy_runs = [pool.submit(_generate, client, PROMPTS[index % len(PROMPTS)], None,
                                       POLICIES[(index + wave + 1) % len(POLICIES)], temperature=0.0)
                           for index in range(8)]
            for index, (key, future) in enumerate(zip(keys, sampled)):
                assert future.result().token_ids == reference[key], (key, POLICIES[(index + wave) % len(POLICIES)])
            for index, future in enumerate(greedy_runs):
                completion = future.result()
                assert completion.token_ids == greedy[PROMPTS[index % len(PROMPTS)]]
                assert completion.stats["seed"] is None


def _post_completion(url: str, body: dict) -> dict:
    """POST ``body`` to the gateway's ``/v1/completions`` (``url``: its announced base, ``.../v1``)."""
    request = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_an_unseeded_request_reports_the_seed_that_reproduces_it(served):
    with DiscoClient(served["orchestrator"], timeout=120) as client:
        first = _generate(client, PROMPTS[1], None, "static:4")
        seed = first.stats["seed"]
        assert isinstance(seed, int) and 0 <= seed < RANDOM_SEED_BOUND
        assert _generate(client, PROMPTS[1], seed, "none").token_ids == first.token_ids
        assert _generate(client, PROMPTS[1], None, "static:4").stats["seed"] != seed
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "ignore_eos": True, "policy": "static:4", **SAMPLED}
    answer = _post_completion(served["http"], body)
    assert isinstance(answer["seed"], int) and 0 <= answer["seed"] < RANDOM_SEED_BOUND
    again = _post_completion(served["http"], {**body, "seed": answer["seed"], "policy": "auto"})
    assert again["seed"] == answer["seed"] and again["choices"][0]["text"] == answer["choices"][0]["text"]
    assert _post_completion(served["http"], {**body, "temperature": 0})["seed"] is None
