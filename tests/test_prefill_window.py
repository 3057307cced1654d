"""The draft's bounded prefill window (issue 50, item 4): a draft session reads the prompt's first
4 tokens (attention sinks) and its last ones, never the middle; the target reads the whole prompt,
so the output is target-only's (greedy and seeded, packed and static paths, in process and over
gRPC); ``auto`` weighs the draft's prefill of the window, not of the prompt."""

from __future__ import annotations

import pytest
import torch

from disco.config import ModelConfig, SamplingParams, SpeculationConfig
from disco.engines.batching import roll_back
from disco.engines.draft import DraftEngine
from disco.engines.kv import SINK_TOKENS, CachedSequence, prefill_window_skip
from disco.engines.sessions import SessionLimits
from disco.engines.target import TargetEngine
from disco.errors import InvalidRequest, ModelError
from disco.speculation.cost_model import CostModel
from disco.speculation.loop import SpeculativeGenerator
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.auto import request_speedup, speculation_pays
from disco.engines.in_process import make_decode, make_encode
from tests.helpers import EOS_ID, PROMPTS

WINDOW = 12
#: ~70 tokens: the window skips most of it.
LONG_PROMPT = "def fibonacci(n):\n    " + "# the quick brown fox jumps over the lazy dog\n" + PROMPTS[1]


def test_the_window_keeps_the_first_tokens_and_the_last():
    assert prefill_window_skip(100, 16) == range(SINK_TOKENS, 100 - (16 - SINK_TOKENS))
    assert len(range(100)) - len(prefill_window_skip(100, 16)) == 16
    assert prefill_window_skip(16, 16) == range(0) and prefill_window_skip(10, 16) == range(0)
    assert prefill_window_skip(100, 0) == range(0)  # 0: the whole prompt


