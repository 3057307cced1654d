"""DISCO building blocks: datasets and their fixed split, cost model, features,
compiled classifiers equal to scikit-learn's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from disco.engines.engine_costs import measure_cost_model
from disco.errors import InvalidRequest
from disco.offline.classifiers import Examples, _fit_classifier, compile_estimator, make_estimator, raw_score
from disco.offline.datasets import load_dataset
from disco.speculation.cost_model import CostModel
from disco.speculation.features import FeatureExtractor, FeatureSpec
from disco.speculation.signals import TokenSignals


def test_humaneval_split_is_fixed_and_disjoint():
    splits = {name: load_dataset(f"humaneval:{name}") for name in ("train", "validation", "test")}
    ids = {name: [item.id for item in ds.items] for name, ds in splits.items()}
    assert [len(ids[n]) for n in ("train", "validation", "test")] == [102, 21, 41]
    assert set(ids["train"]).isdisjoint(ids["test"]) and set(ids["validation"]).isdisjoint(ids["test"])
    assert ids["test"][:3] == ["HumanEval/3", "HumanEval/7", "HumanEval/11"]
    assert ids["validation"][:2] == ["HumanEval/1", "HumanEval/9"]
    assert [i.id for i in load_dataset("humaneval:train", limit=3).items] == ["HumanEval/0", "HumanEval/2",
                                                                              "HumanEval/4"]
    assert len(load_dataset("humaneval")) == 164


def test_jsonl_prompts_and_chats(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "def f():"}) + "\n\n" +
                    json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    dataset = load_dataset(str(path))
    assert [item.id for item in dataset.items] == ["1", "chat"]
    assert dataset.items[0].encode(tokenizer) == tokenizer("def f():")["input_ids"]
    with pytest.raises(InvalidRequest, match="chat template"):
        dataset.items[1].encode(tokenizer)  # the tiny tokenizer has none
    assert len(load_dataset(str(path), limit=1)) == 1


@pytest.mark.parametrize("spec, fragment", [("humaneval:dev", "unknown HumanEval split"),
                                            ("/nope.jsonl", "neither"), ("", "empty")])
def test_bad_datasets_are_refused(spec, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        load_dataset(spec)


def test_bad_jsonl_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(InvalidRequest, match="bad.jsonl:2"):
        load_dataset(str(path))


def test_cost_model_json_round_trip_and_extrapolation(tmp_path):
    cost = CostModel(t_draft=0.5, t_verify=(1.0, 1.5, 2.0), t_rtt=0.01, source="test")
    cost.save(tmp_path / "c.json")
    again = CostModel.load(tmp_path / "c.json")
    assert again == cost
    assert again.verify(4) == pytest.approx(3.0)  # linear beyond the table
    assert again.iteration(3, 2) == pytest.approx(3 * 0.5 + 2.0 + 2 * 0.01)
    assert again.target_only_token == pytest.approx(1.01)
    assert CostModel.orientation().target_only_token == pytest.approx(0.240)
    with pytest.raises(InvalidRequest):
        CostModel.from_json({"t_draft": 1})


def test_measure_on_tiny_engines(target_model, drafts):
    cost = measure_cost_model(target_model, drafts["noisy"], max_k=3, repeats=1, prompt_len=16, ks=(0, 1, 3))
    assert cost.t_draft > 0 and len(cost.t_verify) == 4 and all(v > 0 for v in cost.t_verify)


def signals(p1, entropy=1.0):
    return TokenSignals(topk_probs=(p1, 0.1) + (0.01,) * 8, entropy=entropy, token_prob=p1)


def test_feature_vector_follows_block_and_session_state():
    spec = FeatureSpec()
    names = spec.names
    assert len(names) == len(set(names)) == 30 and names[:3] == ("p1", "p2", "p3")
    extractor = FeatureExtractor(spec)
    extractor.begin_block()
    first = dict(zip(names, extractor.token(0, signals(0.8))))
    second = dict(zip(names, extractor.token(1, signals(0.5, entropy=2.0))))
    assert first["is_first"] == 1 and second["position"] == 1 and second["prev_p1"] == pytest.approx(0.8)
    assert second["cum_p1"] == pytest.approx(0.4) and second["min_p1"] == pytest.approx(0.5)
    assert second["margin"] == pytest.approx(0.4)
    extractor.feedback(2, 1)
    extractor.begin_block()
    third = dict(zip(names, extractor.token(0, signals(0.9))))
    assert third["prev_accepted"] == 1 and third["prev_drafted"] == 2 and third["prev_full"] == 0
    assert third["cum_p1"] == pytest.approx(0.9) and third["session_rate"] == pytest.approx(2 / 4)


def test_draw_features_tell_a_tail_draw_from_the_argmax():
    extractor = FeatureExtractor(FeatureSpec(), temperature=0.7)
    names = extractor.spec.names
    extractor.begin_block()
    argmax = dict(zip(names, extractor.token(0, signals(0.6))))  # the drawn token is the argmax
    tail = dict(zip(names, extractor.token(1, TokenSignals(topk_probs=(0.6, 0.2) + (0.01,) * 8, entropy=1.0,
                                                          token_prob=0.15))))
    assert argmax["is_argmax"] == 1 and argmax["log_token_ratio"] == 0 and argmax["token_prob"] == pytest.approx(0.6)
    assert tail["is_argmax"] == 0 and tail["log_token_ratio"] == pytest.approx(np.log(0.15 / 0.6))
    assert tail["cum_log_token_prob"] == pytest.approx(np.log(0.6) + np.log(0.15))
    assert argmax["temperature"] == tail["temperature"] == 0.7


def test_feature_spec_refuses_unknown_groups_and_versions():
    with pytest.raises(InvalidRequest, match="unknown feature groups"):
        FeatureSpec(groups=("probs", "vibes"))
    data = FeatureSpec().to_json()
    assert FeatureSpec.from_json(data) == FeatureSpec()
    with pytest.raises(InvalidRequest, match="feature version"):
        FeatureSpec.from_json({**data, "version": 0})


@pytest.mark.parametrize("kind", ["logreg", "mlp", "gbm"])
def test_compiled_classifier_matches_sklearn(kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 6))
    y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] + 0.3 * rng.standard_normal(400) > 0).astype(int)
    estimator = make_estimator(kind).fit(x, y)
    compiled = compile_estimator(kind, estimator, 6, (1.0, 0.0))
    expected = raw_score(kind, estimator, x[:50])
    np.testing.assert_allclose([compiled.raw(row) for row in x[:50]], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(compiled.raw_batch(x[:50]), expected, rtol=1e-6, atol=1e-6)
    examples = Examples(x=x, labels={"current": y, "next": y}, groups=np.arange(400) % 4)
    calibrated = _fit_classifier(kind, examples, "current", folds=3)
    p = calibrated.probability_batch(x)
    assert ((p > 0.5) == y).mean() > 0.8 and 0 < p.min() < p.max() < 1


def test_stop_rule_statistics_and_grids():
    from disco.speculation.policies.stop_rules import StopRule, threshold_grid

    assert StopRule("token", 0.5).statistic(3, 0.4, 0.1) == 0.4
    assert StopRule("cumulative", 0.5).statistic(3, 0.4, 0.1) == 0.1
    orientation = StopRule("gain", 1.0, CostModel.orientation())
    # C * p * value / (t_draft + 0 extra verify time): 0.1 * 0.4 * 0.240 / 0.090
    assert orientation.statistic(3, 0.4, 0.1) == pytest.approx(0.1 * 0.4 * 0.240 / 0.090)
    cpu = StopRule("gain", 1.0, CostModel(t_draft=0.1, t_verify=(0.3, 0.5, 0.8), t_rtt=0.0))
    assert cpu.statistic(0, 0.5, 0.5) == pytest.approx(0.25 * 0.3 / (0.1 + 0.3))  # k 1 -> 2: 0.8 - 0.5
    assert cpu.stops(0, 0.5, 0.5) and not StopRule("gain", 0.1, cpu.cost).stops(0, 0.5, 0.5)
    cumulative = threshold_grid("cumulative")
    assert cumulative[0] == pytest.approx(0.01) and cumulative[-1] == pytest.approx(0.95)
    assert list(cumulative) == sorted(cumulative) and len(set(cumulative)) == len(cumulative)
    with pytest.raises(InvalidRequest, match="cost model"):
        StopRule("gain", 1.0)
    with pytest.raises(InvalidRequest, match="unknown DISCO rule"):
        threshold_grid("vibes")


def test_disco_policy_cumulative_rule_multiplies_within_a_block():
    from disco.speculation.policies.base import Decision
    from tests.disco_fixtures import handmade_artifact

    artifact = handmade_artifact(threshold=0.5, label="conditional")
    assert artifact.rule == "token"  # old artifacts (no "rule" in the metadata) keep the per-token rule
    artifact.metadata["rule"] = "cumulative"
    policy = artifact.policy()
    policy.begin_block(8)
    decisions, products, product = [], [], 1.0
    for position in range(4):
        decisions.append(policy.after_token(position, 1, signals(0.08)))
        product *= policy.last_probability
        products.append(product)
        assert policy.last_statistic == pytest.approx(product)
    assert [d is Decision.STOP for d in decisions] == [p < 0.5 for p in products]
    assert products[0] >= 0.5 > products[-1]  # mixed: it stops once the block's product falls
    policy.on_feedback(4, 2)
    policy.begin_block(8)  # a new block starts a new product
    policy.after_token(0, 1, signals(0.08))
    assert policy.last_statistic == pytest.approx(policy.last_probability)


def test_conditional_label_only_counts_tokens_after_an_accepted_prefix():
    from disco.offline.training import ExampleCollector

    class Record:
        matches = np.array([1, 0, 1, 1], dtype=bool)
        temperature = 0.0

    collector = ExampleCollector(Record(), FeatureSpec(), None)
    collector.begin_block()
    for index, alive in enumerate([True, False, False, False]):
        collector.token(index, 1, signals(0.5), index, alive, True)
    assert collector.current == [1, 0, 0, 0] and collector.conditional == [1, 0, -1, -1]
    assert collector.next == [0, 0, 0, 0]
