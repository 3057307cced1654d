"""What overlapped drafting would gain with the draft and the target on two devices.

With overlap, the draft keeps drafting while the target verifies a block, on the guess
that the whole block is accepted and that the target's bonus token is the draft's own
next token. This module predicts sequential and overlapped time from a replayed policy
(:mod:`disco.offline.replay`: per block the draft forwards, the drafted and the accepted tokens)
and a :class:`~disco.speculation.cost_model.CostModel` whose ``t_rtt`` is one call's round trip.

Model (two devices, so drafting during verification takes nothing from the target):

* sequential iteration ``i``: ``f_i * t_draft + t_verify(d_i) + 2 * t_rtt`` (as
  :meth:`CostModel.iteration`: a Draft call, then a Verify call);
* after block ``i`` is handed out, the draft has ``W_i = t_verify(d_i) + 2 * t_rtt`` until
  the next Draft call brings the verdict (block to the target, verdict back, next call to
  the draft). It spends one forward on the guessed bonus token and drafts
  ``floor(W_i / t_draft) - 1`` more;
* **hit** when block ``i`` was accepted in full *and* the draft's own next token equals the
  target's token there (read from the record: the draft's teacher-forced token at the
  bonus position). Then the first ``min(d_{i+1}, pre-drafted)`` tokens of block ``i+1`` are
  ready and cost nothing on the critical path; the rest is drafted as usual;
* **miss**: the pre-drafted tokens are discarded; the draft first finishes the forward in
  flight, on average half a draft forward added to the critical path.

Block lengths are the replayed policy's, as if the stop policy decided the same way over
pre-drafted tokens (it runs on them too). Greedy records only; sampling is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from disco.offline.records import OracleRecord, RecordSet
from disco.offline.replay import RecordReplay, replay_policy
from disco.speculation.cost_model import CostModel
from disco.speculation.policies.auto import with_costs

#: On a miss the draft finishes the forward in flight: half a draft forward on average.
MISS_PENALTY_FORWARDS = 0.5


@dataclass(frozen=True)
class OverlapEstimate:
    """Predicted seconds of one replayed policy, sequential and overlapped."""

    sequential_s: float
    overlapped_s: float
    hits: int  # iterations whose pre-drafted tokens were used
    iterations: int
    free_tokens: int  # draft tokens taken off the critical path

    @property
    def speedup(self) -> float:
        """Overlapped over sequential tokens/s (the same tokens either way)."""
        return self.sequential_s / self.overlapped_s if self.overlapped_s else 1.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.iterations if self.iterations else 0.0


def estimate_record(record: OracleRecord, replayed: RecordReplay, cost: CostModel) -> OverlapEstimate:
    """Sequential vs overlapped seconds of one record replayed under one policy."""
    matches = record.matches  # [M] bool: the draft's teacher-forced token is the target's
    blocks = replayed.blocks  # (draft forwards, drafted, accepted) per iteration
    sequential = sum(cost.iteration(forwards, drafted, replayed.uses_draft) for forwards, drafted, _ in blocks)
    overlapped, hits, free_total, generated, ready = 0.0, 0, 0, 0, 0
    for forwards, drafted, accepted in blocks:
        free = min(drafted, ready)
        seconds = cost.iteration(forwards, drafted, replayed.uses_draft) - free * cost.t_draft
        if ready == 0 and generated > 0 and forwards > 0 and replayed.uses_draft:
            seconds += MISS_PENALTY_FORWARDS * cost.t_draft  # a discarded pre-draft was in flight
        overlapped += seconds
        hits += 1 if free > 0 else 0
        free_total += free
        bonus_index = generated + accepted  # continuation index of the bonus token
        full = drafted > 0 and accepted == drafted
        hit = full and bonus_index < len(matches) and bool(matches[bonus_index])
        ready = cost.predrafted(drafted) if hit else 0
        generated += accepted + 1
    return OverlapEstimate(sequential_s=sequential, overlapped_s=overlapped, hits=hits, iterations=len(blocks),
                           free_tokens=free_total)


def estimate(records: Sequence[OracleRecord], replayed: Iterable[RecordReplay], cost: CostModel) -> OverlapEstimate:
    """:func:`estimate_record` summed over a record set (``replayed`` in the same order)."""
    parts = [estimate_record(record, replay, cost) for record, replay in zip(records, replayed)]
    return OverlapEstimate(sequential_s=sum(p.sequential_s for p in parts),
                           overlapped_s=sum(p.overlapped_s for p in parts),
                           hits=sum(p.hits for p in parts), iterations=sum(p.iterations for p in parts),
                           free_tokens=sum(p.free_tokens for p in parts))


def estimate_policy(records: RecordSet, spec: str, cost: CostModel, max_lookahead: int,
                    honor_eos: bool = True) -> tuple[OverlapEstimate, int]:
    """(estimate, generated tokens) of one policy spec replayed under ``cost``, whose
    ``t_rtt`` the policy is told too (as the orchestrator measures it live)."""
    replayed = replay_policy(records, with_costs(spec, cost), max_lookahead, honor_eos, name=spec)
    return estimate(records.records, replayed.records, cost), replayed.totals()["generated_tokens"]
