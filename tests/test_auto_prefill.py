"""``auto`` weighs the draft's prefill of a request's prompt (issue 50, item 4): a request whose
tokens cannot repay the draft's prefill runs target-only; the same prompt with a longer answer
drafts. The prefill cost comes from the engine costs in process and from the draft service's
Info over gRPC; the output is target-only's either way."""

from __future__ import annotations

import pytest

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.engine_costs import EngineCosts, to_cost_model
from disco.speculation.cost_model import CostModel
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.auto import MIN_SPEEDUP, request_speedup, speculation_pays
from disco.speculation.policies.learned import make_learned_loader
from tests.helpers import PROMPTS, local_generator

#: int8 weight-only on AVX2 (tests/test_auto_policy.py), and a draft prefill of 2 ms per prompt
#: token (the real draft on two cores: ~0.35 s for 120 tokens, ~3 ms per token).
INT8_AVX2 = CostModel(t_draft=0.091, t_verify=(0.236, 0.245, 0.275, 0.29, 0.306, 0.38, 0.45, 0.53, 0.617),
                      t_draft_prefill=0.002)


def test_the_draft_prefill_is_paid_once_per_request():
    free = CostModel(t_draft=INT8_AVX2.t_draft, t_verify=INT8_AVX2.t_verify)
    per_block = request_speedup(free, 8, 1000, 64)
    assert per_block > MIN_SPEEDUP  # without the prefill, drafting pays
    # 1000 prompt tokens x 2 ms = 2 s against 64 tokens x 236 ms = 15 s target-only
    expected = 64 * 0.236 / (64 * 0.236 / per_block + 1000 * 0.002)
    assert request_speedup(INT8_AVX2, 8, 1000, 64) == pytest.approx(expected)
    assert request_speedup(INT8_AVX2, 8, 1000, 4) < request_speedup(INT8_AVX2, 8, 1000, 64) < per_block


def test_a_short_answer_to_a_long_prompt_is_not_worth_the_draft_prefill():
    assert speculation_pays(INT8_AVX2, 8)  # per block (no request): as before
    assert speculation_pays(INT8_AVX2, 8, prompt_tokens=100, new_tokens=128)
    assert not speculation_pays(INT8_AVX2, 8, prompt_tokens=2000, new_tokens=8)
    assert speculation_pays(INT8_AVX2, 8, prompt_tokens=2000, new_tokens=2000)
    unknown = CostModel(t_draft=INT8_AVX2.t_draft, t_verify=INT8_AVX2.t_verify)  # no prefill measured: as before
    assert speculation_pays(unknown, 8, prompt_tokens=2000, new_tokens=8)


def test_the_engine_costs_carry_the_draft_prefill_per_token():
    record = dict(fingerprint="f", engine="int8", device="cpu", forward="lean", threads=2, context_tokens=200,
                  repeats=5, torch_version="2", measured_at=0.0)
    target = EngineCosts(model="t", forward_s=INT8_AVX2.t_verify, prefill_s=2.0, **record)
    draft = EngineCosts(model="d", forward_s=(INT8_AVX2.t_draft,), prefill_s=0.4, **record)
    model = to_cost_model(target, draft)
    assert model.t_draft_prefill == pytest.approx(0.4 / 200)
    assert CostModel.from_json(model.to_json()).t_draft_prefill == pytest.approx(0.4 / 200)


@pytest.mark.parametrize("new_tokens,should_draft", [(4, False), (24, True)])
def test_auto_weighs_the_prefill_in_process_and_stays_exact(target_model, drafts, tokenizer, new_tokens,
                                                            should_draft):
    generator = local_generator(target_model, drafts["noisy"], tokenizer,
                                policy_factory=PolicyFactory(make_learned_loader()))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    # a prefill cost per prompt token that 4 tokens cannot repay and 24 can
    generator.costs = CostModel(t_draft=INT8_AVX2.t_draft, t_verify=INT8_AVX2.t_verify,
                                t_draft_prefill=1.0 / len(ids))
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    assert speculation_pays(generator.costs, 8, len(ids), new_tokens) == should_draft
    reference = generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids
    result = generator.generate(ids, sampling, SpeculationConfig(policy="auto"))
    assert result.token_ids == reference
    assert (result.stats.draft_tokens > 0) == should_draft


def test_the_draft_service_reports_its_prefill_and_the_orchestrator_weighs_it(target_model, drafts, tokenizer,
                                                                            monkeypatch):
    import draft_service.server  # noqa: PLC0415
    from orchestrator import backends  # noqa: PLC0415
    import target_service.server  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415
    from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator  # noqa: PLC0415

    monkeypatch.setattr(backends, "LIVE_REFRESH_S", 0.0)  # each request sees the draft observed
    ids = tokenizer(PROMPTS[0])["input_ids"]
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), forward_s=INT8_AVX2.t_verify)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-draft"),
                                       policy_factory=PolicyFactory(make_learned_loader()),
                                       forward_s=(INT8_AVX2.t_draft,), prefill_s_per_token=1.0 / len(ids))
    orchestrator = start_orchestrator(tokenizer, draft.address, target.address)
    try:
        with DiscoClient(orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            # the long one first: until a draft forward is observed, auto drafts to observe one
            long = [client.generate(PROMPTS[0], policy=policy, max_new_tokens=24, ignore_eos=True)
                    for policy in ("none", "auto")]
            short = [client.generate(PROMPTS[0], policy=policy, max_new_tokens=4, ignore_eos=True)
                     for policy in ("none", "auto")]
        assert short[0].token_ids == short[1].token_ids and long[0].token_ids == long[1].token_ids
        assert short[1].stats["draft_tokens"] == 0 and long[1].stats["draft_tokens"] > 0
        model = orchestrator.servicers[0].backends.calibrated_costs()
        assert model.t_draft_prefill == pytest.approx(1.0 / len(ids))
    finally:
        for server in (orchestrator, draft, target):
            server.stop(0)
