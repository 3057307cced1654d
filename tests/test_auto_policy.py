"""The ``auto`` policy: cost-aware go/no-go per request, a cost-aware cap per block,
DISCO's stop decision inside it — and exact output whatever it decides."""

import pytest

from disco.config import SamplingParams, SpeculationConfig
from disco.errors import InvalidRequest
from disco.speculation.cost_model import CostModel
from disco.speculation.policies import PolicyFactory, parse_policy_spec
from disco.speculation.policies.auto import (
    AutoPolicy,
    best_lookahead,
    decode_costs,
    encode_costs,
    expected_speedup,
    speculation_pays,
)
from disco.speculation.policies.learned import make_learned_loader
from tests.helpers import PROMPTS, local_generator

# Shapes measured on the project's AVX2 machines (models.md): bf16 verification costs
# about k one-token forwards, int8 weight-only verification of 2-4 tokens is nearly free.
BF16_AVX2 = CostModel(t_draft=0.108, t_verify=(0.346, 0.575, 0.72, 0.873, 1.1, 1.25, 1.4, 1.5, 1.534))
INT8_AVX2 = CostModel(t_draft=0.091, t_verify=(0.236, 0.245, 0.275, 0.29, 0.306, 0.38, 0.45, 0.53, 0.617))
FREE_VERIFY = CostModel(t_draft=0.01, t_verify=(0.2,))


def test_expected_speedup_matches_the_closed_form():
    # k = 2, a = 0.5: 1 + 0.5 + 0.25 tokens for 2 draft tokens + one verification of 2 (+ bonus)
    assert expected_speedup(INT8_AVX2, 2, 0.5) == pytest.approx(0.236 * 1.75 / (2 * 0.091 + 0.275))
    assert expected_speedup(INT8_AVX2, 0, 0.9) == 1.0


def test_go_no_go_follows_the_cost_curve():
    assert not speculation_pays(BF16_AVX2, 8)  # no k pays where verification costs k forwards
    assert speculation_pays(INT8_AVX2, 8)
    assert speculation_pays(FREE_VERIFY, 8)
    # the cap grows with the acceptance rate and shrinks with the verification cost
    assert best_lookahead(INT8_AVX2, 0.6, 8)[0] <= best_lookahead(INT8_AVX2, 0.9, 8)[0]
    assert best_lookahead(FREE_VERIFY, 0.9, 8)[0] > best_lookahead(INT8_AVX2, 0.9, 8)[0]
    assert best_lookahead(BF16_AVX2, 0.3, 8)[0] == 0


def test_costs_round_trip_through_the_spec():
    spec = f"auto:{encode_costs(INT8_AVX2)}"
    parsed = parse_policy_spec(spec)
    costs = decode_costs(spec, parsed.argument)
    assert costs.t_verify == pytest.approx(INT8_AVX2.t_verify, rel=1e-3)
    assert costs.t_draft == pytest.approx(INT8_AVX2.t_draft, rel=1e-3)
    for bad in ("auto:td=1", "auto:tv=a/b", "auto:x=1", "auto:tv=1,tv=2"):
        with pytest.raises(InvalidRequest):
            parse_policy_spec(bad)


def test_the_rate_rule_drafts_while_one_more_token_raises_the_block_rate():
    """With DISCO's conditional acceptance probabilities, a block grows while the marginal
    expected tokens per second of one more token beat the block's own rate."""
    policy = PolicyFactory(make_learned_loader()).build(f"auto:{encode_costs(INT8_AVX2)}")
    assert isinstance(policy, AutoPolicy) and policy.rate_rule

    def block_length(cost: CostModel, probability: float, max_lookahead: int = 20) -> int:
        policy.cost = cost
        policy.begin_block(max_lookahead)
        drafted = 1
        while drafted < max_lookahead and policy.marginal_beats_block(drafted, probability):
            drafted += 1
        return drafted

    # First decision: 1 + p tokens for td + tv(1) s so far against 1 + p + ... + p^j tokens
    # for j * td + tv(j) s. INT8_AVX2: p = 0.8 stops (no longer block is faster), p = 0.9 goes on.
    assert block_length(INT8_AVX2, 0.8) == 1 and block_length(INT8_AVX2, 0.9) > 1
    assert block_length(INT8_AVX2, 0.3) == 1
    assert block_length(INT8_AVX2, 0.9) <= block_length(INT8_AVX2, 0.97) <= block_length(INT8_AVX2, 0.995)
    assert block_length(FREE_VERIFY, 0.9) > block_length(INT8_AVX2, 0.9)  # free verification: longer blocks
    assert block_length(FREE_VERIFY, 0.995) == 20


def test_the_cap_follows_the_session_acceptance():
    """Without DISCO's conditional probabilities (here the confidence fallback), the block
    is capped by the best lookahead for the session's running acceptance rate."""
    factory = PolicyFactory()
    policy = factory.build(f"auto:{encode_costs(INT8_AVX2)}")
    assert isinstance(policy, AutoPolicy) and not policy.rate_rule
    first = policy.begin_block(8)
    for _ in range(20):  # every block accepted in full: the estimate rises, so does the cap
        policy.on_feedback(first, first)
    assert policy.begin_block(8) > first
    for _ in range(40):  # nothing accepted: the cap falls to target-only-like blocks
        policy.on_feedback(1, 0)
    assert policy.begin_block(8) <= 1
    assert factory.build("auto").begin_block(8) == 8  # no costs: plain DISCO


