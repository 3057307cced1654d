"""Online acceptance calibration (issue 29, item 4): the deployment recalibrates DISCO's
predicted acceptance against the verdicts it sees, per request from a frozen copy, and
only from real verdicts (never from a pre-draft's guess)."""

from __future__ import annotations

import pytest

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.draft import DraftEngine
from disco.engines.in_process import make_decode
from disco.engines.target import TargetEngine
from disco.interfaces import DraftToken
from disco.speculation.acceptance_calibration import (
    PRIOR,
    AcceptanceCalibration,
    CalibrationMap,
    expected_calibration_error,
)
from disco.speculation.cost_model import CostModel
from disco.speculation.loop import SpeculativeGenerator
from disco.speculation.policies import Decision, PolicyFactory, StopPolicy
from disco.speculation.policies.auto import AutoPolicy, encode_costs
from disco.speculation.policies.learned import make_learned_loader
from tests.helpers import EOS_ID, PROMPTS
from tests.test_overlap import _Patient

#: Verification nearly free: the rate rule drafts on while predicted acceptance stays high.
CHEAP_VERIFY = CostModel(t_draft=0.01, t_verify=(0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1))


def test_an_empty_calibration_is_exactly_the_classifier():
    identity = AcceptanceCalibration().snapshot()
    for probability in (0.0, 0.123456789, 0.5, 0.999, 1.0):
        assert identity(probability) == probability
    assert CalibrationMap.identity()(0.3) == 0.3


def test_observations_move_the_map_towards_the_observed_acceptance():
    calibration = AcceptanceCalibration()
    for _ in range(10):  # predicted 0.9, but only the first of each block is accepted
        calibration.observe([(0.92, 0.92)] * 4, num_accepted=1)
    table = {round(mid, 3): (judged, rate) for mid, judged, rate in calibration.table()}
    # judged: token 0 (accepted) and token 1 (rejected); tokens 2, 3 follow a rejection
    assert table == {0.925: (20, 0.5)}
    after = calibration.snapshot()(0.92)
    assert after == pytest.approx((10 + PRIOR * 0.92) / (20 + PRIOR))
    assert 0.5 < after < 0.92
    for _ in range(200):
        calibration.observe([(0.92, 0.92)] * 4, num_accepted=1)
    assert calibration.snapshot()(0.92) == pytest.approx(0.5, abs=0.02)  # the prior fades
    assert calibration.snapshot()(0.3) == 0.3  # other bins untouched


def test_the_summary_reports_the_calibration_error_of_raw_and_calibrated_predictions():
    calibration = AcceptanceCalibration()
    calibration.observe([(0.9, 0.5), (0.9, 0.5)], num_accepted=1)  # one accepted, one rejected
    summary = calibration.summary()
    assert summary["judged"] == 2
    assert summary["ece_raw"] == pytest.approx(0.4)  # predicted 0.9, observed 0.5
    assert summary["ece_calibrated"] == pytest.approx(0.0)
    assert expected_calibration_error([(0.9, True), (0.9, False)]) == pytest.approx(0.4)


class _Confident(StopPolicy):
    """A classifier stand-in that always predicts ``probability`` (label ``conditional``)."""

    needs_signals = True

    class artifact:  # noqa: N801 - what AutoPolicy reads of a DISCO artifact
        label = "conditional"

    def __init__(self, probability: float) -> None:
        self.last_probability = probability

    def after_token(self, position, token_id, signals):
        return Decision.CONTINUE


def _block(policy: StopPolicy, max_lookahead: int = 8) -> int:
    """Drafted tokens of one block under ``policy``."""
    budget = policy.begin_block(max_lookahead)
    for position in range(budget):
        if policy.after_token(position, 0, None) is not Decision.CONTINUE:
            return position + 1
    return budget


def test_a_deployment_whose_acceptance_is_lower_than_predicted_learns_shorter_blocks():
    calibration = AcceptanceCalibration()
    fresh = AutoPolicy(_Confident(0.95), CHEAP_VERIFY, calibration)
    long_block = _block(fresh)
    assert long_block >= 6  # 0.95 per token with nearly free verification: draft long
    for _ in range(60):  # the target accepts none of what the classifier is so sure of
        drafted = _block(fresh)
        fresh.observe_verification(drafted, 0)
    assert _block(fresh) == long_block  # a running request keeps its frozen map
    learned = AutoPolicy(_Confident(0.95), CHEAP_VERIFY, calibration)
    assert learned.calibration_map(0.95) == pytest.approx(PRIOR * 0.95 / (60 + PRIOR))  # one judged per block
    assert _block(learned) < long_block
    uncalibrated = AutoPolicy(_Confident(0.95), CHEAP_VERIFY, None)
    assert _block(uncalibrated) == long_block


def test_the_factory_keeps_one_calibration_per_artifact_and_can_be_switched_off():
    factory = PolicyFactory(make_learned_loader())
    spec = f"auto:{encode_costs(CHEAP_VERIFY)}"
    first, second = factory.build(spec), factory.build(spec)
    assert first.calibration is second.calibration is factory.calibration("default")
    assert factory.build(f"disco:default@{encode_costs(CHEAP_VERIFY)}").calibration is factory.calibration("default")
    off = PolicyFactory(make_learned_loader(), calibrate_acceptance=False)
    assert off.build(spec).calibration is None and off.calibration("default") is None


class _Counting:
    """A drafter that counts the tokens judged by the verdicts it is given: per feedback on a
    block of k, the accepted tokens plus the rejected one, if any."""

    def __init__(self, drafter: DraftEngine) -> None:
        self.drafter, self.judged, self.block = drafter, 0, 0

    def start_session(self, *args, **kwargs):
        return self.drafter.start_session(*args, **kwargs)

    def end_session(self, session_id: str) -> None:
        self.drafter.end_session(session_id)

    def draft(self, session_id, feedback, max_lookahead):
        if feedback is not None:
            self.judged += min(self.block, feedback.num_accepted + 1)
        self.block = 0
        for event in self.drafter.draft(session_id, feedback, max_lookahead):
            self.block += isinstance(event, DraftToken)
            yield event


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_records_real_verdicts_only(overlap, drafts, target_model, tokenizer):
    """Sequential requests through the draft engine: every verified block's judged tokens
    reach the deployment's calibration once, with or without pre-drafting (a pre-draft's
    guess is never recorded), and both learn the same table."""
    spec = f"disco:default@{encode_costs(CHEAP_VERIFY)}"

    def run(with_overlap: bool):
        factory = PolicyFactory(make_learned_loader())
        engine = DraftEngine(drafts["noisy"], factory, overlap=with_overlap)
        target = TargetEngine(target_model)
        drafter = _Counting(engine)
        verifier = _Patient(target, engine) if with_overlap else target
        generator = SpeculativeGenerator(drafter, verifier, make_decode(tokenizer), (EOS_ID,))
        for prompt in PROMPTS[:3]:
            generator.generate(tokenizer(prompt)["input_ids"], SamplingParams(max_new_tokens=24, ignore_eos=True),
                               SpeculationConfig(policy=spec))
        return factory.calibration("default"), drafter.judged

    calibration, judged = run(overlap)
    assert calibration.summary()["judged"] == judged > 0
    reference, _ = run(False)
    assert calibration.table() == reference.table()
