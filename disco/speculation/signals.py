"""Per-token signals of the draft model that stop policies read.

Computed once per draft token from the draft's raw next-token logits (softmax at
temperature 1, independent of the request's sampling settings, so that a trained
stop policy sees the same features under greedy and sampled decoding).

On a GPU every value read back to the host is a sync, so the drafting loop computes the
signals as one device tensor (:func:`signal_values`), moves it to the host together with
the token and its probability (one transfer per draft token), and builds the
:class:`TokenSignals` there (:func:`signals_from_values`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

TOP_K_SIGNALS = 10
#: Length of :func:`signal_values`: the top-k probabilities, the entropy, the token's probability.
NUM_SIGNAL_VALUES = TOP_K_SIGNALS + 2


@dataclass(frozen=True)
class TokenSignals:
    """What the draft model "thought" when it proposed one token."""

    topk_probs: tuple[float, ...]  # TOP_K_SIGNALS largest probabilities, descending
    entropy: float  # nats
    token_prob: float  # raw probability of the drafted token
    # [hidden_size] last hidden state, when a policy asks: a tensor, or on the host already (numpy)
    hidden: torch.Tensor | np.ndarray | None = None

    @property
    def top1_prob(self) -> float:
        return self.topk_probs[0]


def signal_values(
    logits: torch.Tensor,  # [vocab] raw draft logits at one position
    token: torch.Tensor | int,  # the drafted token: a device scalar (no sync) or an int
) -> torch.Tensor:  # [NUM_SIGNAL_VALUES] float32 on the device of logits
    """The signals as one device tensor: top-k probabilities (descending), entropy (nats),
    the token's probability. No value leaves the device."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).nan_to_num().sum()
    topk = torch.topk(probs, TOP_K_SIGNALS).values
    index = torch.as_tensor(token, device=probs.device).reshape(1)
    return torch.cat([topk, entropy.reshape(1), probs.index_select(0, index)])


def signals_from_values(
    values: Sequence[float],  # [NUM_SIGNAL_VALUES] on the host, as signal_values lays them out
    hidden: torch.Tensor | np.ndarray | None = None,  # [hidden_size]
) -> TokenSignals:
    return TokenSignals(topk_probs=tuple(float(v) for v in values[:TOP_K_SIGNALS]),
                        entropy=float(values[TOP_K_SIGNALS]), token_prob=float(values[TOP_K_SIGNALS + 1]),
                        hidden=hidden)


def token_signals(
    logits: torch.Tensor,  # [vocab] raw draft logits at one position
    token_id: int,
    hidden: torch.Tensor | None = None,  # [hidden_size]
) -> TokenSignals:
    """:func:`signal_values` read back at once (offline use: records and replay)."""
    return signals_from_values(signal_values(logits, token_id).detach().cpu().tolist(), hidden)
