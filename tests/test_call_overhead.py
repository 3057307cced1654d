"""``auto``'s ``t_rtt`` over gRPC: what a call costs beyond its forwards, observed on the
requests the orchestrator served alone (orchestrator/call_overhead.py, issue 50 item 5)."""

from __future__ import annotations

import time

import pytest

from disco.speculation.loop import GenerationResult, TokenChunk
from disco.stats import RequestStats
from orchestrator.call_overhead import CallOverhead
from orchestrator.servicer import OrchestratorServicer


def _stats(**fields) -> RequestStats:
    return RequestStats(**fields)


def test_nothing_observed_gives_no_overhead():
    overhead = CallOverhead()
    assert overhead.seconds() is None
    overhead.observe(_stats(), t_draft=0.01)  # a request that made no call adds nothing
    assert overhead.seconds() is None and overhead.requests() == 0


def test_the_overhead_is_the_call_time_left_by_the_forwards_a_median_over_requests():
    overhead = CallOverhead()
    # 10 target-only Verify calls of 60 ms, 45 ms of each in the forward: 15 ms a call
    overhead.observe(_stats(target_forwards=10, verify_s=0.600, verify_forward_s=0.450), t_draft=0.02)
    assert overhead.seconds() == pytest.approx(0.015)
    # 4 iterations: 4 Draft calls of 3 forwards (20 ms each) taking 70 ms, 4 Verify calls
    # taking 80 ms with 60 ms of forward: (4 * 10 + 4 * 20) ms over 8 calls
    overhead.observe(_stats(target_forwards=4, draft_calls=4, draft_forwards=12, draft_s=0.280,
                            verify_s=0.320, verify_forward_s=0.240), t_draft=0.02)
    assert overhead.seconds() == pytest.approx((0.015 + 0.015) / 2)
    # a first request's one-off costs (300 ms a call) do not move the median of three
    overhead.observe(_stats(target_forwards=2, verify_s=0.700, verify_forward_s=0.100), t_draft=0.02)
    assert overhead.seconds() == pytest.approx(0.015)
    assert overhead.requests() == 3


def test_the_window_keeps_the_latest_requests_and_never_goes_negative():
    overhead = CallOverhead(window=2)
    for beyond in (0.100, 0.002, 0.004):
        overhead.observe(_stats(target_forwards=1, verify_s=0.05 + beyond, verify_forward_s=0.05), t_draft=0.0)
    assert overhead.seconds() == pytest.approx(0.003)
    overhead.observe(_stats(target_forwards=1, draft_calls=1, draft_forwards=5, draft_s=0.01, verify_s=0.05,
                            verify_forward_s=0.05), t_draft=0.01)  # forwards priced above the calls' time
    assert overhead.seconds() == pytest.approx(0.002)  # the median of 0.004 and 0


class _RecordingBackends:
    def __init__(self) -> None:
        self.observed: list[RequestStats] = []

    def observe_calls(self, stats: RequestStats) -> None:
        self.observed.append(stats)


def _servicer(active: int, admissions: int) -> tuple[OrchestratorServicer, _RecordingBackends]:
    servicer = OrchestratorServicer.__new__(OrchestratorServicer)  # only the bookkeeping is exercised
    servicer.backends = _RecordingBackends()
    servicer._active, servicer._admissions = active, admissions
    return servicer, servicer.backends


def _events(stats: RequestStats):
    yield TokenChunk([1], "a")
    yield GenerationResult([1], "a", "length", stats)


def test_only_a_request_served_alone_is_observed():
    stats = RequestStats(target_forwards=1)
    alone, backends = _servicer(active=1, admissions=7)
    assert len(list(alone._observing_calls(_events(stats), admissions=7))) == 2
    assert backends.observed == [stats]
    beside_another, backends = _servicer(active=2, admissions=7)  # another request still running
    list(beside_another._observing_calls(_events(stats), admissions=7))
    assert backends.observed == []
    joined_meanwhile, backends = _servicer(active=1, admissions=9)  # others came (and went) meanwhile
    list(joined_meanwhile._observing_calls(_events(stats), admissions=7))
    assert backends.observed == []


# -- through the real gRPC services ------------------------------------------------------


#: Work the target service does per Verify call outside its forward, injected below.
SERVICE_WORK_S = 0.02


def test_auto_prices_calls_at_the_overhead_observed_over_grpc(target_model, drafts, tokenizer):
    """Real services on loopback, the target spending :data:`SERVICE_WORK_S` per Verify call
    outside its forward (as a servicer's thread hand-offs do, which no ``Info`` ping sees):
    before any request ``t_rtt`` is the ``Info`` round trip; after a request served alone it is
    that request's call time beyond the forwards, from the stats the request returned, and at
    least the injected work; auto's later requests are exact."""
    import draft_service.server  # noqa: PLC0415
    import target_service.server  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415
    from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator  # noqa: PLC0415
    from tests.helpers import PROMPTS, wait_until  # noqa: PLC0415

    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), forward_s=(0.01, 0.011))
    draft = draft_service.server.serve(loaded(drafts["same"], tokenizer, "tiny-draft"), forward_s=(0.002,))
    engine = target.servicers[0].engine
    verify = engine.verify

    def verify_after_other_work(*args, **kwargs):
        time.sleep(SERVICE_WORK_S)
        return verify(*args, **kwargs)

    engine.verify = verify_after_other_work
    orchestrator = start_orchestrator(tokenizer, draft.address, target.address)
    backends = orchestrator.servicers[0].backends
    try:
        assert backends.costs(1).t_rtt == backends.calibrated_costs().t_rtt  # nothing observed yet
        with DiscoClient(orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            reference = client.generate(PROMPTS[0], policy="none", max_new_tokens=16, ignore_eos=True)
            stats = reference.stats
            assert stats["target_forwards"] == 16 and stats["draft_calls"] == 0
            assert 0 < stats["verify_forward_s"] <= stats["backend_verify_s"] <= stats["verify_s"]
            expected = (stats["verify_s"] - stats["verify_forward_s"]) / stats["target_forwards"]
            wait_until(lambda: backends.call_overhead.requests() == 1, 30, "the request observed", poll_s=0.01)
            assert backends.call_overhead.seconds() == pytest.approx(expected, rel=1e-3, abs=1e-5)
            assert expected >= SERVICE_WORK_S
            costs = backends.costs(1)
            assert costs.t_rtt == pytest.approx(expected, rel=1e-3, abs=1e-5)
            assert "call overhead" in costs.source
            drafted = client.generate(PROMPTS[0], policy="static:3", max_new_tokens=16, ignore_eos=True)
            assert drafted.token_ids == reference.token_ids
            assert drafted.stats["draft_calls"] == drafted.stats["iterations"] > 0
            wait_until(lambda: backends.call_overhead.requests() == 2, 30, "the second request observed", poll_s=0.01)
            auto = client.generate(PROMPTS[0], policy="auto", max_new_tokens=16, ignore_eos=True)
            assert auto.token_ids == reference.token_ids
    finally:
        for server in (orchestrator, draft, target):
            server.stop(0)
