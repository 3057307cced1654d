"""The orchestrator's metrics: the per-server ones plus speculative decoding and request
metrics, named like vLLM's (``vllm:spec_decode_num_draft_tokens_total`` ->
``disco_spec_decode_num_draft_tokens_total``, ``vllm:e2e_request_latency_seconds`` ->
``disco_e2e_request_latency_seconds``, ...). They are fed from each request's
:class:`~disco.stats.RequestStats` when it finishes; docs/operations.md lists them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

from prometheus_client import Counter, Gauge, Histogram

from disco.config import MAX_LOOKAHEAD_LIMIT
from disco.speculation.loop import GenerationEvent, GenerationResult, TokenChunk
from disco.stats import RequestStats
from protos.runtime.metrics import ServerMetrics

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
LOOKAHEAD_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, MAX_LOOKAHEAD_LIMIT)


class OrchestratorMetrics(ServerMetrics):
    """:class:`~protos.runtime.metrics.ServerMetrics` plus what the speculation loop measures."""

    def __init__(self, model: str = "") -> None:
        super().__init__("orchestrator", model)
        r = self.registry
        self.num_drafts = Counter("disco_spec_decode_num_drafts",
                                  "Iterations that drafted at least one token", registry=r)
        self.num_draft_tokens = Counter("disco_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("disco_spec_decode_num_accepted_tokens",
                                           "Draft tokens the target accepted", registry=r)
        self.accepted_per_pos = Counter("disco_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the block (0 = first)",
                                        ["position"], registry=r)
        self.acceptance_rate = Gauge("disco_spec_decode_draft_acceptance_rate",
                                     "Accepted / proposed draft tokens since start", registry=r)
        self.lookahead = Histogram("disco_spec_decode_lookahead",
                                   "Draft tokens per iteration (0: a target-only step)",
                                   buckets=LOOKAHEAD_BUCKETS, registry=r)
        self.draft_forwards = Counter("disco_spec_decode_num_draft_forwards", "Draft-model forward passes",
                                      registry=r)
        self.target_forwards = Counter("disco_spec_decode_num_target_forwards",
                                       "Target verification forward passes (prefill excluded)", registry=r)
        self.draft_fallbacks = Counter("disco_spec_decode_draft_fallbacks",
                                       "Requests that went on target-only because the draft service failed",
                                       registry=r)
        self.target_reprefills = Counter("disco_spec_decode_target_reprefills",
                                         "Target sessions re-created from the orchestrator's tokens", registry=r)
        self.draft_reprefills = Counter("disco_spec_decode_draft_reprefills",
                                        "Draft sessions re-created on another replica after a failure", registry=r)
        self.overlap_hits = Counter("disco_spec_decode_overlap_hits",
                                    "Draft calls whose block had been pre-drafted on a right guess (a draft "
                                    "service with overlapped drafting)", registry=r)
        self.overlap_misses = Counter("disco_spec_decode_overlap_misses",
                                      "Draft calls whose pre-drafted block was thrown away (a wrong guess)",
                                      registry=r)
        self.predrafted_used = Counter("disco_spec_decode_predrafted_tokens_used",
                                       "Pre-drafted tokens streamed as draft tokens", registry=r)
        self.predrafted_wasted = Counter("disco_spec_decode_predrafted_tokens_wasted",
                                         "Pre-drafted tokens thrown away", registry=r)
        self.generation_tokens = Counter("disco_generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter("disco_request_success", "Requests finished, by finish reason",
                                       ["finished_reason"], registry=r)
        self.e2e_latency = Histogram("disco_e2e_request_latency_seconds", "Request latency (finished requests)",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("disco_time_to_first_token_seconds", "Time to the first streamed tokens",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.request_tokens_per_s = Histogram(
            "disco_request_generation_tokens_per_second", "Generated tokens per second of each finished request",
            buckets=(1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000), registry=r)
        self._totals = [0, 0]  # draft tokens, accepted tokens
        self._lock = threading.Lock()
        self.acceptance_rate.set_function(self._acceptance_rate)

    def _acceptance_rate(self) -> float:
        with self._lock:
            drafted, accepted = self._totals
        return accepted / drafted if drafted else 0.0

    def observe(self, events: Iterator[GenerationEvent]) -> Iterator[GenerationEvent]:
        """Pass the loop's events through, timing the first tokens and recording the result."""
        started = time.perf_counter()
        first = True
        for event in events:
            if first and isinstance(event, TokenChunk) and event.token_ids:
                self.ttft.observe(time.perf_counter() - started)
                first = False
            elif isinstance(event, GenerationResult):
                self.record(event.stats, time.perf_counter() - started)
            yield event

    def record(self, stats: RequestStats, latency_s: float) -> None:
        """Count one finished request."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.num_drafts.inc(sum(1 for k in stats.lookaheads if k > 0))
        self.num_draft_tokens.inc(stats.draft_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            if count:
                self.accepted_per_pos.labels(str(position)).inc(count)
        for lookahead in stats.lookaheads:
            self.lookahead.observe(lookahead)
        self.draft_forwards.inc(stats.draft_forwards)
        self.target_forwards.inc(stats.target_forwards)
        self.draft_fallbacks.inc(stats.draft_fallbacks)
        self.target_reprefills.inc(stats.target_reprefills)
        self.draft_reprefills.inc(stats.draft_reprefills)
        self.overlap_hits.inc(stats.overlap_hits)
        self.overlap_misses.inc(stats.overlap_misses)
        self.predrafted_used.inc(stats.predrafted_used)
        self.predrafted_wasted.inc(stats.predrafted_wasted)
        self.request_success.labels(stats.finish_reason or "unknown").inc()
        self.e2e_latency.observe(latency_s)
        if latency_s > 0:
            self.request_tokens_per_s.observe(stats.generated_tokens / latency_s)
        with self._lock:
            self._totals[0] += stats.draft_tokens
            self._totals[1] += stats.accepted_tokens
        logger.info("request finished: %d+%d tokens, %s, acceptance %.2f, %.3f s", stats.prompt_tokens,
                    stats.generated_tokens, stats.finish_reason, stats.acceptance_rate, latency_s,
                    extra={"generated_tokens": stats.generated_tokens, "draft_fallbacks": stats.draft_fallbacks,
                           "target_reprefills": stats.target_reprefills, "draft_reprefills": stats.draft_reprefills})
