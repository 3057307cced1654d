"""Sampled speculative decoding: reproducible with a seed, and the output distribution
is the target's (checked end to end on a small-vocabulary model)."""

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from disco.config import SamplingParams, SpeculationConfig
from disco.speculation.sampling import logits_to_probs
from tests import tiny
from tests.helpers import PROMPTS, local_generator


def sampled(seed, max_new_tokens=32, **kwargs):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True,
                          **kwargs)


def test_seeded_sampling_is_reproducible(drafts, target_model, tokenizer):
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    first = generator.generate(ids, sampled(3), SpeculationConfig(policy="static:4"))
    again = generator.generate(ids, sampled(3), SpeculationConfig(policy="static:4"))
    other = generator.generate(ids, sampled(4), SpeculationConfig(policy="static:4"))
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    assert first.stats.accepted_tokens > 0


class _TinyVocabTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_speculative_sampling_matches_target_distribution():
    """Two generated tokens over a vocabulary of 6: the empirical joint distribution of
    speculative sampling (static:2, a different draft) must match the exact target joint
    computed by enumeration."""
    vocab, trials = 6, 1200
    target = tiny.qwen2(seed=21, vocab_size=vocab, hidden=16, layers=1)
    draft = tiny.qwen2(seed=22, vocab_size=vocab, hidden=16, layers=1)
    prompt = [1, 2, 3]
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=5, ignore_eos=True)
    with torch.inference_mode():
        first = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], params)  # [vocab]
        joint = np.zeros((vocab, vocab))
        for a in range(vocab):
            second = logits_to_probs(target(torch.tensor([prompt + [a]])).logits[0, -1], params)
            joint[a] = (first[a] * second).double().numpy()
    generator = local_generator(target, draft, _TinyVocabTokenizer(), eos=())
    counts = np.zeros((vocab, vocab))
    accepted = 0
    for seed in range(trials):
        result = generator.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}),
                                    SpeculationConfig(policy="static:2"))
        a, b = result.token_ids
        counts[a, b] += 1
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < trials, "the test needs both acceptances and rejections"
    support = joint.reshape(-1) > 0
    assert counts.reshape(-1)[~support].sum() == 0
    expected = joint.reshape(-1)[support]
    observed = counts.reshape(-1)[support]
    # Pool rare cells so the chi-square approximation holds.
    order = np.argsort(expected)
    expected, observed = expected[order] * trials / expected.sum(), observed[order]
    rare = np.cumsum(expected) < 25
    expected = np.append(expected[~rare], expected[rare].sum())
    observed = np.append(observed[~rare], observed[rare].sum())
    assert chisquare(observed, expected).pvalue > 1e-3
