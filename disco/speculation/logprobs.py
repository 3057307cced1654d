"""The target's log-probabilities, as OpenAI's and vLLM's ``logprobs`` return them.

The values are *raw* (vLLM's default ``logprobs_mode="raw_logprobs"``): the log_softmax of the
target's logits at a position, before temperature, top-k, top-p and every other sampling
control. Speculation changes nothing in them: an emitted token's entry is the verification
forward's row of its position (accepted tokens, then the recovered or bonus token), which is
the row target-only decoding computes there — the same bits where the engine proves its
verification exact (docs/exactness.md), else equal to rounding. A prompt token's entry is the
prefill's row of the position before it (the first prompt token has none).

They cost nothing unless asked: the engines call these functions only for a session whose
``SamplingParams.logprobs`` / ``prompt_logprobs`` is set, and read the results back to the host
in one transfer per call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from disco.interfaces import TokenLogprobs

#: The prompt's logits are computed this many float32 values at a time (64 MiB): a long prompt
#: over a large vocabulary would otherwise need prompt tokens x vocab x 4 bytes at once.
PROMPT_LOGITS_FLOATS = 1 << 24


def raw_logprobs(target_logits: torch.Tensor) -> torch.Tensor:  # target_logits: [rows, vocab]
    """The target's raw log-probabilities ``[rows, vocab]`` (float32) from its logits: a new
    tensor, so later processing of the logits (controls, temperature) leaves them as they were."""
    return torch.log_softmax(target_logits.float(), dim=-1)


def select_logprobs(target_logprobs: torch.Tensor,  # [rows, vocab]
                    token_ids: Sequence[int], top_n: int) -> list[TokenLogprobs]:
    """Row ``i``'s entry for ``token_ids[i]``, the token at that row's position: its logprob and
    rank, and the row's ``top_n`` most likely tokens (most likely first; equal values in the
    order ``torch.topk`` gives, the same for the same bits)."""
    rows = len(token_ids)
    assert target_logprobs.shape[0] == rows, (target_logprobs.shape, rows)
    if not rows:
        return []
    ids = torch.tensor(token_ids, dtype=torch.long, device=target_logprobs.device).unsqueeze(1)  # [rows, 1]
    target_logprobs_of_tokens = target_logprobs.gather(1, ids)  # [rows, 1]
    ranks = (target_logprobs > target_logprobs_of_tokens).sum(dim=1, keepdim=True) + 1  # [rows, 1]
    top_logprobs, top_ids = target_logprobs.topk(top_n, dim=-1)  # each [rows, top_n]
    # One transfer to the host: float64 carries the float32 values and the ids exactly.
    table = torch.cat([target_logprobs_of_tokens.double(), ranks.double(), top_logprobs.double(),
                       top_ids.double()], dim=1).tolist()  # [rows, 2 + 2 * top_n]
    return [TokenLogprobs(logprob=row[0], rank=int(row[1]), top_token_ids=tuple(int(t) for t in row[2 + top_n:]),
                          top_logprobs=tuple(row[2: 2 + top_n])) for row in table]


@torch.inference_mode()
def prompt_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor,  # hidden: [n - 1, hidden_size]
                    prompt_ids: Sequence[int], top_n: int, vocab_size: int,
                    max_floats: int = PROMPT_LOGITS_FLOATS) -> list[TokenLogprobs]:
    """The entries of prompt tokens ``1 .. n-1`` from the prefill's last hidden states of
    positions ``0 .. n-2`` (:meth:`disco.engines.kv.CachedSequence.prefill_hidden`): the LM head
    over at most ``max_floats / vocab_size`` rows at a time, each chunk's logits freed before
    the next."""
    assert hidden.shape[0] == len(prompt_ids) - 1, (hidden.shape, len(prompt_ids))
    rows = max(1, max_floats // max(1, vocab_size))
    entries: list[TokenLogprobs] = []
    for start in range(0, hidden.shape[0], rows):
        chunk = hidden[start: start + rows]  # [rows, hidden_size]
        target_logprobs = raw_logprobs(lm_head(chunk))  # [rows, vocab]
        entries.extend(select_logprobs(target_logprobs, prompt_ids[start + 1: start + 1 + chunk.shape[0]], top_n))
    return entries
