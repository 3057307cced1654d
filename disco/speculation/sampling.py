"""Verification math as small pure functions over tensors (gpt-fast style).

Exactness contract:

* Greedy (:func:`greedy_accept`): a draft token is accepted iff it equals the target's
  argmax at its position; the bonus token is the target's argmax after the accepted
  prefix. The output therefore equals target-only greedy decoding token for token.
* Sampling, the rule the engines use (:func:`invariant_verify`): drafter-invariant
  speculative sampling, Daliri, Musco & Suresh 2024 ("Coupling without Communication and
  Drafter-Invariant Speculative Decoding", arXiv 2408.07978). The token at absolute
  sequence position ``i`` is the Gumbel-max sample ``argmax_v probs[v] / E(seed, i, v)``
  (:func:`gumbel_argmax`: ``E = exp(-G)`` with ``G`` standard Gumbel, i.e. ``E ~ Exp(1)``,
  the exponential-race form of ``argmax_v log probs[v] + G``), where the noise ``E`` is a
  deterministic function of ``(seed, i, v)`` alone (:func:`gumbel_noise`). The draft
  proposes with the same noise on its own distribution; a draft token is accepted iff it
  equals the target's sample at its position, and the token after the accepted prefix is
  the target's own sample there. Every emitted token is therefore exactly a sample of the
  (warped) target distribution, and *which* token is a function of the target's
  distributions and the seed only: target-only decoding and every policy, lookahead,
  batch, transport and re-prefill give the same text for a seed (on logits of the same
  bits). A draft token is accepted with probability at least ``(1 - TV) / (1 + TV)`` of
  the two distributions (the paper's Theorem; rejection sampling reaches ``1 - TV``).
* Sampling, the rule of Leviathan et al. 2023 ("Fast Inference from Transformers via
  Speculative Decoding", Alg. 1) / Chen et al. 2023 (:func:`rejection_sample`, kept for
  comparison and its tests; no engine uses it): accept draft token ``x`` with probability
  ``min(1, target_probs[x] / draft_probs[x])``; on the first rejection draw the recovered
  token from ``norm(max(0, target_probs - draft_probs))``; if all are accepted sample the
  bonus token from the next target distribution. Every emitted token is distributed
  exactly as ``target_probs``, but which one depends on the draft.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from disco.config import SamplingParams
from disco.speculation.logits_processors import apply_min_p


def logits_to_probs(
    logits: torch.Tensor,  # [..., vocab]
    sampling: SamplingParams,
) -> torch.Tensor:  # [..., vocab] float32, rows sum to 1
    """Temperature, then min-p, then top-k, then top-p (nucleus) warping, in vLLM v1's order
    (the history-dependent controls come first: :mod:`disco.speculation.logits_processors`).

    Greedy requests (temperature 0) get the plain softmax; callers take its argmax.
    """
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.min_p > 0:
        logits = apply_min_p(logits, sampling.min_p)
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


def accept_prefix(
    draft_token_ids: Sequence[int],  # k draft tokens
    target_token_ids: torch.Tensor,  # [k + 1] the target's own token at each position of the block and after it
) -> tuple[int, int]:
    """Returns ``(num_accepted, next_token_id)``: the longest prefix of the block equal to the
    target's tokens, and the target's token after it (one transfer: the k + 1 tokens). Greedy
    and drafter-invariant verification are both this rule; they differ in the target's tokens."""
    target_tokens = to_host(target_token_ids).tolist()  # k + 1 ints
    num_accepted = 0
    for draft_token, target_token in zip(draft_token_ids, target_tokens):
        if draft_token != target_token:
            break
        num_accepted += 1
    return num_accepted, int(target_tokens[num_accepted])


def greedy_accept(
    draft_token_ids: Sequence[int],  # k draft tokens
    target_logits: torch.Tensor,  # [k + 1, vocab]
) -> tuple[int, int]:
    """Returns ``(num_accepted, next_token_id)`` under greedy decoding (one transfer: the
    k + 1 argmaxes)."""
    return accept_prefix(draft_token_ids, target_logits.argmax(dim=-1))


# -- drafter-invariant sampling: Gumbel-max with noise keyed by (seed, position) ------------

_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1
#: lowbias32's multipliers (C. Wellons, "hash-prospector"): both below 2**31, so a 32-bit
#: value times either fits an int64 exactly: no overflow on any device.
_MIX1, _MIX2 = 0x21F0AAAD, 0x735A2D97
#: Bits of the uniform variate: ``(j + 0.5) / 2**23`` for a 23-bit ``j`` is exact in float32.
UNIFORM_BITS = 23


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _M64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of the noise at one absolute sequence position (splitmix64, twice)."""
    return _splitmix64(_splitmix64(seed) ^ position)


def _mix32_(values: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place, on int64 values in ``[0, 2**32)`` (they stay there)."""
    values.bitwise_xor_(values >> 16).mul_(_MIX1).bitwise_and_(_M32)
    values.bitwise_xor_(values >> 15).mul_(_MIX2).bitwise_and_(_M32)
    return values.bitwise_xor_(values >> 15)


