"""Property tests: a batched forward computes what each session computes alone.

Random mixes of 2-8 sessions (prompt lengths 1-40, one prompt a prefix of another,
blocks of 1-8 tokens, sessions joining and leaving between steps) on the tiny models, in
float32 (within 1e-4) and in bfloat16 (bit for bit). bfloat16 is the sensitive case: a
padded batch (the earlier design) differed from the solo forward by ~1e-5 in float32,
which never flips a token, but by several ulps per layer in bf16 — so the float32-only
tests passed while the bf16 default produced other tokens under load (issue 17).
"""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.draft import DraftEngine
from disco.engines.kv import CachedSequence
from disco.engines.target import TargetEngine
from disco.interfaces import DraftToken, Feedback
from disco.models.quantize import quantize_model
from disco.models.row_stable import RowPlan, RowStableLinear, cancelling_inputs, stabilize
from disco.models.weight_only import DENSE_MIN_ROWS, WeightOnlyLinear, dense_prefill
from disco.speculation.policies import PolicyFactory

VOCAB = 512


def _cast(model: torch.nn.Module, dtype: torch.dtype | str) -> torch.nn.Module:
    if dtype == "int8":  # the int8 weight-only engine (bf16 activations, dense long prefills)
        return quantize_model(copy.deepcopy(model))
    if dtype == torch.float32:
        return model
    cast = copy.deepcopy(model).to(dtype)
    stabilize(cast)  # as the loader does: raw bf16 linears are not row-invariant on every CPU (AVX-512 without BF16)
    return cast


def _assert_same(batched: torch.Tensor, alone: torch.Tensor, dtype: torch.dtype | str) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(batched, alone), (batched - alone).abs().max()
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))


#: Rows of the largest packed call the reproduction of issue 32 issues (16 sessions x 5 tokens).
LARGEST_CALL = 80


def _assert_rows_keep_their_bits(linear: torch.nn.Module, rows: torch.Tensor, label) -> None:
    """Every call of 1 .. len(rows) rows gives each row the bits it gets alone."""
    with torch.inference_mode():
        alone = torch.cat([linear(rows[i: i + 1]) for i in range(rows.shape[0])])
        for count in range(2, rows.shape[0] + 1):
            assert torch.equal(linear(rows[:count]), alone[:count]), (label, count)
        assert torch.equal(linear(rows[:6].reshape(2, 3, -1)).reshape(6, -1), alone[:6])  # [batch, seq, in]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(384, 256, True), (256, 1536, True), (64, 2048, True),
                                   (64, 64, False), (32, 64, True), (16, 64, True), (512, 64, False)])
def test_the_engines_linears_give_each_row_the_same_bits_whatever_the_rows(dtype, shape):
    """The property packed batching and exact verification rely on in low precision, for
    the linears as the engine loads them (disco.models.row_stable), at every row count up to the
    largest packed call, on inputs whose results are pure summation rounding (random inputs
    hide a different order behind bf16 rounding: issue 32). The shapes include the tiny
    models' (on Zen 4, out 32 / 16 x in 64 switch paths at 3 / 5 rows) and a long input
    (AMX's one-row path sums differently)."""
    out_features, in_features, bias = shape
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias)).to(dtype)
    rows, weight, bias_values = cancelling_inputs(LARGEST_CALL, out_features, in_features, dtype, seed=1)
    with torch.no_grad():
        model[0].weight.copy_(weight)
        if bias:
            model[0].bias.copy_(bias_values)
    verdict = stabilize(model)
    assert "near-ties may flip" not in verdict, verdict
    _assert_rows_keep_their_bits(model[0], rows.to(dtype), (shape, verdict))


def test_the_default_engines_loaded_linears_give_each_row_its_bits_at_every_row_count(default_engine):
    """Each low-precision linear of the tiny pair as the services load it (``--dtype auto``
    here), given weights of its own shape that show any summation order, keeps a row's
    bits in every call of 1-80 rows."""
    for role, loaded in default_engine.items():
        checked = 0
        for name, module in loaded.model.named_modules():
            if isinstance(module, WeightOnlyLinear):
                dtype = module.compute_dtype
            elif isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
                dtype = module.weight.dtype
            else:
                continue
            rows, weight, bias = cancelling_inputs(LARGEST_CALL, module.out_features, module.in_features, dtype)
            if isinstance(module, WeightOnlyLinear):
                probe = type(module).from_weight(weight, bias if module.bias is not None else None, dtype)
                probe.row_plan = module.row_plan
            else:
                probe = copy.deepcopy(module)
                with torch.no_grad():
                    probe.weight.copy_(weight)
                    if probe.bias is not None:
                        probe.bias.copy_(bias)
            _assert_rows_keep_their_bits(probe, rows.to(dtype), (role, loaded.engine, name))
            checked += 1
        assert checked, f"the {role} ({loaded.engine}) has no low-precision linear"


