"""The static path in the engines (:mod:`disco.engines.static_runner`), eager on the CPU:
sessions take slots, their decoding and verification steps run as bucketed static steps, and
the tokens are target-only's — greedy alone and concurrent with more sessions than slots
(the rest on the packed path), a seeded sample alone and under load; slots come back when
sessions end."""

from __future__ import annotations

import copy

import pytest
import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.draft import DraftEngine
from disco.engines.in_process import make_decode
from disco.engines.sessions import SessionLimits
from disco.engines.target import TargetEngine
from disco.models import row_stable
from disco.speculation.loop import SpeculativeGenerator
from disco.speculation.policies import PolicyFactory
from tests.helpers import EOS_ID, PROMPTS, generate_at_once

STATIC = SessionLimits(static_slots=4, static_capacity=256)


def bf16(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model).to(torch.bfloat16)
    row_stable.stabilize(model)
    return model


@pytest.fixture(scope="module")
def pair(target_model, drafts):
    return bf16(target_model), bf16(drafts["noisy"])


def generator(pair, tokenizer, limits: SessionLimits) -> SpeculativeGenerator:
    target, draft = pair
    return SpeculativeGenerator(DraftEngine(draft, PolicyFactory(), limits), TargetEngine(target, limits),
                                make_decode(tokenizer), (EOS_ID,))


def test_static_sessions_give_target_only_tokens(pair, tokenizer):
    static = generator(pair, tokenizer, STATIC)
    packed = generator(pair, tokenizer, SessionLimits())
    assert static.verifier.static is not None and static.drafter.static is not None
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        reference = packed.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids
        assert len(set(reference)) > 6
        for policy in ("none", "static:1", "static:4", "heuristic:2"):
            result = static.generate(ids, sampling, SpeculationConfig(policy=policy))
            assert result.token_ids == reference, (prompt, policy)
    runner = static.verifier.static
    assert runner.steps and all(bucket.sessions <= 4 for bucket in runner.steps)  # the static steps ran
    assert static.drafter.static.steps
    assert sorted(runner._free) == list(range(runner.caches.slots))  # every slot back


def test_more_sessions_than_slots_each_get_their_solo_tokens(pair, tokenizer):
    static = generator(pair, tokenizer, STATIC)
    sampling = SamplingParams(max_new_tokens=20, ignore_eos=True)
    jobs = [(tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"], policy)
            for i, policy in enumerate(["none", "static:4", "heuristic:2", "static:2"] * 2)]
    solo = [static.generate(ids, sampling, SpeculationConfig(policy=policy)).token_ids for ids, policy in jobs]
    assert generate_at_once(static, jobs, sampling) == solo
    assert sorted(static.verifier.static._free) == list(range(static.verifier.static.caches.slots))


def test_a_seeded_sample_is_the_same_alone_and_under_load_on_the_static_path(pair, tokenizer):
    static = generator(pair, tokenizer, STATIC)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    alone = static.generate(ids, sampling, SpeculationConfig(policy="static:3")).token_ids
    jobs = [(ids, "static:3")] + [(tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"], "static:2") for i in range(1, 4)]
    assert generate_at_once(static, jobs, sampling)[0] == alone


def test_a_session_whose_reservation_does_not_fit_a_slot_takes_the_packed_path(pair, tokenizer):
    target, _ = pair
    engine = TargetEngine(target, SessionLimits(static_slots=2, static_capacity=64))
    from disco.config import SamplingParams as Params

    engine.start_session("long", list(range(1, 30)), Params(max_new_tokens=30))
    engine.start_session("short", [1, 2, 3], Params(max_new_tokens=8))
    assert engine.sessions.get("long").sequence.cache.slot is None
    assert engine.sessions.get("short").sequence.cache.slot is not None
    engine.end_session("short")
    assert sorted(engine.static._free) == [0, 1]
