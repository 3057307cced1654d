"""Opt-in tests on the real default pair (``pytest -m slow``); they prepare the pair
offline on first use (several minutes) and take minutes on a 2-core CPU."""

import pytest
import torch

from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig
from disco.engines.engine_choice import choose_engine
from disco.engines.in_process import build_local_pipeline, encode_prompt
from disco.engines.kv import CachedSequence
from disco.models.loading import disco_home
from disco.models.weight_only import DENSE_MIN_ROWS
from disco.offline.datasets import load_dataset
from tests.helpers import generate_at_once

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def float32_pipeline():
    pair = PairConfig(target=ModelConfig(dtype="float32"), draft=ModelConfig(dtype="float32"))
    return build_local_pipeline(pair, disco_home())


@pytest.mark.parametrize("policy", ["static:6", "heuristic:4", "confidence:0.4"])
def test_real_pair_float32_greedy_is_exact(float32_pipeline, policy):
    generator = float32_pipeline.generator
    prompt_ids = encode_prompt(float32_pipeline.tokenizer, "def fib(n):", chat=False)
    sampling = SamplingParams(max_new_tokens=24)
    reference = generator.generate(prompt_ids, sampling, SpeculationConfig(policy="none"))
    result = generator.generate(prompt_ids, sampling, SpeculationConfig(policy=policy))
    assert result.token_ids == reference.token_ids
    assert result.stats.acceptance_rate > 0.3
    assert "return" in result.text


@pytest.fixture(scope="module")
def default_engine_pipeline():
    """The default engine of this machine (``--dtype auto``: e.g. bf16 target with AMX,
    int8 without; int4 draft), with the measured costs ``auto`` reads."""
    pair = PairConfig(target=ModelConfig(dtype=choose_engine("auto", None, "target", "cpu", disco_home())),
                      draft=ModelConfig(dtype=choose_engine("auto", None, "draft", "cpu", disco_home())))
    return build_local_pipeline(pair, disco_home(), measure_costs=True)


def test_default_engine_concurrent_requests_equal_target_only_alone(default_engine_pipeline):
    """Sessions batched together (long prompts: one-call prefill blocks; short ones: the
    row-stable calls) give each the tokens target-only gives it alone, in the default engine."""
    generator, tokenizer = default_engine_pipeline.generator, default_engine_pipeline.tokenizer
    items = load_dataset("humaneval:train", limit=3).items
    prompts = [item.encode(tokenizer) for item in items] + [encode_prompt(tokenizer, "def fib(n):", chat=False)]
    assert max(map(len, prompts)) >= DENSE_MIN_ROWS + 1 > min(map(len, prompts))
    sampling = SamplingParams(max_new_tokens=24)
    alone = [generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids for ids in prompts]
    jobs = [(ids, policy) for ids in prompts for policy in ("none", "auto")]
    generator.verifier.batcher.batch_sizes.clear()
    assert generate_at_once(generator, jobs, sampling, timeout_s=600) == [alone[i // 2] for i in range(len(jobs))]
    assert max(generator.verifier.batcher.batch_sizes) > 1, "concurrent forwards were never batched"


def test_default_engine_batched_forwards_give_each_prompt_its_bits_alone(default_engine_pipeline):
    """Bit for bit, in the default engine: prompts of 20, 64 and 200 tokens prefilled in one
    packed forward get the keys and values each gets alone (on the AMX Xeon the plain bf16
    kernels fail this for the 200-token prompt: docs/engines.md), and a 4-token verification
    of the three at once gets the logits each gets alone."""
    model = default_engine_pipeline.target.model
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20_000, (n,), generator=generator).tolist() + [11, 12, 13, 14]
               for n in (20, 64, 200)]

    def run(batches: list[list[int]]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        sequences = [CachedSequence(model, ids[:-4]) for ids in prompts]
        caches, logits = [], []
        for batch in batches:
            CachedSequence.forward_batch([sequences[i] for i in batch], [0] * len(batch), [False] * len(batch))
        for sequence in sequences:
            layers = sequence.cache.layers
            caches.append([layer.keys.clone() for layer in layers] + [layer.values.clone() for layer in layers])
            sequence.tokens.extend([11, 12, 13, 14])
        for batch in batches:
            results = CachedSequence.forward_batch([sequences[i] for i in batch], [5] * len(batch), [False] * len(batch))
            logits.extend(result[0] for result in results)
        return caches, logits

    alone_caches, alone_logits = run([[0], [1], [2]])
    batched_caches, batched_logits = run([[0, 1, 2]])
    for index in range(3):
        assert all(torch.equal(a, b) for a, b in zip(batched_caches[index], alone_caches[index])), index
        assert torch.equal(batched_logits[index], alone_logits[index]), index
