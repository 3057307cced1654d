"""Verification math as small pure functions over tensors (gpt-fast style).

Exactness contract:

* Greedy (:func:`greedy_accept`): a draft token is accepted iff it equals the target's
  argmax at its position; the bonus token is the target's argmax after the accepted
  prefix. The output therefore equals target-only greedy decoding token for token.
* Sampling (:func:`rejection_sample`): Leviathan et al. 2023 ("Fast Inference from
  Transformers via Speculative Decoding", Alg. 1) / Chen et al. 2023: accept draft token
  ``x`` with probability ``min(1, target_probs[x] / draft_probs[x])``; on the first
  rejection draw the recovered token from ``norm(max(0, target_probs - draft_probs))``; if
  all are accepted sample the bonus token from the next target distribution. Every
  emitted token is distributed exactly as ``target_probs``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from disco.config import SamplingParams


def logits_to_probs(
    logits: torch.Tensor,  # [..., vocab]
    sampling: SamplingParams,
) -> torch.Tensor:  # [..., vocab] float32, rows sum to 1
    """Temperature, then top-k, then top-p (nucleus) warping, as HF's logits warpers.

    Greedy requests (temperature 0) get the plain softmax; callers take its argmax.
    """
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, sorted_index = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_index, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(
    probs: torch.Tensor,  # [vocab]
    generator: torch.Generator | None,
) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def greedy_accept(
    draft_token_ids: Sequence[int],  # k draft tokens
    target_logits: torch.Tensor,  # [k + 1, vocab]
) -> tuple[int, int]:
    """Returns ``(num_accepted, next_token_id)`` under greedy decoding."""
    target_argmax = target_logits.argmax(dim=-1).tolist()  # k + 1 ints
    num_accepted = 0
    for draft_token, target_token in zip(draft_token_ids, target_argmax):
        if draft_token != target_token:
            break
        num_accepted += 1
    return num_accepted, int(target_argmax[num_accepted])


def rejection_sample(
    draft_token_ids: Sequence[int],  # k draft tokens
    draft_probs: torch.Tensor,  # [k, vocab] warped draft distributions the tokens came from
    target_probs: torch.Tensor,  # [k + 1, vocab] warped target distributions
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Returns ``(num_accepted, next_token_id)``; see the module docstring.

    ``draft_probs`` and ``target_probs`` may differ in vocabulary size (padded
    embeddings); both are cut to the shared prefix of the vocabulary.
    """
    vocab = min(draft_probs.shape[-1], target_probs.shape[-1]) if len(draft_token_ids) else target_probs.shape[-1]
    target_probs = target_probs[:, :vocab].float()
    draft_probs = draft_probs[:, :vocab].float()
    for position, token in enumerate(draft_token_ids):
        target_prob = target_probs[position, token]
        draft_prob = draft_probs[position, token]
        uniform = torch.rand((), generator=generator)
        if draft_prob > 0 and uniform * draft_prob <= target_prob:
            continue  # accepted: uniform < target_prob / draft_prob
        residual = torch.clamp(target_probs[position] - draft_probs[position], min=0.0)
        total = residual.sum()
        # NOTE: total > 0 whenever a rejection is possible (target_prob < draft_prob);
        # the fallback only guards against float underflow.
        recovered_probs = residual / total if total > 0 else target_probs[position]
        return position, sample_token(recovered_probs, generator)
    return len(draft_token_ids), sample_token(target_probs[len(draft_token_ids)], generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on ``device`` (the model's: ``torch.multinomial`` needs the generator on
    the device of the probabilities it samples) seeded for reproducible sampling, or None for
    greedy/unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
