"""Verification math with hand-made tensors: greedy acceptance, warping, and a
statistical test that rejection sampling reproduces the target distribution (the
drafter-invariant rule the engines use: tests/test_invariant_sampling.py)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from disco.config import SamplingParams
from disco.speculation.sampling import greedy_accept, logits_to_probs, make_generator, rejection_sample


def one_hot_logits(argmaxes, vocab=6):
    logits = torch.zeros(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


@pytest.mark.parametrize("draft, target_argmax, expected", [
    ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, bonus from the last position
    ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # first rejection at 1, correction 5
    ([1, 2, 3], [0, 2, 3, 4], (0, 0)),  # rejected immediately
    ([], [3], (0, 3)),  # empty block: plain target step
])
def test_greedy_accept(draft, target_argmax, expected):
    assert greedy_accept(draft, one_hot_logits(target_argmax)) == expected


def test_logits_to_probs_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    top_k = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top_k, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    top_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(top_p, torch.tensor([2 / 3, 1 / 3, 0, 0]))  # 0.5 + 0.25 covers 0.7
    hot = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert hot[0] > 0.5 and torch.isclose(hot.sum(), torch.tensor(1.0))


def expected_counts(probs, trials):
    probs = probs.double().numpy()
    return probs / probs.sum() * trials


def _distribution(seed, vocab):
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=generator) * 1.5, dim=-1)


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_preserves_target_distribution(k):
    """Each emitted position must be distributed as the target, whatever the draft."""
    vocab, trials = 5, 6000
    target_probs = torch.stack([_distribution(10 + i, vocab) for i in range(k + 1)])  # [k + 1, vocab]
    draft_probs = torch.stack([_distribution(20 + i, vocab) for i in range(k)])  # [k, vocab]
    generator = make_generator(1234)
    first_counts = np.zeros(vocab)
    for _ in range(trials):
        draft_ids = [int(torch.multinomial(draft_probs[i], 1, generator=generator)) for i in range(k)]
        num_accepted, bonus = rejection_sample(draft_ids, draft_probs, target_probs, generator)
        first_token = draft_ids[0] if num_accepted > 0 else bonus
        first_counts[first_token] += 1
    result = chisquare(first_counts, expected_counts(target_probs[0], trials))
    assert result.pvalue > 1e-3, (first_counts / trials, target_probs[0])


def test_rejection_sampling_second_position_distribution():
    """The token at position 2 (accepted draft or correction/bonus) follows target row 1
    given an accepted first token."""
    vocab, trials = 4, 6000
    target_probs = torch.stack([torch.tensor([1.0, 0, 0, 0]), _distribution(3, vocab), _distribution(4, vocab)])
    draft_probs = torch.stack([torch.tensor([1.0, 0, 0, 0]), _distribution(5, vocab)])
    generator = make_generator(7)
    counts = np.zeros(vocab)
    for _ in range(trials):
        second = int(torch.multinomial(draft_probs[1], 1, generator=generator))
        num_accepted, bonus = rejection_sample([0, second], draft_probs, target_probs, generator)
        assert num_accepted >= 1  # identical first rows: always accepted
        counts[second if num_accepted == 2 else bonus] += 1
    assert chisquare(counts, expected_counts(target_probs[1], trials)).pvalue > 1e-3


def test_rejection_sampling_identical_distributions_accepts_everything():
    probs = torch.stack([_distribution(i, 8) for i in range(4)])
    generator = make_generator(0)
    for _ in range(200):
        draft_ids = [int(torch.multinomial(probs[i], 1, generator=generator)) for i in range(3)]
        assert rejection_sample(draft_ids, probs[:3], probs, generator)[0] == 3


def test_sessions_sample_with_a_seed_and_noise_on_the_models_device(target_model):
    """The noise is hashed on the device of the probabilities (the model's: a GPU there), and a
    sampled session always has a seed: the caller's, or a random one (greedy keeps none)."""
    from disco.engines.target import TargetEngine  # noqa: PLC0415
    from disco.speculation.sampling import gumbel_noise  # noqa: PLC0415

    device = next(target_model.parameters()).device
    assert gumbel_noise(5, [3, 4], 10, device).device == device
    engine = TargetEngine(target_model)
    engine.start_session("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=5))
    engine.start_session("u", [1, 2, 3], SamplingParams(temperature=1.0))
    engine.start_session("g", [1, 2, 3], SamplingParams())
    assert engine.sessions.get("s").sampling.seed == 5
    assert engine.sessions.get("u").sampling.seed is not None
    assert engine.sessions.get("g").sampling.seed is None
    for session in ("s", "u", "g"):
        engine.end_session(session)
