"""Greedy speculative output == target-only output, token for token, in float32,
for every policy, every kind of draft, several prompts and model shapes."""

import pytest

from disco.config import SamplingParams, SpeculationConfig
from tests import tiny
from tests.helpers import ALL_POLICIES, EOS_ID, PROMPTS, local_generator


def greedy(max_new_tokens=48, **kwargs):
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def references(target_model, tokenizer):
    generator = local_generator(target_model, None, tokenizer)
    refs = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        refs[prompt] = generator.generate(ids, greedy(), SpeculationConfig(policy="none")).token_ids
    return refs


def test_reference_output_is_not_degenerate(references):
    for token_ids in references.values():
        assert len(token_ids) == 48
        assert len(set(token_ids)) >= 12, "random test model repeats itself: exactness tests would be vacuous"


@pytest.mark.parametrize("draft_name", ["random", "same", "noisy"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_greedy_equals_target_only(draft_name, policy, drafts, target_model, tokenizer, references):
    generator = local_generator(target_model, drafts[draft_name], tokenizer)
    for prompt in PROMPTS:
        result = generator.generate(tokenizer(prompt)["input_ids"], greedy(), SpeculationConfig(policy=policy))
        assert result.token_ids == references[prompt], (draft_name, policy, prompt)
        stats = result.stats
        assert stats.generated_tokens == 48
        assert stats.target_forwards == stats.iterations == len(stats.lookaheads)
        assert stats.draft_tokens == sum(stats.lookaheads)
        assert stats.accepted_tokens + stats.iterations >= 48
        if draft_name == "same":
            assert stats.accepted_tokens == stats.draft_tokens, "an identical draft must be fully accepted"


def test_drafts_span_the_acceptance_regimes(drafts, target_model, tokenizer):
    rates = {}
    for name, draft in drafts.items():
        generator = local_generator(target_model, draft, tokenizer)
        result = generator.generate(tokenizer(PROMPTS[0])["input_ids"], greedy(64), SpeculationConfig(policy="static:4"))
        rates[name] = result.stats.acceptance_rate
    assert rates["same"] == 1.0
    assert rates["random"] < 0.2
    assert 0.2 < rates["noisy"] < 0.9, rates


@pytest.mark.parametrize("policy", ["static:3", "heuristic:2", "confidence:0.2"])
def test_other_model_shape_llama(policy, tokenizer):
    target = tiny.llama(seed=5)
    draft = tiny.noisy_copy(target, scale=0.02, seed=6)
    ids = tokenizer(PROMPTS[1])["input_ids"]
    reference = local_generator(target, None, tokenizer).generate(ids, greedy(), SpeculationConfig(policy="none"))
    assert len(set(reference.token_ids)) >= 10
    result = local_generator(target, draft, tokenizer).generate(ids, greedy(), SpeculationConfig(policy=policy))
    assert result.token_ids == reference.token_ids


def test_max_new_tokens_one(drafts, target_model, tokenizer, references):
    generator = local_generator(target_model, drafts["same"], tokenizer)
    result = generator.generate(tokenizer(PROMPTS[0])["input_ids"], greedy(1), SpeculationConfig(policy="static:5"))
    assert result.token_ids == references[PROMPTS[0]][:1]
    assert result.stats.lookaheads == [0] and result.stats.draft_forwards == 0
    assert result.finish_reason == "length"


@pytest.mark.parametrize("max_new_tokens", [4, 5, 8, 9, 10])
def test_block_boundaries_never_overshoot(max_new_tokens, drafts, target_model, tokenizer, references):
    """With a fully accepted draft and static:4 each iteration yields 5 tokens: lengths
    at, before and after a block boundary must all be exact and never drafted past."""
    generator = local_generator(target_model, drafts["same"], tokenizer)
    result = generator.generate(tokenizer(PROMPTS[0])["input_ids"], greedy(max_new_tokens),
                                SpeculationConfig(policy="static:4"))
    assert result.token_ids == references[PROMPTS[0]][:max_new_tokens]
    assert result.stats.draft_tokens + result.stats.iterations == max_new_tokens  # nothing drafted past the end


def test_lookahead_cap_bounds_every_block(drafts, target_model, tokenizer, references):
    generator = local_generator(target_model, drafts["same"], tokenizer)
    result = generator.generate(tokenizer(PROMPTS[0])["input_ids"], greedy(),
                                SpeculationConfig(policy="static:50", max_lookahead=6))
    assert max(result.stats.lookaheads) == 6
    assert result.token_ids == references[PROMPTS[0]]


def test_long_prompt(drafts, target_model, tokenizer):
    prompt_ids = (tokenizer(PROMPTS[1])["input_ids"] * 30)[:400]
    reference = local_generator(target_model, None, tokenizer).generate(
        prompt_ids, greedy(32), SpeculationConfig(policy="none"))
    result = local_generator(target_model, drafts["noisy"], tokenizer).generate(
        prompt_ids, greedy(32), SpeculationConfig(policy="static:5"))
    assert result.token_ids == reference.token_ids


def test_prompt_plus_max_new_tokens_beyond_context_is_refused(drafts, target_model, tokenizer):
    from disco.errors import InvalidRequest
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    with pytest.raises(InvalidRequest, match="context"):
        generator.generate([5] * 500, greedy(100), SpeculationConfig(policy="static:3"))


def _first_index_of_new(token_ids, position_floor):
    for index in range(position_floor, len(token_ids)):
        if token_ids[index] not in token_ids[:index]:
            return index
    raise AssertionError("no fresh token")


@pytest.mark.parametrize("policy", ["none", "static:6", "heuristic:2"])
def test_eos_inside_a_draft_block_ends_generation(policy, drafts, target_model, tokenizer, references):
    """Pretend a token from the middle of the reference is EOS: output stops right
    after it, with EOS included, whatever the block layout."""
    reference = references[PROMPTS[0]]
    index = _first_index_of_new(reference, 10)
    eos = reference[index]
    generator = local_generator(target_model, drafts["same"], tokenizer, eos=(eos,))
    result = generator.generate(tokenizer(PROMPTS[0])["input_ids"], SamplingParams(max_new_tokens=48),
                                SpeculationConfig(policy=policy))
    assert result.token_ids == reference[: index + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("policy", ["none", "static:6"])
def test_stop_string_inside_a_draft_block(policy, drafts, target_model, tokenizer, references):
    reference = references[PROMPTS[0]]
    full_text = tokenizer.decode(reference, skip_special_tokens=True)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    cut = full_text.find(stop)
    generator = local_generator(target_model, drafts["same"], tokenizer)
    result = generator.generate(tokenizer(PROMPTS[0])["input_ids"],
                                SamplingParams(max_new_tokens=48, stop=(stop,), ignore_eos=True),
                                SpeculationConfig(policy=policy))
    assert result.text == full_text[:cut]
    assert result.finish_reason == "stop"
    assert result.token_ids == reference[: len(result.token_ids)]
    assert stop in tokenizer.decode(result.token_ids) and stop not in tokenizer.decode(result.token_ids[:-1])


def test_streamed_text_concatenates_to_the_result(drafts, target_model, tokenizer):
    from disco.speculation.loop import GenerationResult, TokenChunk
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    chunks, result = [], None
    for event in generator.stream(tokenizer(PROMPTS[0])["input_ids"], greedy(), SpeculationConfig(policy="static:3")):
        if isinstance(event, TokenChunk):
            chunks.append(event)
        else:
            assert isinstance(event, GenerationResult)
            result = event
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.stats.iterations == len(chunks)


def test_sessions_are_freed(drafts, target_model, tokenizer):
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.generate(tokenizer(PROMPTS[0])["input_ids"], greedy(8), SpeculationConfig(policy="static:3"))
    assert generator.drafter.active_sessions() == 0 and generator.verifier.active_sessions() == 0
