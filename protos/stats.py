"""``disco.stats.RequestStats`` <-> ``disco.v1.RequestStats``.

Kept apart from :mod:`protos.convert` so that the client library imports neither torch
nor transformers.
"""

from __future__ import annotations

from disco.stats import RequestStats
from protos.disco.v1 import orchestrator_pb2

_STATS_FIELDS = ("prompt_tokens", "generated_tokens", "iterations", "draft_tokens", "accepted_tokens",
                 "target_forwards", "draft_forwards", "prefill_s", "draft_s", "verify_s", "wall_s",
                 "finish_reason", "draft_fallbacks", "target_reprefills", "draft_reprefills", "backend_draft_s",
                 "backend_verify_s", "overlap_hits", "overlap_misses", "predrafted_used", "predrafted_wasted",
                 "draft_calls", "verify_forward_s")


def stats_to_pb(stats: RequestStats) -> orchestrator_pb2.RequestStats:
    return orchestrator_pb2.RequestStats(
        **{name: getattr(stats, name) for name in _STATS_FIELDS},
        lookaheads=stats.lookaheads, accepted_per_position=stats.accepted_per_position,
        acceptance_rate=stats.acceptance_rate, tokens_per_s=stats.tokens_per_s, mean_lookahead=stats.mean_lookahead,
        seed=stats.seed)


def stats_from_pb(message: orchestrator_pb2.RequestStats) -> RequestStats:
    return RequestStats(**{name: getattr(message, name) for name in _STATS_FIELDS},
                        lookaheads=list(message.lookaheads),
                        accepted_per_position=list(message.accepted_per_position),
                        seed=message.seed if message.HasField("seed") else None)