@pytest.mark.parametrize("costs,should_draft", [(BF16_AVX2, False), (INT8_AVX2, True), (None, True)])
def test_auto_is_exact_and_drafts_only_where_it_pays(target_model, drafts, tokenizer, costs, should_draft):
    generator = local_generator(target_model, drafts["noisy"], tokenizer,
                                policy_factory=PolicyFactory(make_learned_loader()))
    generator.costs = costs
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        reference = generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids
        result = generator.generate(ids, sampling, SpeculationConfig(policy="auto"))
        assert result.token_ids == reference
        assert (result.stats.draft_tokens > 0) == should_draft
        if costs is INT8_AVX2:
            assert max(result.stats.lookaheads) <= best_lookahead(INT8_AVX2, 0.999, 8)[0]


@pytest.mark.parametrize("costs", [BF16_AVX2, INT8_AVX2])
def test_auto_over_grpc_reads_the_costs_the_services_report(target_model, drafts, tokenizer, costs):
    """The services report their measured forward costs in Info; the orchestrator builds
    the calibrated cost model from them (plus the measured round trip). Which blocks
    ``auto`` then drafts follows the forward times the services observe once they serve
    (tests/test_live_costs.py); the output is target-only's either way."""
    import draft_service.server  # noqa: PLC0415
    import target_service.server  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415
    from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator  # noqa: PLC0415

    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), forward_s=costs.t_verify)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-draft"),
                                       policy_factory=PolicyFactory(make_learned_loader()), forward_s=(costs.t_draft,))
    orchestrator = start_orchestrator(tokenizer, draft.address, target.address)
    try:
        with DiscoClient(orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            reference = client.generate(PROMPTS[0], policy="none", max_new_tokens=16, ignore_eos=True)
            result = client.generate(PROMPTS[0], policy="auto", max_new_tokens=16, ignore_eos=True)
            disco = client.generate(PROMPTS[0], policy="disco:default", max_new_tokens=16, ignore_eos=True)
        assert result.token_ids == reference.token_ids == disco.token_ids
        assert disco.stats["draft_tokens"] > 0  # disco:PATH never falls back to target-only
        model = orchestrator.servicers[0].backends.calibrated_costs()
        assert model.t_verify == pytest.approx(costs.t_verify) and model.t_draft == pytest.approx(costs.t_draft)
        assert 0 <= model.t_rtt < 1.0
    finally:
        for server in (orchestrator, draft, target):
            server.stop(0)


def test_auto_falls_back_to_confidence_where_the_artifact_does_not_fit():
    """``auto`` is the default everywhere, so it must run with any pair: another draft's
    fingerprint (or no artifact loader) gives the training-free confidence rule."""
    from disco.speculation.policies.simple import ConfidencePolicy  # noqa: PLC0415

    for factory in (PolicyFactory(), PolicyFactory(make_learned_loader("not-this-draft", "not-this-tokenizer"))):
        policy = factory.build(f"auto:{encode_costs(INT8_AVX2)}")
        assert isinstance(policy, AutoPolicy) and isinstance(policy.disco, ConfidencePolicy)


# -- disco:PATH with the deployment's costs ------------------------------------------------

def test_disco_specs_take_costs_or_tuned():
    from disco.speculation.policies import reads_costs, with_costs  # noqa: PLC0415
    from disco.speculation.policies.learned import DiscoPolicy  # noqa: PLC0415

    spec = with_costs("disco:default", INT8_AVX2)
    assert spec == f"disco:default@{encode_costs(INT8_AVX2)}" and not reads_costs(spec)
    assert with_costs("auto", INT8_AVX2) == f"auto:{encode_costs(INT8_AVX2)}"
    for unchanged in ("disco:default@tuned", "static:2", "none", "confidence:0.4"):
        assert with_costs(unchanged, INT8_AVX2) == unchanged and not reads_costs(unchanged)
    assert with_costs("disco:default", None) == "disco:default"
    factory = PolicyFactory(make_learned_loader())
    policy = factory.build(spec)
    assert isinstance(policy, AutoPolicy) and policy.rate_rule and isinstance(policy.disco, DiscoPolicy)
    assert policy.cost.t_verify == pytest.approx(INT8_AVX2.t_verify, rel=1e-3)
    assert isinstance(factory.build("disco:default@tuned"), DiscoPolicy)
    assert isinstance(factory.build("disco:default"), DiscoPolicy)
    for bad in ("disco:@tuned", "disco:default@", "disco:default@td=x", "disco:default@bogus"):
        with pytest.raises(InvalidRequest):
            parse_policy_spec(bad)


class _SpecSpy:
    """Wraps a drafter and records the policy spec each draft session was started with."""

    def __init__(self, drafter) -> None:
        self.drafter, self.specs = drafter, []

    def start_session(self, session_id, prompt_ids, sampling, policy_spec, *args, **kwargs):
        self.specs.append(policy_spec)
        return self.drafter.start_session(session_id, prompt_ids, sampling, policy_spec, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.drafter, name)


@pytest.mark.parametrize("costs", [INT8_AVX2, FREE_VERIFY, None])
def test_disco_runs_under_the_costs_the_loop_knows_and_stays_exact(target_model, drafts, tokenizer, costs):
    """With costs known, the loop hands ``disco:default`` to the draft side with the costs
    (the rate rule); without them, or with ``@tuned``, the artifact's threshold. Output is
    target-only's either way."""
    generator = local_generator(target_model, drafts["noisy"], tokenizer,
                                policy_factory=PolicyFactory(make_learned_loader()))
    generator.costs = costs
    spy = generator.drafter = _SpecSpy(generator.drafter)
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    reference = generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids
    for policy in ("disco:default", "disco:default@tuned"):
        result = generator.generate(ids, sampling, SpeculationConfig(policy=policy))
        assert result.token_ids == reference, policy
    expected = "disco:default" if costs is None else f"disco:default@{encode_costs(costs)}"
    assert spy.specs == [expected, "disco:default@tuned"]
