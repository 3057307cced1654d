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

import numpy as np
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


def sample(
    probs: torch.Tensor,  # [..., vocab] rows summing to 1 (not checked)
    generator: torch.Generator | None,
) -> torch.Tensor:  # [...] long, on the device of probs
    """One token per row, drawn from ``probs``, without a device-to-host sync.

    ``argmax(probs / q)`` with ``q ~ Exp(1)``: the exponential-race form of Gumbel-max, and
    exactly what ``torch.multinomial(probs, 1)`` computes for one sample — the same
    random numbers drawn, the same token (checked in tests/test_host_syncs.py) — minus
    multinomial's input checks, which read two values back to the host (a CUDA sync each).
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


def sample_token(
    probs: torch.Tensor,  # [vocab]
    generator: torch.Generator | None,
) -> int:
    """:func:`sample` read back to the host (one transfer)."""
    return int(to_host(sample(probs, generator))[()])


def to_host(values: torch.Tensor) -> np.ndarray:
    """THE device-to-host transfer of the per-token paths: one copy of ``values`` into host
    memory (a CUDA sync), returned as numpy. The drafting step and the verification gather
    everything the host needs into one tensor and call this once (tests/test_host_syncs.py
    counts it)."""
    return values.detach().to("cpu").numpy()


def greedy_accept(
    draft_token_ids: Sequence[int],  # k draft tokens
    target_logits: torch.Tensor,  # [k + 1, vocab]
) -> tuple[int, int]:
    """Returns ``(num_accepted, next_token_id)`` under greedy decoding (one transfer: the
    k + 1 argmaxes)."""
    target_argmax = to_host(target_logits.argmax(dim=-1)).tolist()  # k + 1 ints
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
    embeddings); both are cut to the shared prefix of the vocabulary. ``draft_probs`` may
    live on the host (they came over the wire); they are moved to the target's device.

    Runs on the device of ``target_probs`` with one transfer at the end (the accepted count
    and the token): all k acceptance tests at once (k uniforms drawn in one call), the
    first rejection found on the device, the recovered (or bonus) distribution picked by
    that index and sampled with :func:`sample`.

    NOTE: the k uniforms are always drawn, where a loop stops drawing at the first
    rejection; so a seeded request that rejects before its block's last token draws
    different numbers afterwards than before this change (same distribution: every
    uniform is independent of the others). Without a rejection, or with one at the last
    token, the numbers and tokens are the loop's bit for bit; a target-only step (k = 0)
    is ``torch.multinomial``'s.
    """
    num_draft = len(draft_token_ids)
    device = target_probs.device
    vocab = min(draft_probs.shape[-1], target_probs.shape[-1]) if num_draft else target_probs.shape[-1]
    target_probs = target_probs[:, :vocab].float()  # [k + 1, vocab]
    draft_probs = draft_probs[:num_draft, :vocab].to(device=device, dtype=torch.float32)  # [k, vocab]
    tokens = torch.tensor(list(draft_token_ids), dtype=torch.long, device=device)  # [k]
    positions = torch.arange(num_draft, device=device)
    target_prob = target_probs[positions, tokens]  # [k]
    draft_prob = draft_probs[positions, tokens]  # [k]
    uniform = torch.rand(num_draft, generator=generator, device=device)  # [k]
    accepted = (draft_prob > 0) & (uniform * draft_prob <= target_prob)  # uniform < target_prob / draft_prob
    num_accepted = accepted.long().cumprod(dim=0).sum().reshape(1)  # [1]: up to the first rejection
    # The distribution of the next token: on a rejection at position n the normalised residual
    # max(0, target - draft) there, else (all accepted) the target's row k.
    target_row = target_probs.index_select(0, num_accepted)  # [1, vocab]
    padded_draft = torch.cat([draft_probs, torch.zeros_like(target_probs[:1])])  # [k + 1, vocab]
    residual = torch.clamp(target_row - padded_draft.index_select(0, num_accepted), min=0.0)  # [1, vocab]
    total = residual.sum(dim=-1, keepdim=True)  # [1, 1]
    # NOTE: total > 0 whenever a rejection is possible (target_prob < draft_prob); the
    # target's row is the fallback against float underflow, and the row itself when all
    # are accepted (not the residual divided by its sum: those bits may differ).
    rejected = (num_accepted < num_draft).reshape(1, 1) & (total > 0)
    next_probs = torch.where(rejected, residual / torch.where(total > 0, total, 1.0), target_row)  # [1, vocab]
    outcome = to_host(torch.cat([num_accepted, sample(next_probs, generator)]))  # the one transfer
    return int(outcome[0]), int(outcome[1])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on ``device`` (the model's: ``torch.multinomial`` needs the generator on
    the device of the probabilities it samples) seeded for reproducible sampling, or None for
    greedy/unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
