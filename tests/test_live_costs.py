"""Live costs (issue 29, items 2-3): the services keep the forward times they observe by rows,
and ``auto``'s cost model follows them — a calibration 10x off either way is corrected by
the first forwards, and concurrent load moves the lookahead."""

from __future__ import annotations

import threading

import pytest

from disco.engines.live_costs import LiveCosts
from disco.speculation.cost_model import CostModel
from disco.speculation.live_model import corrected_curve, live_cost_model
from disco.speculation.policies.auto import best_lookahead, speculation_pays

#: A machine where a verification row is not free: the target's seconds over ``rows`` new
#: tokens of all sessions in one forward, and the draft's.
TRUE_TARGET = [0.080 + 0.003 * rows for rows in range(1, 200)]
TRUE_DRAFT = [0.020 + 0.003 * rows for rows in range(1, 17)]
TRUE = CostModel(t_draft=TRUE_DRAFT[0], t_verify=tuple(TRUE_TARGET[k] for k in range(9)))


def _scaled(costs: CostModel, target: float, draft: float) -> CostModel:
    return CostModel(t_draft=costs.t_draft * draft, t_verify=tuple(v * target for v in costs.t_verify))


def test_live_costs_keep_a_decaying_average_per_row_count():
    live = LiveCosts(max_rows=8, weight=0.25)
    assert live.seconds_by_rows() == ()
    live.observe(2, 0.4)
    assert live.seconds_by_rows() == (0.0, 0.4)  # the first observation sets it; rows 1 not seen
    live.observe(2, 0.8)
    assert live.seconds_by_rows() == (0.0, pytest.approx(0.5))  # a quarter of the way
    for _ in range(12):  # a level change is followed within a few forwards
        live.observe(2, 0.8)
    assert live.seconds_by_rows()[1] == pytest.approx(0.8, rel=0.02)
    live.observe(9, 1.0)  # past max_rows: not tracked
    live.observe(3, 0.0)  # not a timing
    assert len(live.seconds_by_rows()) == 2 and live.observations == 14
    with pytest.raises(ValueError):
        LiveCosts(weight=0.0)


def test_one_slow_outlier_moves_the_average_little_and_a_sustained_slowdown_is_followed():
    live = LiveCosts(max_rows=2, weight=0.25)
    live.observe(1, 0.023)
    live.observe(1, 0.100)  # one forward ~4x slow (an idle process's first): counted as 2x
    assert live.seconds_by_rows()[0] == pytest.approx(0.023 * 1.25)
    for _ in range(20):  # the machine got 5x slower: followed within a few forwards all the same
        live.observe(1, 0.115)
    assert live.seconds_by_rows()[0] == pytest.approx(0.115, rel=0.02)


