"""The separate-devices estimate of overlapped drafting (disco/offline/overlap_estimate.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from disco.offline.overlap_estimate import MISS_PENALTY_FORWARDS, estimate, estimate_record
from disco.offline.replay import RecordReplay
from disco.speculation.cost_model import CostModel
from disco.stats import RequestStats

COST = CostModel(t_draft=0.05, t_verify=(0.2, 0.22, 0.24, 0.26, 0.3), t_rtt=0.0)


def _replay(blocks):
    return RecordReplay(stats=RequestStats(), blocks=list(blocks))


# One core each for the draft and the target on the AVX2 machine (docs/bench/overlap/
# cost_model_pinned_1thread.json), 20 ms per round trip.
PINNED_RTT20 = CostModel(t_draft=0.1285, t_verify=(0.276, 0.323, 0.380, 0.443, 0.693), t_rtt=0.020)


def test_a_verification_window_holds_the_next_blocks_first_tokens():
    # the draft has t_verify(k) + 2 rtt: one forward for the guessed bonus token, then drafts
    assert [PINNED_RTT20.predrafted(k) for k in (1, 2, 3)] == [1, 2, 2]  # 363 / 420 / 483 ms over 128.5 ms
    assert PINNED_RTT20.with_rtt(0).predrafted(1) == 1  # 323 ms: the guess and one token


def test_full_blocks_with_a_right_guess_take_the_next_block_off_the_critical_path():
    # Two blocks of 3, both accepted in full; the draft's token at the bonus position (index 3) matches.
    record = SimpleNamespace(matches=np.ones(16, dtype=bool))
    result = estimate_record(record, _replay([(3, 3, 3), (3, 3, 3)]), COST)
    sequential = 2 * (3 * 0.05 + 0.26)
    assert result.sequential_s == pytest.approx(sequential)
    # window after block 1: verify(3) = 0.26 s -> 5 draft forwards: 1 for the guess, 4 pre-drafted >= 3
    assert result.free_tokens == 3 and result.hits == 1
    assert result.overlapped_s == pytest.approx(sequential - 3 * 0.05)
    assert result.speedup > 1


def test_a_wrong_guess_or_a_rejection_is_a_miss_that_costs_half_a_forward():
    wrong_bonus = SimpleNamespace(matches=np.array([True] * 3 + [False] + [True] * 12))
    rejected = SimpleNamespace(matches=np.ones(16, dtype=bool))
    for record, blocks in ((wrong_bonus, [(3, 3, 3), (3, 3, 3)]), (rejected, [(3, 3, 1), (3, 3, 3)])):
        result = estimate_record(record, _replay(blocks), COST)
        assert result.hits == 0 and result.free_tokens == 0
        assert result.overlapped_s == pytest.approx(result.sequential_s + MISS_PENALTY_FORWARDS * 0.05)


def test_round_trips_widen_the_window_and_sum_over_records():
    record = SimpleNamespace(matches=np.ones(32, dtype=bool))
    blocks = [(4, 4, 4)] * 4
    near = estimate([record], [_replay(blocks)], COST)
    far = estimate([record, record], [_replay(blocks), _replay(blocks)], COST.with_rtt(0.02))
    assert far.iterations == 8 and far.hits == 6
    assert far.sequential_s > 2 * near.sequential_s  # round trips cost in both modes
    assert far.free_tokens == 2 * near.free_tokens == 2 * 3 * 4  # every later block pre-drafted in full


def test_replay_runs_a_bare_auto_with_its_cost_model():
    from disco.speculation.policies.auto import with_costs
    from disco.speculation.policies import parse_policy_spec
    from disco.speculation.policies.auto import decode_costs

    spec = with_costs("auto", COST)
    assert spec.startswith("auto:") and with_costs("static:2", COST) == "static:2"
    assert decode_costs(spec, parse_policy_spec(spec).argument).t_verify == pytest.approx(COST.t_verify)


def test_a_policy_is_replayed_with_the_round_trip_it_is_told(monkeypatch):
    """``estimate_policy`` replays the spec under the estimate's costs, round trip included
    (the orchestrator measures it live and sends it with ``auto``/``disco:PATH``)."""
    from disco.offline import overlap_estimate

    record = SimpleNamespace(matches=np.ones(16, dtype=bool))
    replayed = _replay([(3, 3, 3)] * 3)
    specs = []

    def fake_replay(records, spec, max_lookahead, honor_eos, name=None):
        specs.append(spec)
        return SimpleNamespace(records=[replayed], totals=lambda: {"generated_tokens": 12})

    monkeypatch.setattr(overlap_estimate, "replay_policy", fake_replay)
    far = COST.with_rtt(0.02)
    result, tokens = overlap_estimate.estimate_policy(SimpleNamespace(records=[record]), "auto", far, 8)
    assert specs[0].startswith("auto:td=") and specs[0].endswith("rtt=20") and tokens == 12
    assert result == estimate([record], [replayed], far)
