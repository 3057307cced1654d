"""A draft LM head over a frequency-ranked subset of the vocabulary (FR-Spec, arXiv 2502.14856;
issue 50, item 3).

A quarter of the 0.5B draft's weights is its LM head (151,936 x 896): on a CPU, where a
draft token costs what reading its weights costs, the head is a quarter of every draft token.
The draft only proposes; the target verifies every token over the full vocabulary, so a draft
that proposes from the most frequent tokens only changes which tokens are *proposed*, never
the output: a token the target wants outside the subset is a rejection (greedy) or a
mismatch (drafter-invariant sampling), and the target's own token is taken, as for any wrong
guess.

:class:`VocabSubsetHead` replaces the draft's output embedding: one linear over the subset's
rows (the same weights: rows of the quantized head, so each kept logit has the full head's
bits where the kernel computes each output channel on its own, as the q4 x q8 kernel does),
scattered into a full-vocabulary row with ``-inf`` elsewhere. Every consumer of the draft's
logits then runs unchanged: the sampling controls and grammar masks (a ``-inf`` stays
``-inf``), the softmax (probability 0), the Gumbel-max draw (never picked), DISCO's signals
(over the subset's mass). Where a grammar or ``logit_bias`` leaves only tokens outside the
subset, every logit is ``-inf`` and the draft stops its block (the draft engine's check).

The subset (:func:`frequent_ids`): the special tokens, then the tokenizer's own frequency
ranking — a byte-level BPE vocabulary (Qwen2, Llama 3) numbers its tokens in merge order,
most frequent merges first — up to the size asked. ``docs/analysis/vocab_subset.py`` measures
how much of the training split's text each size covers (the size is chosen there, on the
training split).
"""

from __future__ import annotations

import torch
from torch import nn

from disco.models.int4 import Int4Linear
from disco.models.model_record import weights_changed
from disco.models.quantize import Int8Linear

class VocabSubsetHead(nn.Module):
    """The draft's LM head over ``ids`` only; logits ``[..., vocab]`` with ``-inf`` outside ``ids``.

    Args:
        head: a linear over the subset's rows (``out_features == len(ids)``), row ``i`` the
            weights of token ``ids[i]``.
        ids: the subset's token ids ``[subset]`` (ascending).
        vocab: the full vocabulary's size (the target's logits' width).
    """

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.head, self.vocab = head, vocab
        self.register_buffer("ids", ids)
        self.out_features = vocab  # what the engines read a head's width from

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        subset = self.head(hidden)  # [..., subset]
        logits = subset.new_full((*subset.shape[:-1], self.vocab), float("-inf"))
        logits[..., self.ids] = subset
        return logits

    def extra_repr(self) -> str:
        return f"subset={self.ids.numel()}, vocab={self.vocab}"


def frequent_ids(vocab: int, size: int, special_ids: list[int]) -> torch.Tensor:
    """``size`` token ids (ascending): ``special_ids`` (EOS and the other special tokens), then
    the lowest ids (a byte-level BPE vocabulary's merge order: most frequent first)."""
    if not 1 <= size <= vocab:
        raise ValueError(f"a vocabulary subset must hold 1 to {vocab} tokens, got {size}")
    chosen = {token for token in special_ids if 0 <= token < vocab}
    next_id = 0
    while len(chosen) < size:
        chosen.add(next_id)
        next_id += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def subset_rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear computing ``head``'s output channels ``ids`` only, on the same (quantized)
    weights. Int4 layers must still hold their groups (before a kernel repacks them:
    :meth:`disco.models.int4.Int4Linear.use_kernel` runs after, on the new layer too)."""
    bias = None if getattr(head, "bias", None) is None else head.bias[ids]
    if isinstance(head, Int4Linear):
        if head.centered.numel() == 0:
            raise ValueError("a vocabulary subset is taken before the int4 kernel is chosen (the head was repacked)")
        q = (head.centered[ids].to(torch.int16) + 8).to(torch.uint8)
        scales_and_zeros = head.scales_and_zeros[:, ids]  # [groups, subset, 2]
        return Int4Linear.from_groups(q, scales_and_zeros[:, :, 0].T, scales_and_zeros[:, :, 1].T, bias,
                                      head.compute_dtype)
    if isinstance(head, Int8Linear):
        layer = Int8Linear(head.in_features, len(ids), bias is not None, head.compute_dtype, head.weight.device)
        layer.weight, layer.scales = head.weight[ids].clone(), head.scales[ids].clone()
        if bias is not None:
            layer.bias = bias.clone()
        return layer
    if type(head) is nn.Linear:
        layer = nn.Linear(head.in_features, len(ids), bias is not None, device=head.weight.device,
                          dtype=head.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(head.weight[ids])
            if bias is not None:
                layer.bias.copy_(bias)
        return layer
    raise ValueError(f"no vocabulary subset for a head of type {type(head).__name__}")


def use_vocab_subset(model: nn.Module, size: int, special_ids: list[int]) -> str:
    """Give ``model`` (a draft) a :class:`VocabSubsetHead` of ``size`` tokens; returns a line for the log."""
    head = model.get_output_embeddings()
    vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
    ids = frequent_ids(vocab, size, special_ids).to(next(model.parameters()).device)
    model.set_output_embeddings(VocabSubsetHead(subset_rows(head, ids), ids, vocab))
    weights_changed(model)
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is no longer the input embedding
    return f"LM head over the {size} most frequent of {vocab} tokens (the target verifies all of them)"