def test_a_row_plan_cuts_calls_into_its_row_range():
    calls = []
    weight = torch.randn(8, 4)

    def record(rows):
        calls.append(rows.shape[0])
        return rows @ weight.T

    rows = torch.randn(11, 4)
    plan = RowPlan(min_rows=2, max_rows=4)
    assert torch.allclose(plan.run(rows, record), rows @ weight.T) and calls == [4, 4, 3]
    calls.clear()
    assert torch.allclose(plan.run(rows[:1], record), rows[:1] @ weight.T)
    assert calls == [2]  # one row gets a zero row added
    calls.clear()
    plan.run(rows[:9], record)
    assert calls == [4, 4, 2]  # a last chunk of one row too
    calls.clear()
    RowPlan(min_rows=4, max_rows=8).run(rows, record)
    assert calls == [8, 4]  # a last chunk of 3 rows gets one zero row


def test_row_stable_linears_multiply_a_long_prefill_block_in_one_call_of_its_own_rows():
    """A prefill span (disco.models.weight_only) is one plain call of exactly its rows: its bits
    depend on the block alone (same cache solo and batched) and the weights are read once;
    the rows around it (decoding, verification, short prefills) keep the row-stable calls."""
    linear = torch.nn.Linear(4, 8)
    linear.__class__, linear.row_plan = RowStableLinear, RowPlan(min_rows=2, max_rows=4)
    rows = torch.randn(3 + DENSE_MIN_ROWS + 5, 4)
    calls = []
    original = torch.nn.functional.linear

    def record(x, w, b):
        calls.append(x.shape[0])
        return original(x, w, b)

    torch.nn.functional.linear = record
    try:
        with torch.inference_mode(), dense_prefill([(3, 3 + DENSE_MIN_ROWS)]):
            out = linear(rows)
    finally:
        torch.nn.functional.linear = original
    assert calls == [3, DENSE_MIN_ROWS, 4, 1 + 1]  # the last chunk of one row gets a zero row
    with torch.inference_mode():
        assert torch.equal(out[3: 3 + DENSE_MIN_ROWS], original(rows[3: 3 + DENSE_MIN_ROWS], linear.weight, linear.bias))
        torch.testing.assert_close(out, original(rows, linear.weight, linear.bias))


class _Shadow:
    """A session run twice: in the batch, and alone (the reference)."""

    def __init__(self, model: torch.nn.Module, prompt: list[int]) -> None:
        self.batched = CachedSequence(model, prompt)
        self.alone = CachedSequence(model, prompt)
        self.prefilled = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("seed", range(4))
def test_random_session_mixes_equal_solo_forwards(target_model, dtype, seed):
    model = _cast(target_model, dtype)
    rng = random.Random(seed)
    base_prompt = [rng.randrange(1, VOCAB) for _ in range(30 if dtype != "int8" else 2 * DENSE_MIN_ROWS)]
    live: list[_Shadow] = []
    for step in range(10):
        # Sessions leave and join between steps; one new prompt is a prefix of another.
        live = [s for s in live if rng.random() > 0.2]
        while len(live) < 2 or (len(live) < 8 and rng.random() < 0.5):
            longest = len(base_prompt)  # int8: prefills past DENSE_MIN_ROWS take the dense GEMM
            prompt = (base_prompt[: rng.randint(1, longest)] if rng.random() < 0.4
                      else [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, longest + 10))])
            live.append(_Shadow(model, prompt))
        batch, num_logits = [], []
        for shadow in live:
            if not shadow.prefilled and len(shadow.batched.tokens) > 1 and rng.random() < 0.5:
                num_logits.append(0)  # a prefill in the same batch as decoding steps
            else:
                block = [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 7))]
                for sequence in (shadow.batched, shadow.alone):
                    sequence.tokens.extend(block)
                num_logits.append(rng.randint(1, len(block) + 1))
            batch.append(shadow)
        results = CachedSequence.forward_batch([s.batched for s in batch], num_logits, [False] * len(batch))
        for shadow, count, (logits, _) in zip(batch, num_logits, results):
            if count == 0:
                shadow.alone.prefill()
            else:
                _assert_same(logits, shadow.alone.forward(count)[0], dtype)
            shadow.prefilled = True
            assert shadow.batched.cache_len == shadow.alone.cache_len == shadow.batched.cache.get_seq_length()
            # A verification keeps an accepted prefix: both copies roll back alike.
            keep = rng.randint(max(1, shadow.alone.cache_len - 8), shadow.alone.cache_len)
            bonus = rng.randrange(1, VOCAB)
            for sequence in (shadow.batched, shadow.alone):
                sequence.truncate(keep)
                sequence.tokens.append(bonus)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_block_equals_token_by_token_decoding(target_model, dtype):
    """Without this, speculation changes bf16 output even with no other session around."""
    model = _cast(target_model, dtype)
    rng = random.Random(7)
    for _ in range(6):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
        block = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))]
        verifying = CachedSequence(model, prompt)
        verifying.prefill()
        verifying.tokens.extend(block)
        block_logits, _ = verifying.forward(len(block) + 1)  # [k + 1, vocab]
        decoding = CachedSequence(model, prompt)
        decoding.prefill()
        steps = []
        for token in [None, *block]:
            if token is not None:
                decoding.tokens.append(token)
            steps.append(decoding.forward(1)[0][0])
        _assert_same(block_logits, torch.stack(steps), dtype)


