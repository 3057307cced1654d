"""The draft's free-running branches of an oracle record, and how a draft token is chosen.

Live, after the first rejected token of a block the draft keeps drafting on its OWN
divergent prefix. For every mismatch position ``p`` a record stores the draft's
continuation of ``prompt + cont[:p] + [draft[p]]`` for a few steps (see
:mod:`disco.offline.records`). Three ways compute the same branches: all of them as one
token tree per step over the trunk's KV cache (``tree``), one by one on a cropped copy of
that cache (``cached``), or from a fresh prefill each, as the live engine drafts
(``sequential``, the reference the tests compare with).

Every draft token is chosen by a :class:`TokenChooser`, exactly as
:meth:`disco.engines.draft.DraftEngine._choose` chooses it live: the argmax under greedy
decoding; under sampling the Gumbel-max sample of the warped distribution with the noise of
``(seed, absolute position)`` (drafter-invariant sampling, :mod:`disco.speculation.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disco.config import SamplingParams
from disco.engines.kv import CachedSequence
from disco.speculation.sampling import gumbel_sample, logits_to_probs
from disco.speculation.signals import TokenSignals, token_signals

BranchSteps = list[tuple[int, TokenSignals, "torch.Tensor | None"]]


@dataclass(frozen=True)
class TokenChooser:
    """The draft token at an absolute sequence position, from the draft's raw logits there."""

    sampling: SamplingParams  # seeded when not greedy

    def __post_init__(self) -> None:
        if not self.sampling.is_greedy and self.sampling.seed is None:
            raise ValueError("a sampled record needs a seed")

    def choose(self,
               logits: torch.Tensor,  # [vocab] raw draft logits
               position: int) -> int:  # absolute sequence position of the token
        if self.sampling.is_greedy:
            return int(logits.argmax())
        draft_probs = logits_to_probs(logits, self.sampling)  # [vocab]
        return int(gumbel_sample(draft_probs.unsqueeze(0), self.sampling.seed, [position])[0])


@torch.inference_mode()
def branches_tree(model: torch.nn.Module, trunk: CachedSequence, prompt_len: int, draft_tokens: list[int],
                  branches: dict[int, int], want_hidden: bool, chooser: TokenChooser) -> dict[int, BranchSteps]:
    """All branches, one draft forward per step: the step's tokens (one per live branch)
    are appended to the trunk's KV cache; a 4D mask lets each attend to the trunk up to
    its mismatch and to its own earlier branch tokens only."""
    out: dict[int, BranchSteps] = {p: [] for p in branches}
    slots: dict[int, list[int]] = {p: [] for p in branches}  # cache slots of each branch's tokens
    kv_len = trunk.cache_len
    device = trunk.device
    for step in range(max(branches.values(), default=0)):
        live = [p for p, n in branches.items() if step < n]
        inputs = [draft_tokens[p] if step == 0 else out[p][step - 1][0] for p in live]
        positions = [prompt_len + p + step for p in live]
        mask = torch.zeros((1, 1, len(live), kv_len + len(live)), dtype=torch.bool, device=device)
        for row, p in enumerate(live):
            mask[0, 0, row, :prompt_len + p] = True
            mask[0, 0, row, slots[p]] = True
            mask[0, 0, row, kv_len + row] = True
            slots[p].append(kv_len + row)
        output = model(input_ids=torch.tensor([inputs], device=device), attention_mask=mask,
                       position_ids=torch.tensor([positions], device=device), cache=trunk.cache, use_cache=True,
                       output_hidden_states=want_hidden)
        kv_len += len(live)
        logits = output.logits[0].float()  # [live, vocab]
        hidden = output.hidden_states[-1][0].float() if want_hidden else None
        for row, p in enumerate(live):
            token = chooser.choose(logits[row], positions[row] + 1)
            out[p].append((token, token_signals(logits[row], token), hidden[row].clone() if want_hidden else None))
    return out


@torch.inference_mode()
def branches_cached(model: torch.nn.Module, trunk: CachedSequence, prompt_len: int, draft_tokens: list[int],
                    branches: dict[int, int], want_hidden: bool, chooser: TokenChooser) -> dict[int, BranchSteps]:
    """Branch by branch, single-token forwards on a copy of the trunk's KV cache cropped
    to the mismatch (no prefix recomputation)."""
    out: dict[int, BranchSteps] = {}
    for p, n in sorted(branches.items()):
        sequence = trunk.fork(prompt_len + p)  # the trunk's cache copied up to the mismatch
        sequence.tokens.append(draft_tokens[p])
        out[p] = draft_freely(sequence, n, want_hidden, chooser)
    return out


@torch.inference_mode()
def branches_sequential(model: torch.nn.Module, prompt_ids: list[int], cont: list[int], draft_tokens: list[int],
                        branches: dict[int, int], want_hidden: bool, chooser: TokenChooser
                        ) -> dict[int, BranchSteps]:
    """Reference implementation: each branch drafted like the live draft engine does
    (fresh prefill, then single-token forwards). Slow; used by tests."""
    out: dict[int, BranchSteps] = {}
    for p, n in branches.items():
        sequence = CachedSequence(model, prompt_ids + cont[:p] + [draft_tokens[p]])
        sequence.prefill()
        out[p] = draft_freely(sequence, n, want_hidden, chooser)
    return out


def draft_freely(sequence: CachedSequence, steps: int, want_hidden: bool, chooser: TokenChooser) -> BranchSteps:
    """``steps`` single-token draft forwards from ``sequence``, each token chosen as the live
    engine chooses it (at absolute position ``len(sequence.tokens)``)."""
    out: BranchSteps = []
    for _ in range(steps):
        logits, hidden = sequence.forward(1, want_hidden=want_hidden)
        token = chooser.choose(logits[0], len(sequence.tokens))
        out.append((token, token_signals(logits[0], token), hidden[0] if hidden is not None else None))
        sequence.tokens.append(token)
    return out
