"""The two roles the speculation loop talks to, and the messages between them.

Vocabulary (as in vLLM's spec-decode docs):

* **draft tokens** — proposed by the draft model, one block per iteration; the block
  length is the iteration's **lookahead**.
* **accepted tokens** — the longest prefix of the block the target agrees with: equal to
  the target's own token at each position (greedy: its argmax; sampling: its Gumbel-max
  sample under the noise of ``(seed, position)``, the noise the draft proposed with —
  drafter-invariant speculative sampling, :mod:`disco.speculation.sampling`).
* **rejected token** — the first draft token of the block the target does not keep.
* **recovered token** — the token the target puts in its place: its own token at that
  position (greedy: the argmax; sampling: its seeded sample), what target-only decoding
  gives there.
* **bonus token** — when every draft token was accepted, the free extra token from the
  last target distribution.
* **next token** (``next_token_id``) — the one token the target appends after the accepted
  prefix: the recovered token or the bonus token. (The wire contract calls it
  ``bonus_token_id``, a name kept for compatibility.)

The loop sees only :class:`Drafter` and :class:`Verifier`; the in-process engines and the
gRPC clients both implement them and must produce the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, Union

import torch

from disco.config import SamplingParams


@dataclass(frozen=True)
class Feedback:
    """Outcome of the previous verification, sent with the next ``Draft`` call so that
    rolling back the draft KV cache and drafting the next block are one round trip."""

    num_accepted: int
    next_token_id: int


@dataclass(frozen=True)
class DraftToken:
    """One draft token as the drafter streams it."""

    token_id: int
    draft_prob: float  # probability the (warped) draft distribution gave this token
    draft_probs: torch.Tensor | None = None  # [vocab]; legacy (rejection sampling), never set now


@dataclass(frozen=True)
class DraftSummary:
    """Ends every draft stream: how the block was made and why drafting stopped."""

    forwards: int  # draft-model forward passes spent on this block (incl. a discarded token and,
    #                with overlap, every background pre-draft forward this call consumed, used or not)
    elapsed_ns: int  # server-side time spent drafting this block (background pre-drafting excluded)
    stop_reason: str  # "policy", "lookahead_cap" or "discarded" (oracle)
    # Overlapped drafting (disco.engines.predraft): the block was pre-drafted during the last verification.
    predrafted_used: int = 0  # pre-drafted tokens streamed in this block (an overlap hit)
    predrafted_wasted: int = 0  # pre-drafted tokens discarded at this call (a miss, or past the cap)
    overlap_hit: bool = False  # the guess (whole block accepted, bonus = draft's choice) was right
    overlap_miss: bool = False  # a guess was made (or pre-drafting failed) and it was wrong


DraftEvent = Union[DraftToken, DraftSummary]


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities at one position: of the token there (an emitted or a
    prompt token) and of the position's most likely tokens. Raw: the log_softmax of the
    target's logits, before temperature, top-k, top-p and every other control (vLLM's default
    ``raw_logprobs``), :mod:`disco.speculation.logprobs`."""

    logprob: float  # of the position's token
    rank: int  # of the position's token among all tokens, 1: the most likely
    top_token_ids: tuple[int, ...] = ()  # the most likely tokens, most likely first (as many as asked)
    top_logprobs: tuple[float, ...] = ()  # their log-probabilities, in the same order


@dataclass(frozen=True)
class PrefillResult:
    prompt_tokens: int
    elapsed_ns: int
    # Asked with SamplingParams.prompt_logprobs: one per prompt token after the first (the first
    # has none: nothing precedes it), in order; else empty.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    """The target's verdict on one block."""

    num_accepted: int
    next_token_id: int
    forward_ns: int  # time in the target forward pass
    elapsed_ns: int  # total server-side time of the call
    # Asked with SamplingParams.logprobs: one per emitted token (the accepted ones, then the next
    # token: num_accepted + 1), each from the verification forward's row of its position; else empty.
    logprobs: tuple[TokenLogprobs, ...] = ()


class Drafter(Protocol):
    """Proposes draft tokens; owns the draft KV cache and the per-session stop policy."""

    def start_session(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        policy_spec: str,
        reference_ids: Sequence[int] | None = None,
        overlap: bool | None = None,
    ) -> PrefillResult:
        """Create a session and prefill the prompt. ``reference_ids`` is the target's
        own greedy continuation; only the analysis-only ``oracle`` policy uses it.
        ``overlap``: pre-draft this session's next blocks during verification (``None``:
        the drafter's own setting)."""
        ...

    def draft(
        self, session_id: str, feedback: Feedback | None, max_lookahead: int
    ) -> Iterator[DraftEvent]:
        """Apply ``feedback`` (roll back to the accepted prefix, append the bonus token),
        then draft up to ``max_lookahead`` tokens, asking the stop policy after each one.
        Yields the tokens as they are produced, then exactly one :class:`DraftSummary`."""
        ...

    def end_session(self, session_id: str) -> None: ...


class Verifier(Protocol):
    """Verifies draft blocks with the target model; owns the target KV cache."""

    def start_session(
        self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> PrefillResult: ...

    def verify(
        self,
        session_id: str,
        draft_token_ids: Sequence[int],
        draft_probs: torch.Tensor | None,  # [k, vocab]; legacy, not read: sampled blocks are verified by token ids
    ) -> VerifyResult:
        """One target forward over the block: accept the longest valid prefix, roll the KV
        cache back to it, return the accepted count and the bonus token. An empty block
        is a plain target-only decoding step."""
        ...

    def end_session(self, session_id: str) -> None: ...
