"""Stop policies: spec parsing, HF's heuristic schedule, where confidence stops."""

import pytest

from disco.errors import InvalidRequest
from disco.speculation.policies import Decision, PolicyFactory, parse_policy_spec
from disco.speculation.policies.simple import AdaptiveConfidencePolicy, EntropyPolicy, HeuristicPolicy
from disco.speculation.signals import TokenSignals


def signals(top1, entropy=1.0):
    return TokenSignals(topk_probs=(top1,) + (0.0,) * 9, entropy=entropy, token_prob=top1)


@pytest.mark.parametrize("spec", ["none", "static:6", "heuristic:4", "confidence:0.4", "adaptive-confidence",
                                  "adaptive-confidence:0.3", "entropy", "entropy:0.3",
                                  "entropy:lambda=0.3,gamma=2,adapt=0.05,target=0.7", "oracle", "disco:default"])
def test_valid_specs_parse(spec):
    assert parse_policy_spec(spec).text == spec


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty"), ("static", "static:K"), ("static:0", "outside"), ("static:x", "not a valid int"),
    ("confidence:1.5", "outside"), ("bogus:3", "unknown policy"), ("none:3", "takes no argument"),
    ("entropy:foo=1", "unknown entropy parameter"), ("disco:", "disco:PATH"),
])
def test_malformed_specs_are_refused_with_reason(spec, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        parse_policy_spec(spec)


def test_heuristic_schedule_follows_hf_rule():
    policy = HeuristicPolicy(4)
    assert policy.begin_block(20) == 4
    policy.on_feedback(4, 4)  # all accepted: +2
    assert policy.begin_block(20) == 6
    policy.on_feedback(6, 2)  # a rejection: -1
    assert policy.begin_block(20) == 5
    for _ in range(10):
        policy.on_feedback(5, 0)
    assert policy.begin_block(20) == 1  # never below 1
    assert policy.begin_block(3) == 1
    policy = HeuristicPolicy(19)
    policy.begin_block(20)
    policy.on_feedback(19, 19)
    assert policy.begin_block(20) == 20  # kept within the cap


def test_confidence_stops_after_the_first_unconfident_token():
    policy = PolicyFactory().build("confidence:0.5")
    decisions = [policy.after_token(i, 0, signals(p)) for i, p in enumerate([0.9, 0.6, 0.49, 0.99])]
    assert decisions[:3] == [Decision.CONTINUE, Decision.CONTINUE, Decision.STOP]


def test_adaptive_confidence_refits_threshold_by_roc():
    policy = AdaptiveConfidencePolicy(0.1)
    # Accepted tokens have high probability, rejected ones low: the ROC threshold
    # must land between the two groups.
    for _ in range(4):
        for position, prob in enumerate([0.9, 0.8, 0.3]):
            policy.after_token(position, 0, signals(prob))
        policy.on_feedback(3, 2)
    assert 0.3 < policy.threshold <= 0.8


def test_entropy_rule_and_adaptation():
    policy = EntropyPolicy(lam=0.5, gamma=1.0)
    assert policy.after_token(0, 0, signals(0.9, entropy=0.1)) is Decision.CONTINUE  # bound 0.68
    assert policy.after_token(1, 0, signals(0.5, entropy=0.5)) is Decision.STOP  # bound 0.29
    adaptive = EntropyPolicy(lam=0.5, adapt=0.5, target=0.8)
    adaptive.on_feedback(4, 0)  # doing worse than target: stop earlier (higher lambda)
    assert adaptive.lam > 0.5


def test_oracle_discards_the_first_wrong_token():
    policy = PolicyFactory().build("oracle", reference_ids=[5, 6, 7, 8])
    assert policy.after_token(0, 5, None) is Decision.CONTINUE
    assert policy.after_token(1, 9, None) is Decision.DISCARD
    policy.on_feedback(1, 1)  # accepted 5, bonus 6
    assert policy.after_token(0, 7, None) is Decision.CONTINUE


def test_disco_spec_without_loader_is_refused():
    with pytest.raises(InvalidRequest, match="artifact"):
        PolicyFactory().build("disco:/nonexistent")