def exponential_noise(
    seed: int,
    positions: Sequence[int],  # k absolute sequence positions
    token_ids: torch.Tensor,  # [n] int64 vocabulary indices, on the device the noise is wanted on
) -> torch.Tensor:  # [k, n] float32, Exp(1) variates: E(seed, positions[r], token_ids[c])
    """The noise of :func:`gumbel_argmax` at the given positions and vocabulary entries.

    Each value is a function of ``(seed, position, token id)`` alone, bit for bit on every
    device and whatever else is computed with it (the batch, the other entries, the vocabulary
    size): a counter-based hash — two rounds of lowbias32 over the token id, keyed by the 64
    bits of :func:`noise_key` — gives a 23-bit uniform ``U = (j + 0.5) / 2**23`` in (0, 1) (the
    resolution of ``torch.rand``), and ``E = -log(U)``. Integer operations are exact
    everywhere; torch's float32 ``log`` gives the same bits in its vectorized and scalar
    paths over all 2**23 values of ``U`` on the CPU (tests/test_invariant_sampling.py checks it
    on the machine that runs the tests). A CUDA ``log`` may round another way than a CPU's:
    noise, like logits, is the same bits on engines of the same device type.

    NOTE: chosen over a ``torch.Generator`` seeded per position: 1.5 ms against 3.8 ms per
    position for a 151,936-entry vocabulary on a 2-core AMD EPYC (docs/exactness.md), and a
    generator's stream differs between the CPU (mt19937) and CUDA (Philox) and with the
    tensor's size, where the hash depends on nothing but its inputs.
    """
    keys = [noise_key(seed, position) for position in positions]
    device = token_ids.device
    low = torch.tensor([key & _M32 for key in keys], dtype=torch.int64, device=device).unsqueeze(1)  # [k, 1]
    high = torch.tensor([key >> 32 for key in keys], dtype=torch.int64, device=device).unsqueeze(1)  # [k, 1]
    mixed = _mix32_(_mix32_(token_ids.long().unsqueeze(0) ^ low).bitwise_xor_(high))  # [k, n] in [0, 2**32)
    uniform = ((mixed >> (32 - UNIFORM_BITS)).float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))  # [k, n] in (0, 1)
    return uniform.log_().neg_()


def gumbel_noise(
    seed: int,
    positions: Sequence[int],  # k absolute sequence positions
    vocab: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [k, vocab] float32
    """:func:`exponential_noise` over the whole vocabulary."""
    return exponential_noise(seed, positions, torch.arange(vocab, device=device))


def gumbel_argmax(
    probs: torch.Tensor,  # [..., vocab] warped distributions
    noise: torch.Tensor,  # [..., vocab] Exp(1) variates (gumbel_noise)
) -> torch.Tensor:  # [...] long
    """``argmax_v probs[v] / noise[v]``, i.e. ``argmax_v log probs[v] + G[v]`` with the Gumbel
    variates ``G = -log(noise)``: a sample of ``probs`` (Gumbel-max), without a log of the
    probabilities (zeros, from top-k / top-p, never win). Ties go to the lowest index."""
    return (probs.float() / noise).argmax(dim=-1)


def gumbel_sample(
    probs: torch.Tensor,  # [k, vocab] warped distributions, row r at absolute position positions[r]
    seed: int,
    positions: Sequence[int],  # k absolute sequence positions
) -> torch.Tensor:  # [k] long, on the device of probs (nothing read back)
    """``gumbel_argmax(probs, gumbel_noise(seed, positions, vocab))``: the seeded sample at
    each position.

    On a CPU the noise is computed on each row's support only (the nonzero probabilities:
    after top-k / top-p typically a few hundred of 151,936 entries): the same values, since
    each entry's noise depends on nothing else, the same argmax (ties go to the lowest index
    both ways), for a fraction of the cost. On a GPU finding the support would read its size
    back (a sync), so the whole vocabulary is hashed there.
    """
    if probs.device.type != "cpu":
        return gumbel_argmax(probs, gumbel_noise(seed, positions, probs.shape[-1], probs.device))
    samples = []
    for row, position in zip(probs, positions):
        support = row.nonzero().squeeze(1)  # [n] ascending token ids with probability > 0
        noise = exponential_noise(seed, [position], support)[0]  # [n]
        if len(support) == len(row):  # no zero (temperature only): support is arange(vocab)
            samples.append(gumbel_argmax(row, noise))
        else:
            samples.append(support[gumbel_argmax(row[support], noise)])
    return torch.stack(samples) if samples else torch.empty(0, dtype=torch.long)


def invariant_verify(
    draft_token_ids: Sequence[int],  # k draft tokens, at positions first_position .. first_position + k - 1
    target_probs: torch.Tensor,  # [k + 1, vocab] warped target distributions at those positions and the next
    seed: int,
    first_position: int,  # absolute sequence position of the first draft token (the committed length)
) -> tuple[int, int]:
    """Returns ``(num_accepted, next_token_id)`` under drafter-invariant speculative sampling
    (see the module docstring): the target's Gumbel sample at each position of the block and
    after it, the longest prefix of the block equal to them, and the target's sample after
    it. Needs no draft distribution. One transfer (the k + 1 samples)."""
    positions = range(first_position, first_position + len(draft_token_ids) + 1)
    return accept_prefix(draft_token_ids, gumbel_sample(target_probs, seed, positions))


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