def _all_at_once(run, engine, count: int) -> list:
    """``run(engine, i, barrier)`` for i < count on as many threads, stepping together."""
    barrier = threading.Barrier(count)
    results: list = [None] * count
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(engine, i, barrier)))
               for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def _verify_script(seed: int, steps: int = 6) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 35))]
    return prompt, [[rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 8))] for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concurrent_target_verifications_equal_each_session_alone(target_model, dtype):
    """Engine level, real threads: 8 sessions verify random blocks at once; each verdict
    (accepted count, bonus token) equals the same session's verdicts run alone."""
    model = _cast(target_model, dtype)
    scripts = [_verify_script(seed) for seed in range(8)]
    sampling = SamplingParams(max_new_tokens=64)

    def run(engine: TargetEngine, index: int, barrier: threading.Barrier | None) -> list[tuple[int, int]]:
        prompt, blocks = scripts[index]
        session = f"s{index}"
        engine.start_session(session, prompt, sampling)
        verdicts = []
        for block in blocks:
            if barrier is not None:
                barrier.wait()
            verdict = engine.verify(session, block, None)
            verdicts.append((verdict.num_accepted, verdict.next_token_id))
        engine.end_session(session)
        return verdicts

    alone = [run(TargetEngine(model), i, None) for i in range(len(scripts))]
    engine = TargetEngine(model)
    together = _all_at_once(run, engine, len(scripts))
    assert together == alone
    assert max(engine.batcher.batch_sizes) > 1, "the verifications were never batched"
    assert engine.active_sessions() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concurrent_drafting_equals_each_session_alone(drafts, dtype):
    """Draft side: 8 sessions draft blocks at once (feedback in between); every draft token
    and its probability equal the same session drafting alone."""
    model = _cast(drafts["noisy"], dtype)
    scripts = [_verify_script(seed + 100) for seed in range(8)]
    sampling = SamplingParams(max_new_tokens=64)

    def run(engine: DraftEngine, index: int, barrier: threading.Barrier | None) -> list[tuple[int, float]]:
        prompt, blocks = scripts[index]
        session = f"d{index}"
        engine.start_session(session, prompt, sampling, f"static:{1 + index % 5}")
        drafted, feedback = [], None
        for step, block in enumerate(blocks):
            if barrier is not None:
                barrier.wait()
            tokens = [e for e in engine.draft(session, feedback, 8) if isinstance(e, DraftToken)]
            drafted.extend((t.token_id, t.draft_prob) for t in tokens)
            feedback = Feedback(num_accepted=step % (len(tokens) + 1), next_token_id=block[0] if block else 3)
        engine.end_session(session)
        return drafted

    alone = [run(DraftEngine(model, PolicyFactory()), i, None) for i in range(len(scripts))]
    engine = DraftEngine(model, PolicyFactory())
    together = _all_at_once(run, engine, len(scripts))
    for got, expected in zip(together, alone):
        assert [t for t, _ in got] == [t for t, _ in expected]
        if dtype == torch.float32:
            assert [p for _, p in got] == pytest.approx([p for _, p in expected], abs=1e-5)
        else:
            assert got == expected
    assert max(engine.batcher.batch_sizes) > 1, "the drafting steps were never batched"
    assert engine.active_sessions() == 0


@pytest.mark.parametrize("draft_kind", ["random", "noisy"])
def test_bf16_speculative_output_equals_bf16_target_only(target_model, drafts, tokenizer, draft_kind):
    """Consequence of the two properties above: in bf16 too, every policy's greedy output is
    the target-only output, token for token (on CPUs with row-invariant bf16 linears)."""
    from tests.helpers import PROMPTS, local_generator  # noqa: PLC0415

    target = _cast(target_model, torch.bfloat16)
    draft = _cast(drafts[draft_kind], torch.bfloat16)
    generator = local_generator(target, draft, tokenizer)
    sampling = SamplingParams(max_new_tokens=32, ignore_eos=True)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        reference = generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids
        assert len(set(reference)) > 5  # varied output: a repeated token would hide errors
        for policy in ("static:1", "static:4", "static:8", "heuristic:2", "confidence:0.4"):
            assert generator.generate(ids, sampling, SpeculationConfig(policy=policy)).token_ids == reference, policy