def test_a_windowed_sequence_computes_what_the_window_alone_computes(target_model):
    """Bit for bit the logits of a sequence holding only the kept tokens, through decoding, a
    verified block, a rollback and a failed forward's undo."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, int(target_model.config.vocab_size), (40,), generator=generator).tolist()
    skipped = prefill_window_skip(len(tokens), WINDOW)
    windowed = CachedSequence(target_model, tokens, skipped=skipped)
    alone = CachedSequence(target_model, tokens[:SINK_TOKENS] + tokens[skipped.stop:])
    for sequence in (windowed, alone):
        sequence.prefill()
    assert windowed.kv_len == alone.kv_len == WINDOW - 1 and windowed.num_pending == alone.num_pending == 1
    assert torch.equal(windowed.forward(1)[0], alone.forward(1)[0])
    for sequence in (windowed, alone):
        sequence.tokens.extend([5, 6, 7])
    assert torch.equal(windowed.forward(3)[0], alone.forward(3)[0])  # a verified block
    for sequence in (windowed, alone):
        sequence.truncate(len(sequence.tokens) - 2)  # two rejected
        sequence.tokens.extend([9, 10])
    assert windowed.kv_len == alone.kv_len and windowed.cache.get_seq_length() == windowed.kv_len
    mark = windowed.cache_len
    windowed.forward(2)  # then undone, as the batcher undoes a failed forward
    roll_back(windowed, mark)
    assert windowed.cache_len == mark and windowed.cache.get_seq_length() == windowed.kv_positions(mark)
    assert torch.equal(windowed.forward(2)[0], alone.forward(2)[0])


def windowed_generator(target_model, draft_model, tokenizer, limits: SessionLimits = SessionLimits()):
    drafter = DraftEngine(draft_model, PolicyFactory(), limits, prefill_window=WINDOW)
    return SpeculativeGenerator(drafter, TargetEngine(target_model, limits), make_decode(tokenizer), (EOS_ID,),
                                encode=make_encode(tokenizer))


@pytest.mark.parametrize("limits", [SessionLimits(), SessionLimits(static_slots=4, static_capacity=256)],
                         ids=["packed", "static"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95, seed=7)], ids=["greedy", "seeded"])
def test_the_output_is_target_only_s(target_model, drafts, tokenizer, sampling, limits, monkeypatch):
    generator = windowed_generator(target_model, drafts["same"], tokenizer, limits)
    static, steps = generator.drafter.static, []
    if limits.static_slots:  # the windowed draft sessions step on the static path
        run = static.run
        monkeypatch.setattr(static, "run", lambda *args: steps.append(1) or run(*args))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
    ids = tokenizer(LONG_PROMPT)["input_ids"]
    assert len(ids) > 3 * WINDOW
    reference = generator.generate(ids, params, SpeculationConfig(policy="none")).token_ids
    for policy in ("static:3", "confidence:0.4"):
        result = generator.generate(ids, params, SpeculationConfig(policy=policy))
        assert result.token_ids == reference, policy
        assert result.stats.draft_tokens > 0
    assert bool(steps) == bool(limits.static_slots)


def test_a_draft_session_holds_the_window_and_its_reservation_counts_it(target_model, drafts, tokenizer):
    engine = DraftEngine(drafts["same"], PolicyFactory(), prefill_window=WINDOW)
    ids = tokenizer(LONG_PROMPT)["input_ids"]
    engine.start_session("a", ids, SamplingParams(max_new_tokens=16), "static:2")
    sequence = engine.sessions.get("a").sequence
    assert len(sequence.tokens) == len(ids) and sequence.kv_len == WINDOW - 1  # the last token pending
    assert engine.sessions._kv_tokens["a"] == WINDOW + 16
    events = list(engine.draft("a", None, 2))
    assert len(events) == 3 and sequence.kv_len == WINDOW + 1
    engine.end_session("a")


def test_a_window_too_small_is_refused(drafts):
    with pytest.raises(InvalidRequest, match="at least 8"):
        DraftEngine(drafts["same"], PolicyFactory(), prefill_window=5)
    with pytest.raises(InvalidRequest, match="at least 8"):
        ModelConfig(prefill_window=4).validate()
    ModelConfig(prefill_window=8).validate()


def test_the_target_takes_no_window_and_is_refused_before_loading(tmp_path):
    from disco.models.loading import load_model  # noqa: PLC0415

    with pytest.raises(ModelError, match="for the draft only"):  # no such folder: refused before looking
        load_model(ModelConfig(spec=str(tmp_path / "absent"), dtype="float32", prefill_window=64), "target",
                   tmp_path, False)


#: int8 on AVX2 with a draft prefill of 2 ms per prompt token (tests/test_auto_prefill.py).
COSTS = CostModel(t_draft=0.091, t_verify=(0.236, 0.245, 0.275, 0.29, 0.306, 0.38, 0.45, 0.53, 0.617),
                  t_draft_prefill=0.002)


def test_auto_weighs_the_prefill_of_the_window_only():
    windowed = CostModel(t_draft=COSTS.t_draft, t_verify=COSTS.t_verify, t_draft_prefill=COSTS.t_draft_prefill,
                         draft_prefill_window=256)
    assert windowed.draft_prefill(2000) == pytest.approx(256 * 0.002) and windowed.draft_prefill(100) == 0.2
    assert request_speedup(windowed, 8, 2000, 16) == pytest.approx(request_speedup(COSTS, 8, 256, 16))
    assert not speculation_pays(COSTS, 8, prompt_tokens=2000, new_tokens=16)
    assert speculation_pays(windowed, 8, prompt_tokens=2000, new_tokens=16)
    assert CostModel.from_json(windowed.to_json()).draft_prefill_window == 256


def test_the_draft_service_reports_its_window_and_the_orchestrator_weighs_it(target_model, drafts, tokenizer):
    import draft_service.server  # noqa: PLC0415
    import target_service.server  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415
    from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded, start_orchestrator  # noqa: PLC0415

    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"), forward_s=COSTS.t_verify)
    draft = draft_service.server.serve(loaded(drafts["same"], tokenizer, "tiny-draft"), forward_s=(COSTS.t_draft,),
                                       prefill_s_per_token=COSTS.t_draft_prefill, prefill_window=WINDOW)
    orchestrator = start_orchestrator(tokenizer, draft.address, target.address)
    try:
        with DiscoClient(orchestrator.address, timeout=CLIENT_TIMEOUT_S) as client:
            results = [client.generate(LONG_PROMPT, policy=policy, max_new_tokens=16, ignore_eos=True)
                       for policy in ("none", "static:3")]
        assert results[0].token_ids == results[1].token_ids and results[1].stats["draft_tokens"] > 0
        backends = orchestrator.servicers[0].backends
        assert backends.describe("draft").prefill_window == WINDOW
        assert backends.calibrated_costs().draft_prefill_window == WINDOW
    finally:
        for server in (orchestrator, draft, target):
            server.stop(0)


def test_the_flags_reach_the_configs_and_the_launched_draft_server():
    from disco_cli.launcher import _model_args  # noqa: PLC0415
    from disco_cli.main import build_parser  # noqa: PLC0415

    assert build_parser().parse_args(["draft-server", "--prefill-window", "256"]).prefill_window == 256
    assert build_parser().parse_args(["generate", "--prompt", "x", "--draft-window", "128"]).draft_window == 128
    assert _model_args(ModelConfig(prefill_window=128))[-2:] == ["--prefill-window", "128"]
    assert "--prefill-window" not in _model_args(ModelConfig())
