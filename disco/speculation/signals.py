"""Per-token signals of the draft model that stop policies read.

Computed once per draft token from the draft's raw next-token logits (softmax at
temperature 1, independent of the request's sampling settings, so that a trained
stop policy sees the same features under greedy and sampled decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K_SIGNALS = 10


@dataclass(frozen=True)
class TokenSignals:
    """What the draft model "thought" when it proposed one token."""

    topk_probs: tuple[float, ...]  # TOP_K_SIGNALS largest probabilities, descending
    entropy: float  # nats
    token_prob: float  # raw probability of the drafted token
    hidden: torch.Tensor | None = None  # [hidden_size] last hidden state, when a policy asks

    @property
    def top1_prob(self) -> float:
        return self.topk_probs[0]


def token_signals(
    logits: torch.Tensor,  # [vocab] raw draft logits at one position
    token_id: int,
    hidden: torch.Tensor | None = None,  # [hidden_size]
) -> TokenSignals:
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    entropy = float(-(probs * log_probs).nan_to_num().sum())
    topk = torch.topk(probs, TOP_K_SIGNALS).values
    return TokenSignals(
        topk_probs=tuple(float(v) for v in topk),
        entropy=entropy,
        token_prob=float(probs[token_id]),
        hidden=hidden,
    )
