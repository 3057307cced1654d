"""Per-request statistics, collected by the speculation loop."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    """What one generation cost and how well speculation worked.

    ``target_forwards`` counts verification forwards (one per iteration); prefill
    forwards are reported as ``prefill_s``. ``draft_forwards`` counts draft-model
    forwards, one per drafted token (plus an oracle-discarded one).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    iterations: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    lookaheads: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    finish_reason: str = ""
    draft_fallbacks: int = 0  # times the draft service failed and the request went on target-only
    target_reprefills: int = 0  # times the target session was re-created from the committed tokens
    draft_reprefills: int = 0  # draft session re-created: a failed replica's on another, or after blocks skipped under load
    # Of draft_s / verify_s: the time the drafter / verifier itself reported (server-side
    # timings over gRPC); the rest is what the transport and the loop added.
    backend_draft_s: float = 0.0
    backend_verify_s: float = 0.0
    # Draft calls made (an iteration that drafted makes one) and, of verify_s, the seconds the
    # target reported spending in its verification forwards: with draft_forwards they give what
    # each call costs beyond the model forwards (orchestrator.call_overhead).
    draft_calls: int = 0
    verify_forward_s: float = 0.0
    # Overlapped drafting (a drafter with overlap on): Draft calls whose block was pre-drafted
    # on a right / wrong guess, and the pre-drafted tokens streamed / thrown away.
    overlap_hits: int = 0
    overlap_misses: int = 0
    predrafted_used: int = 0
    predrafted_wasted: int = 0
    # The seed the request was sampled with (its own, or a random one when it gave none): sent
    # back, it reproduces the output whatever the policy, lookahead, load and transport. None
    # under greedy decoding.
    seed: int | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def transport_s(self) -> float:
        """Time of the Draft and Verify calls that the backends did not account for."""
        return self.draft_s + self.verify_s - self.backend_draft_s - self.backend_verify_s

    @property
    def mean_lookahead(self) -> float:
        return sum(self.lookaheads) / len(self.lookaheads) if self.lookaheads else 0.0

    def record_iteration(self, lookahead: int, num_accepted: int) -> None:
        self.iterations += 1
        self.target_forwards += 1
        self.draft_tokens += lookahead
        self.accepted_tokens += num_accepted
        self.lookaheads.append(lookahead)
        if len(self.accepted_per_position) < lookahead:
            self.accepted_per_position.extend([0] * (lookahead - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def to_dict(self) -> dict:
        data = asdict(self)
        data["acceptance_rate"] = round(self.acceptance_rate, 6)
        data["tokens_per_s"] = round(self.tokens_per_s, 4)
        data["mean_lookahead"] = round(self.mean_lookahead, 4)
        for key in ("prefill_s", "draft_s", "verify_s", "wall_s", "backend_draft_s", "backend_verify_s",
                    "verify_forward_s"):
            data[key] = round(data[key], 6)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "RequestStats":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in names})

    def summary_line(self) -> str:
        return (f"{self.generated_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.2f} tok/s) | "
                f"iterations {self.iterations}, acceptance {self.acceptance_rate:.1%}, "
                f"mean lookahead {self.mean_lookahead:.2f}, target forwards {self.target_forwards}, "
                f"draft forwards {self.draft_forwards} | draft {self.draft_s:.2f} s, verify {self.verify_s:.2f} s"
                + (f" | seed {self.seed}" if self.seed is not None else ""))