def test_live_costs_are_thread_safe():
    live = LiveCosts(max_rows=4)
    threads = [threading.Thread(target=lambda: [live.observe(1 + i % 4, 0.1) for i in range(500)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert live.observations == 2000 and live.seconds_by_rows() == pytest.approx((0.1,) * 4)


def test_rows_not_observed_follow_the_observed_ratio():
    curve = corrected_curve(lambda rows: 1.0 * rows, [0.0, 20.0, 0.0, 40.0])  # observed: 10x the calibration
    assert curve(2) == 20.0 and curve(4) == 40.0  # observed rows as observed
    assert curve(1) == pytest.approx(10.0) and curve(7) == pytest.approx(70.0)  # the others scaled
    assert corrected_curve(lambda rows: 3.0, [])(5) == 3.0  # nothing observed: the calibration


@pytest.mark.parametrize("draft_factor, target_factor", [(10.0, 1.0), (0.1, 1.0), (1.0, 10.0), (1.0, 0.1),
                                                         (10.0, 0.1)])
def test_a_calibration_ten_times_off_is_corrected_by_the_first_forwards(draft_factor, target_factor):
    """After one request's forwards (target: 1..4 rows, draft: 1 row) the decisions are
    those of the true costs, whichever way the calibration was wrong."""
    wrong = _scaled(TRUE, target_factor, draft_factor)
    decisions = [(speculation_pays(costs, 8), best_lookahead(costs, acceptance, 8)[0])
                 for costs in (TRUE, wrong) for acceptance in (0.6, 0.8, 0.95)]
    assert decisions[:3] != decisions[3:]  # the wrong calibration decides otherwise
    target_live = [TRUE_TARGET[rows - 1] if rows <= 4 else 0.0 for rows in range(1, 5)]
    corrected = live_cost_model(wrong, target_live, TRUE_DRAFT[:1], sessions=1)
    assert corrected.t_draft == pytest.approx(TRUE.t_draft)
    assert corrected.t_verify == pytest.approx(TRUE.t_verify, rel=0.02)
    assert [(speculation_pays(corrected, 8), best_lookahead(corrected, acceptance, 8)[0])
            for acceptance in (0.6, 0.8, 0.95)] == decisions[:3]


def test_load_shrinks_the_lookahead_and_stops_speculation():
    """With n sessions in flight a verification of blocks of k is one target forward over
    n * (k + 1) rows and a draft step one over n rows: blocks shrink as n grows and
    speculation stops where no block pays; they return when the load falls."""
    lookaheads = []
    for sessions in (1, 2, 4, 8, 16, 1):
        costs = live_cost_model(TRUE, TRUE_TARGET, TRUE_DRAFT, sessions=sessions)
        assert costs.t_draft == pytest.approx(TRUE_DRAFT[sessions - 1])
        assert costs.verify(2) == pytest.approx(TRUE_TARGET[3 * sessions - 1])
        lookaheads.append(best_lookahead(costs, 0.8, 8)[0] if speculation_pays(costs, 8) else 0)
    assert lookaheads[0] >= 3 and lookaheads[-1] == lookaheads[0]
    assert lookaheads[:5] == sorted(lookaheads[:5], reverse=True) and lookaheads[4] == 0


def test_without_observations_one_session_keeps_the_calibration():
    assert live_cost_model(TRUE, (), (), sessions=1) is TRUE


# -- through the real gRPC services -------------------------------------------------------

#: A calibration 10x (and more) too slow for the tiny models: with it the draft cannot pay.
SLOW_CALIBRATION = CostModel(t_draft=0.108, t_verify=(0.346, 0.575, 0.72, 0.873, 1.1, 1.25, 1.4, 1.5, 1.534))


def test_the_services_observe_their_forwards_and_auto_follows_them_over_a_wrong_calibration(
        target_model, drafts, tokenizer):
    """Services started with a calibration far too slow for what they run: ``Info`` and
    ``/metrics`` carry the forward times they observe, the first ``auto`` request drafts
    although the calibration says drafting cannot pay (no draft forward was observed yet),
    and from then on the orchestrator's cost model is the observed one, not the calibration;
    every output equals target-only."""
    import draft_service.server  # noqa: PLC0415
    import target_service.server  # noqa: PLC0415
    from disco.speculation.policies import PolicyFactory  # noqa: PLC0415
    from disco.speculation.policies.learned import make_learned_loader  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415
    from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator  # noqa: PLC0415
    from tests.helpers import PROMPTS  # noqa: PLC0415

    assert not speculation_pays(SLOW_CALIBRATION, 8)
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"),
                                         forward_s=SLOW_CALIBRATION.t_verify)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-draft"),
                                       policy_factory=PolicyFactory(make_learned_loader()),
                                       forward_s=(SLOW_CALIBRATION.t_draft,))
    orchestrator = start_orchestrator(tokenizer, draft.address, target.address)
    backends = orchestrator.servicers[0].backends
    try:
        with DiscoClient(orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            reference = client.generate(PROMPTS[0], policy="none", max_new_tokens=24, ignore_eos=True)
            first = client.generate(PROMPTS[0], policy="auto", max_new_tokens=24, ignore_eos=True)
            assert first.token_ids == reference.token_ids
            assert first.stats["draft_tokens"] > 0  # explored: a calibration too slow must not stick
            target_live = tuple(backends.describe("target").live_forward_s)
            draft_live = tuple(backends.describe("draft").live_forward_s)
            assert target_live and target_live[0] > 0 and draft_live and draft_live[0] > 0
            backends._live_read_at = float("-inf")  # read the services' tables now, not a second later
            live = backends.costs(1)
            assert backends.calibrated_costs().t_draft == pytest.approx(SLOW_CALIBRATION.t_draft)
            assert live.t_draft < SLOW_CALIBRATION.t_draft / 10 and live.verify(0) < SLOW_CALIBRATION.verify(0) / 10
            assert live.verify(0) == pytest.approx(backends.live_costs()[0][0])
            assert not backends.draft_unobserved()
            for prompt in PROMPTS[1:3]:  # later requests: exact, decided by the observed costs
                assert (client.generate(prompt, policy="auto", max_new_tokens=24, ignore_eos=True).token_ids
                        == client.generate(prompt, policy="none", max_new_tokens=24, ignore_eos=True).token_ids)
        metrics = target.metrics.exposition()
        assert 'disco_forward_seconds_live{rows="1"}' in metrics
    finally:
        for server in (orchestrator, draft, target):
            server.stop(0)


def test_a_draft_not_observed_yet_moves_with_the_target():
    target_live = [v / 10 for v in TRUE_TARGET[:3]]  # the machine is 10x faster than calibrated
    costs = live_cost_model(TRUE, target_live, (), sessions=1)
    assert costs.t_draft == pytest.approx(TRUE.t_draft / 10) and costs.verify(5) == pytest.approx(TRUE.verify(5) / 10)


# -- the decision per block, as the load changes -------------------------------------------

#: A deployment where drafting pays (verification nearly free) and one where it does not.
PAYS = CostModel(t_draft=0.01, t_verify=(0.1,) * 9)
DOES_NOT_PAY = CostModel(t_draft=0.2, t_verify=tuple(0.1 * (k + 1) for k in range(9)))


@pytest.mark.parametrize("draft_kind", ["noisy", "same"])
def test_blocks_become_target_only_steps_under_load_and_the_draft_catches_up_when_it_falls(
        target_model, drafts, tokenizer, draft_kind):
    """``auto`` asks the costs at the current load before every block: while no lookahead
    pays the block is a target-only step, and when speculation pays again the draft session
    is started anew from the request's tokens; the output equals target-only."""
    from disco.config import SamplingParams, SpeculationConfig  # noqa: PLC0415
    from tests.helpers import PROMPTS, local_generator  # noqa: PLC0415

    generator = local_generator(target_model, drafts[draft_kind], tokenizer)
    loads = iter([PAYS] * 4 + [DOES_NOT_PAY] * 4 + [PAYS] * 100)  # the first: the load at the start
    generator.costs, generator.costs_now = PAYS, lambda: next(loads)
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = tokenizer(PROMPTS[1])["input_ids"]
    reference = generator.generate(ids, sampling, SpeculationConfig(policy="none"))
    result = generator.generate(ids, sampling, SpeculationConfig(policy="auto"))
    assert result.token_ids == reference.token_ids
    lookaheads = result.stats.lookaheads
    assert all(k > 0 for k in lookaheads[:3]) and lookaheads[3:7] == [0, 0, 0, 0]
    assert any(k > 0 for k in lookaheads[7:])  # speculating again after the load fell
    assert result.stats.draft_reprefills == 1  # the draft session caught up once


def test_under_load_speculation_must_pay_by_the_load_margin():
    """A gain the single-session bar accepts (>= MIN_SPEEDUP) but inside the spread measured
    under load (< MIN_SPEEDUP_UNDER_LOAD) speculates alone and not with sessions in flight."""
    from disco.speculation.policies.auto import (  # noqa: PLC0415
        MIN_SPEEDUP,
        MIN_SPEEDUP_UNDER_LOAD,
        OPTIMISTIC_ACCEPTANCE,
    )

    # one draft token for 1.9 expected tokens at a verification of 1.8x a target-only step: ~1.05x
    marginal = CostModel(t_draft=0.005, t_verify=(0.1, 0.175))
    gain = best_lookahead(marginal, OPTIMISTIC_ACCEPTANCE, 1)[1]
    assert MIN_SPEEDUP <= gain < MIN_SPEEDUP_UNDER_LOAD
    assert speculation_pays(marginal, 1)
    loaded = live_cost_model(marginal, [], [], sessions=1)
    assert speculation_pays(loaded, 1)  # one session: the usual bar
    under_load = CostModel(t_draft=0.005, t_verify=(0.1, 0.175), extra={"sessions": 4})
    assert not speculation_pays(under_load, 1)
    assert live_cost_model(marginal, [0.1, 0.175], [0.005], sessions=4).extra["sessions"] == 4


class _CountingStarts:
    """A drafter that counts its sessions started."""

    def __init__(self, drafter) -> None:
        self.drafter, self.starts = drafter, 0

    def start_session(self, *args, **kwargs):
        self.starts += 1
        return self.drafter.start_session(*args, **kwargs)

    def end_session(self, session_id: str) -> None:
        self.drafter.end_session(session_id)

    def draft(self, *args, **kwargs):
        return self.drafter.draft(*args, **kwargs)


@pytest.mark.parametrize("seed", [None, 7])
def test_under_load_the_draft_session_starts_at_the_first_block_that_pays(target_model, drafts, tokenizer, seed):
    """A request admitted while other sessions are in flight prefills no draft session until a
    block pays: none at all where no block does (a burst pays no draft prefill the per-block
    check would throw away), and where the first block pays, the same tokens as a request
    that prefilled its draft with the prompt (greedy and seeded sampling alike)."""
    from disco.config import SamplingParams, SpeculationConfig  # noqa: PLC0415
    from tests.helpers import PROMPTS, local_generator  # noqa: PLC0415

    loaded = lambda costs: CostModel(t_draft=costs.t_draft, t_verify=costs.t_verify,  # noqa: E731
                                     extra={"sessions": 4})
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True) if seed is None else SamplingParams(
        max_new_tokens=24, temperature=0.8, seed=seed)
    ids = tokenizer(PROMPTS[2])["input_ids"]
    runs = {}
    for label, load in (("alone", PAYS), ("loaded, pays", loaded(PAYS)), ("loaded, never pays", loaded(DOES_NOT_PAY))):
        generator = local_generator(target_model, drafts["noisy"], tokenizer)
        generator.drafter = counting = _CountingStarts(generator.drafter)
        generator.costs, generator.costs_now = PAYS, lambda load=load: load
        result = generator.generate(ids, sampling, SpeculationConfig(policy="auto"))
        runs[label] = (result.token_ids, counting.starts, result.stats)
    reference = local_generator(target_model, None, tokenizer).generate(ids, sampling, SpeculationConfig(policy="none"))
    assert runs["alone"][1] == runs["loaded, pays"][1] == 1 and runs["loaded, never pays"][1] == 0
    assert runs["loaded, pays"][0] == runs["alone"][0]  # same seeds, same blocks: same tokens
    assert runs["loaded, pays"][2].lookaheads == runs["alone"][2].lookaheads
    assert runs["loaded, pays"][2].draft_reprefills == runs["loaded, never pays"][2].draft_reprefills == 0
    assert set(runs["loaded, never pays"][2].lookaheads) == {0}
    if seed is None:
        assert runs["alone"][0] == runs["loaded, never pays"][0] == reference.token_ids
