"""The stop-policy interface: one object per session, asked after every draft token.

The drafting loop (inside the draft engine) does, per block::

    budget = block_budget(policy, max_lookahead, room_in_context)
    for position in range(budget):
        token = draft one token
        decision = policy.after_token(position, token, signals)
        ...  # CONTINUE, STOP (keep the token), DISCARD (drop it, then stop)

and after the target verified the block, ``policy.observe_verification(num_drafted,
num_accepted)`` and ``policy.on_feedback(num_drafted, num_accepted)`` let stateful policies (heuristic schedule, adaptive threshold, DISCO's
session features) learn from the outcome.
"""

from __future__ import annotations

import enum

from disco.speculation.signals import TokenSignals


class Decision(enum.Enum):
    CONTINUE = "continue"
    STOP = "stop"  # keep this token, draft no more in this block
    DISCARD = "discard"  # drop this token and stop (oracle only)


class StopPolicy:
    """Base class: drafts up to the lookahead cap and never stops early."""

    #: False only for ``none``: the loop then never calls the drafter.
    uses_draft: bool = True
    #: True if ``after_token`` needs :class:`TokenSignals` (cheap, but not free).
    needs_signals: bool = False
    #: True if the signals must carry the draft's last hidden state.
    needs_hidden: bool = False

    def begin_block(self, max_lookahead: int) -> int:
        """Lookahead budget of the next block (the loop also caps it)."""
        return max_lookahead

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        """Called after each draft token; ``position`` is 0-based within the block."""
        return Decision.CONTINUE

    def bind_sampling(self, temperature: float) -> None:
        """The request's sampling temperature (0 when greedy), told once before the first
        block: a learned policy's features read it (``draw`` group); others ignore it."""

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` of the ``num_drafted`` tokens."""

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        """The verdict on the block this policy drafted, as the target gave it (called once
        per verified block with the real feedback, never with a pre-drafting guess; unlike
        :meth:`on_feedback`, which a pre-draft's copy also receives with its guess). For
        what outlives the session: ``auto``'s deployment-wide acceptance calibration."""


def block_budget(policy: StopPolicy, max_lookahead: int, room: int | None = None) -> int:
    """Draft tokens the next block may have: the policy's budget within the lookahead cap
    and the ``room`` left in the model's context (the one rule of every drafting loop:
    live, pre-drafting and replay). Calls ``policy.begin_block``."""
    budget = min(max_lookahead, policy.begin_block(max_lookahead))
    return max(0, budget if room is None else min(budget, room))
