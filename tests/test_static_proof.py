"""The static path's start-up proof (issue 49, item 4): it runs through the runner as it serves,
turns the path off where the static step changes bits, and the engine's Info / metrics lines
describe the path that serves."""

from __future__ import annotations

import pytest
import torch

from disco.engines import static_step
from disco.engines.batching import ForwardBatcher
from disco.engines.kv import CachedSequence
from disco.engines.packing_proof import Exactness, exactness_for
from disco.engines.sessions import SessionLimits
from disco.engines.static_proof import prove_static, serving_exactness
from disco.engines.static_runner import static_runner_for
from disco.engines.target import TargetEngine
from disco.models import row_stable
from tests import tiny


@pytest.fixture(scope="module")
def bf16_model() -> torch.nn.Module:
    """bf16 under the CPU's row plans: the static step gives the packed forward's bits."""
    model = tiny.qwen2(11).to(torch.bfloat16)
    row_stable.stabilize(model)
    return model


def test_the_proof_runs_through_the_runner_and_leaves_every_slot_free(bf16_model):
    runner = static_runner_for(bf16_model, 4, 128, "test")
    ForwardBatcher(bf16_model, 4, static=runner)  # the verdict gates the path, the proof runs
    assert runner.refused is None and runner.proof.batching_exact and runner.proof.decoding_exact
    assert "checked bit for bit at start" in runner.describe() and "3 sessions in a bucket" in runner.describe()
    assert {bucket.sessions for bucket in runner.steps} >= {1, 4}  # one session and a bucket with padding
    assert sorted(runner._free) == [0, 1, 2, 3] and not runner._owners
    assert list(runner.caches.lengths) == [0, 0, 0, 0]


def test_a_static_step_that_changes_a_batched_session_s_bits_turns_the_path_off(bf16_model, monkeypatch):
    compute = static_step.StaticStep.compute

    def nudged(self):  # a kernel whose bits depend on the bucket: a session batched with others changes
        logits = compute(self)
        return logits + 1e-2 if self.bucket.sessions > 1 else logits

    monkeypatch.setattr(static_step.StaticStep, "compute", nudged)
    runner = static_runner_for(bf16_model, 4, 128, "test")
    batcher = ForwardBatcher(bf16_model, 4, static=runner)
    assert not runner.proof.batching_exact
    assert runner.refused.startswith("its start-up proof failed: ") and "in one bucket" in runner.refused
    assert "static path (eager): off: its start-up proof failed" in batcher.describe()
    sequence = CachedSequence(bf16_model, [5, 6, 7], capacity=64)
    assert not runner.acquire(sequence, 8) and sequence.cache.slot is None  # the packed path serves
    exactness = Exactness(True, "bit-exact on cpu")
    assert serving_exactness(exactness, runner) == exactness  # the path that serves is the packed one


def test_a_static_step_whose_blocks_differ_from_decoding_is_not_proven(bf16_model, monkeypatch):
    compute = static_step.StaticStep.compute

    def nudged(self):  # blocks of several tokens give other bits than one-token steps
        logits = compute(self)
        return logits + 1e-2 if self.bucket.block > 1 else logits

    monkeypatch.setattr(static_step.StaticStep, "compute", nudged)
    runner = static_runner_for(bf16_model, 4, 128, "test")
    proof = prove_static(_lifted(runner))
    assert not proof.decoding_exact and "differ from decoding" in proof.detail
    assert not proof.batching_exact  # the same blocks differ from the packed path's too: off


def _lifted(runner):
    runner.refused = None  # what gate does before proving
    return runner


def test_a_float32_model_serves_on_the_static_path_and_says_what_was_checked():
    """float32 GEMMs are not row-invariant on every CPU (~1e-6): exempt from the batching checks
    as on the packed path, and the decoding check is stated, not hidden."""
    model = tiny.qwen2(11)
    engine = TargetEngine(model, SessionLimits(static_slots=4, static_capacity=256))
    assert engine.static.refused is None and engine.static.proof.batching_exact
    line = engine.batcher.describe()
    assert line.startswith(engine.batcher.verdict.detail) and "static path (eager): checked bit for bit" in line
    exactness = serving_exactness(exactness_for(model), engine.static)
    if engine.static.proof.decoding_exact:
        assert exactness.statement.endswith("on the static path too (checked at start)")
    else:
        assert not exactness.proven and "the static path: " in exactness.statement


def test_an_engine_without_a_static_path_describes_its_batching_as_before(bf16_model):
    engine = TargetEngine(bf16_model, SessionLimits())
    assert engine.static is None and engine.batcher.describe() == engine.batcher.verdict.detail
    exactness = exactness_for(bf16_model)
    assert serving_exactness(exactness, None) == exactness
