"""Sampled oracle records (drafter-invariant sampling): replay of a sampled record counts
what a live seeded request counts, the features training sees are those the live policy
computes (the ``draw`` group included), branches agree across modes, and greedy records
keep their cache keys."""

from __future__ import annotations

import numpy as np
import pytest

from disco.config import SamplingParams, SpeculationConfig
from disco.offline.records import RecordConfig, build_records, compute_record, pair_key, record_seed
from disco.offline.replay import replay_policy
from disco.offline.training import ExampleCollector, prompt_groups
from disco.offline.records import merge
from disco.speculation.features import FeatureSpec
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.learned import DiscoPolicy
from tests.disco_fixtures import LOOKAHEAD, MAX_NEW_TOKENS, handmade_artifact, tiny_dataset, tiny_records
from tests.helpers import EOS_ID, PROMPTS, local_generator

TEMPERATURE, TOP_P = 0.9, 0.95
IDENTITY = {"fingerprint": "tiny-target", "tokenizer_hash": "tiny", "dtype": "float32"}
DRAFT_IDENTITY = {"fingerprint": "tiny-draft", "tokenizer_hash": "tiny", "dtype": "float32"}
DRAW_SPEC = FeatureSpec(groups=("probs", "position", "block", "session", "draw"))


def sampled_config(**overrides) -> RecordConfig:
    fields = dict(max_new_tokens=MAX_NEW_TOKENS, horizon=LOOKAHEAD - 1, with_hidden=False, temperature=TEMPERATURE,
                  top_p=TOP_P, seed=7)
    return RecordConfig(**{**fields, **overrides})


def sampled_records(target, draft, tokenizer, prompts=PROMPTS, **overrides):
    return build_records(target, draft, tokenizer, (EOS_ID,), IDENTITY, DRAFT_IDENTITY, tiny_dataset(prompts),
                         sampled_config(**overrides), None, progress=False)


@pytest.fixture(scope="module")
def records(target_model, drafts, tokenizer):
    return sampled_records(target_model, drafts["noisy"], tokenizer)


def live(target, draft, tokenizer, policy, factory, prompt, seed):
    generator = local_generator(target, draft, tokenizer, factory)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
    return generator.generate(tokenizer(prompt)["input_ids"], sampling,
                              SpeculationConfig(policy=policy, max_lookahead=LOOKAHEAD))


def counts(stats):
    return {key: getattr(stats, key) for key in ("generated_tokens", "iterations", "target_forwards", "draft_tokens",
                                                 "draft_forwards", "accepted_tokens", "lookaheads")}


def test_sampled_records_hold_draws_that_are_not_the_argmax(records):
    assert all(r.temperature == TEMPERATURE for r in records.records)
    assert len({r.seed for r in records.records}) == len(records.records)  # a seed per prompt
    matches = np.concatenate([r.matches for r in records.records])
    assert 0.1 < matches.mean() < 0.95
    p1 = np.concatenate([r.topk[:, 0] for r in records.records])
    drawn = np.concatenate([r.token_prob for r in records.records])
    assert (drawn < p1 * (1 - 1e-6)).mean() > 0.05  # the draft drew tokens other than its argmax


@pytest.mark.parametrize("policy", ["static:1", "static:3", "static:7", "heuristic:2", "confidence:0.2",
                                    "disco:draw"])
def test_replay_of_sampled_records_counts_what_a_seeded_live_request_counts(policy, records, target_model, drafts,
                                                                              tokenizer):
    artifact = handmade_artifact(DRAW_SPEC, threshold=0.6)
    factory = PolicyFactory(lambda name: artifact.factory())
    replayed = replay_policy(records, policy if not policy.startswith("disco") else
                             (lambda record: factory.build(policy)), LOOKAHEAD)
    for prompt, record, replay in zip(PROMPTS, records.records, replayed.records):
        result = live(target_model, drafts["noisy"], tokenizer, policy, factory, prompt, record.seed)
        assert replay.approx_tokens == 0
        assert counts(replay.stats) == counts(result.stats), (policy, prompt)
        n = result.stats.generated_tokens
        assert list(result.token_ids) == [int(t) for t in record.continuation[:n]]  # the same seeded text


