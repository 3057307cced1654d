"""Opt-in tests on the real default pair (``pytest -m slow``); they prepare the pair
offline on first use (several minutes) and take minutes on a 2-core CPU."""

import pytest

from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig
from disco.models import disco_home
from disco.pipeline import build_local_pipeline, encode_prompt

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