def test_training_features_equal_the_live_ones_under_sampling(records, target_model, drafts, tokenizer):
    artifact = handmade_artifact(DRAW_SPEC, threshold=0.6)
    live_vectors: list[np.ndarray] = []

    class Recording(DiscoPolicy):
        def after_token(self, position, token_id, signals):
            decision = super().after_token(position, token_id, signals)
            live_vectors.append(self.last_features)
            return decision

    factory = PolicyFactory(lambda name: lambda: Recording(artifact, artifact.threshold))
    record = records.records[0]
    result = live(target_model, drafts["noisy"], tokenizer, "disco:x", factory, PROMPTS[0], record.seed)
    collector = ExampleCollector(record, artifact.spec, artifact.projection)
    replayed = replay_policy(records, lambda r: artifact.policy(), LOOKAHEAD,
                             observer_factory=iter([collector] + [None] * (len(PROMPTS) - 1)).__next__)
    assert counts(replayed.records[0].stats) == counts(result.stats)
    assert len(collector.rows) == len(live_vectors) > 10
    rows = np.stack(collector.rows)
    np.testing.assert_allclose(rows, np.stack(live_vectors), rtol=1e-4, atol=1e-5)
    names = list(artifact.spec.names)
    assert set(rows[:, names.index("temperature")]) == {TEMPERATURE}
    assert set(rows[:, names.index("is_argmax")]) == {0.0, 1.0}  # both kinds of draw, told apart


@pytest.mark.parametrize("mode", ["tree", "cached"])
def test_sampled_branch_modes_match_live_style_drafting(mode, target_model, drafts, tokenizer):
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    config = sampled_config(max_new_tokens=32, horizon=4, with_hidden=True)
    ids = tokenizer(PROMPTS[1])["input_ids"]
    fast = compute_record(generator, drafts["noisy"], "x", ids, config, branch_mode=mode, seed=11)
    reference = compute_record(generator, drafts["noisy"], "x", ids, config, branch_mode="sequential", seed=11)
    assert len(fast.branch_pos) > 3
    np.testing.assert_array_equal(fast.branch_tokens, reference.branch_tokens)
    np.testing.assert_allclose(fast.branch_token_prob, reference.branch_token_prob, atol=1e-5)


def test_an_identical_draft_is_fully_accepted_when_sampling(target_model, tokenizer):
    same = sampled_records(target_model, target_model, tokenizer, prompts=PROMPTS[:2])
    assert all(record.matches.all() and len(record.branch_pos) == 0 for record in same.records)


def test_record_keys_greedy_unchanged_sampled_distinct():
    greedy = RecordConfig(max_new_tokens=32, horizon=4)
    # The greedy key hashes exactly the fields it hashed before sampled records existed.
    assert set(greedy.key_fields()) == {"max_new_tokens", "horizon", "with_hidden", "generation_policy"}
    keys = {pair_key(IDENTITY, DRAFT_IDENTITY, config) for config in (
        greedy, RecordConfig(max_new_tokens=32, horizon=4, temperature=0.7),
        RecordConfig(max_new_tokens=32, horizon=4, temperature=1.0),
        RecordConfig(max_new_tokens=32, horizon=4, temperature=1.0, seed=1))}
    assert len(keys) == 4
    assert record_seed(0, "a" * 20) != record_seed(0, "b" * 20) != record_seed(1, "b" * 20)


def test_a_prompts_greedy_and_sampled_records_share_one_fold_group(records, target_model, drafts, tokenizer):
    greedy = tiny_records(target_model, drafts["noisy"], tokenizer, with_hidden=False)
    pooled = merge([greedy, records])
    groups = prompt_groups(pooled)
    assert list(groups) == list(range(len(PROMPTS))) * 2


def test_sampled_record_round_trips_through_the_cache(tmp_path, target_model, drafts, tokenizer):
    first = build_records(target_model, drafts["noisy"], tokenizer, (EOS_ID,), IDENTITY, DRAFT_IDENTITY,
                          tiny_dataset(PROMPTS[:1]), sampled_config(max_new_tokens=16, horizon=2), tmp_path,
                          progress=False)
    again = build_records(target_model, drafts["noisy"], tokenizer, (EOS_ID,), IDENTITY, DRAFT_IDENTITY,
                          tiny_dataset(PROMPTS[:1]), sampled_config(max_new_tokens=16, horizon=2), tmp_path,
                          progress=False)
    a, b = first.records[0], again.records[0]
    assert (b.temperature, b.seed) == (a.temperature, a.seed) and b.seed > 0
    np.testing.assert_array_equal(a.draft_tokens, b.draft_tokens)
