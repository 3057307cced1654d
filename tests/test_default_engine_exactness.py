"""Concurrent sessions at the services' default engine get exactly what each gets alone.

Issue 32: on an AVX-512-BF16 CPU (AMD Zen 4, no AMX) the default engine is bf16 for the
target, and 16 concurrent copies of one prompt through the services got other tokens than
target-only alone (first wrong token at 26): the bf16 linears take another path for a
one-row call than for a call of several rows, and a probe on random inputs did not see
it. These tests run what the reproduction runs — 16 sessions of one prompt, blocks of 1-5
tokens, the model loaded as the services load it (``--dtype auto``, their thread count) —
so they reach the row counts the reproduction reaches, on whatever CPU runs them.
"""

from __future__ import annotations

import random

import pytest
import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.kv import CachedSequence
from disco.engines.packed_forward import describe_forward, lean_decoder_for, supports_packing
from disco.engines.batching import ForwardBatcher
from disco.engines.packing_proof import PackingVerdict, prove_packing, verdict_for
from disco.models import q4q8
from tests.helpers import generate_at_once, local_generator

SESSIONS = 16
PROMPT = "import sys\n"
PROMPTS = ("def add(a, b):", "class Node:", PROMPT, "for x in data:")


def test_sixteen_sessions_of_one_prompt_get_their_solo_logits_bit_for_bit(default_engine, tokenizer):
    """Engine level: 16 sessions of one prompt, prefilled together, then rounds of blocks of
    1-5 tokens (verifications), all in packed forwards, against the same sessions alone."""
    model = default_engine["target"].model
    assert supports_packing(model)
    if default_engine["target"].kernel in q4q8.KERNELS:  # these rounds run the layer loop in C++ (native_loop)
        assert lean_decoder_for(model).native is not None
    prompt = tokenizer(PROMPT)["input_ids"]
    rng = random.Random(0)
    batched = [CachedSequence(model, prompt) for _ in range(SESSIONS)]
    alone = [CachedSequence(model, prompt) for _ in range(SESSIONS)]
    CachedSequence.forward_batch(batched, [0] * SESSIONS, [False] * SESSIONS)
    for sequence in alone:
        sequence.prefill()
    for _ in range(4):
        for index in range(SESSIONS):
            block = [rng.randrange(1, 512) for _ in range(index % 5)]  # a verification of 0-4 draft tokens
            batched[index].tokens.extend(block)
            alone[index].tokens.extend(block)
        counts = [batched[index].num_pending for index in range(SESSIONS)]
        results = CachedSequence.forward_batch(batched, counts, [False] * SESSIONS)
        for index, ((logits, _), count) in enumerate(zip(results, counts)):
            expected, _ = alone[index].forward(count)
            assert torch.equal(logits, expected), (default_engine["target"].engine, index, count)
        for sequence in (*batched, *alone):  # a bonus token for the next round
            sequence.tokens.append(7)


@pytest.mark.parametrize("policy", ["none", "static:4", "heuristic:3"])
def test_sixteen_concurrent_copies_of_one_prompt_equal_target_only_alone(default_engine, tokenizer, policy):
    """The reproduction's rounds in process: 16 concurrent requests (4 prompts, and 16 copies
    of one), each equal to target-only alone; the forwards were batched."""
    target, draft = default_engine["target"].model, default_engine["draft"].model
    generator = local_generator(target, draft, tokenizer)
    sampling = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ids = {prompt: tokenizer(prompt)["input_ids"] for prompt in PROMPTS}
    expected = {prompt: generator.generate(ids[prompt], sampling, SpeculationConfig(policy="none")).token_ids
                for prompt in PROMPTS}
    assert all(len(set(tokens)) > 5 for tokens in expected.values())  # varied output
    prompts = [PROMPT] * SESSIONS if policy == "heuristic:3" else [PROMPTS[i % 4] for i in range(SESSIONS)]
    generator.verifier.batcher.batch_sizes.clear()
    results = generate_at_once(generator, [(ids[prompt], policy) for prompt in prompts], sampling)
    wrong = [(prompt, next((i for i, (a, b) in enumerate(zip(got or [], expected[prompt])) if a != b), None))
             for prompt, got in zip(prompts, results) if got != expected[prompt]]
    assert not wrong, f"{len(wrong)}/{SESSIONS} differ from target-only ({default_engine['target'].engine}): {wrong[:3]}"
    assert max(generator.verifier.batcher.batch_sizes) > 1, "the forwards were never batched"


def test_the_default_engine_proves_its_packed_forward_at_load(default_engine):
    """What the services report: their batchers ran the proof and batch only where it held."""
    for loaded in default_engine.values():
        verdict = prove_packing(loaded.model, SESSIONS)
        assert verdict.packed, verdict.detail
        assert "proven bit for bit" in verdict.detail or loaded.engine == "float32"


def test_a_model_is_proven_once_per_batch_size_and_its_batchers_reuse_the_verdict(target_model, monkeypatch):
    """A service proves at load, under the machine lock; its engine's batcher must not prove again."""
    import copy  # noqa: PLC0415

    from disco.engines import packing_proof  # noqa: PLC0415

    model = copy.deepcopy(target_model).to(torch.bfloat16)
    verdict = verdict_for(model, SESSIONS)
    monkeypatch.setattr(packing_proof, "prove_packing", lambda *args: pytest.fail("proved twice"))
    assert verdict_for(model, SESSIONS) is verdict
    assert ForwardBatcher(model, SESSIONS).verdict is verdict
    monkeypatch.undo()
    copied = copy.deepcopy(model)  # carries the cache along, but is another model: proves itself
    copied.model.layers[0].mlp.down_proj = _RowCountDependent(copied.model.layers[0].mlp.down_proj)
    assert not verdict_for(copied, SESSIONS).packed and verdict_for(model, SESSIONS) is verdict


class _RowCountDependent(torch.nn.Module):
    """A linear whose result depends on the rows of the call (what a kernel path switch does)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return out * (1 + 2 ** -6) if rows > 8 else out


def test_a_packed_forward_that_changes_bits_turns_batching_off(target_model, tokenizer):
    """Where the proof fails, the engine runs forwards one by one and says so: output stays exact."""
    import copy  # noqa: PLC0415

    model = copy.deepcopy(target_model).to(torch.bfloat16)
    layer = model.model.layers[0].mlp
    layer.down_proj = _RowCountDependent(layer.down_proj)
    verdict = prove_packing(model, SESSIONS)
    assert verdict == PackingVerdict(False, verdict.detail) and verdict.detail.startswith("one by one")
    generator = local_generator(model, None, tokenizer)
    assert not generator.verifier.batcher.packed and generator.verifier.batcher.max_batch == 1
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ids = tokenizer(PROMPT)["input_ids"]
    expected = generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids
    assert generate_at_once(generator, [(ids, "none")] * 4, sampling) == [expected] * 4
    assert set(generator.verifier.batcher.batch_sizes) == {1}


def test_the_services_name_how_their_forwards_batch_in_info_and_metrics(default_engine, target_model, tokenizer):
    """``Info.batching`` and ``disco_forward_batching_packed`` / ``_info``: packed where the
    proof held (the default engine here), one by one where it did not; ``Info.forward`` and
    ``disco_forward_info``: what runs the forwards."""
    import copy  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    import grpc  # noqa: PLC0415

    import target_service.server  # noqa: PLC0415
    from protos.disco.v1 import common_pb2, target_pb2_grpc  # noqa: PLC0415
    from protos.runtime.metrics import sample_value  # noqa: PLC0415

    broken = copy.deepcopy(target_model).to(torch.bfloat16)
    broken.model.layers[0].mlp.down_proj = _RowCountDependent(broken.model.layers[0].mlp.down_proj)
    broken_loaded = type(default_engine["target"])(
        model=broken, tokenizer=tokenizer, name="tiny-broken", fingerprint="x", tokenizer_hash="x",
        vocab_size=int(broken.config.vocab_size), eos_token_ids=(0,))
    for loaded, packed in ((default_engine["target"], True), (broken_loaded, False)):
        running = target_service.server.serve(loaded, metrics_port=0)
        try:
            with grpc.insecure_channel(running.address) as channel:
                info = target_pb2_grpc.TargetServiceStub(channel).Info(common_pb2.ServiceInfoRequest(), timeout=10)
            assert info.batching.startswith("packed" if packed else "one by one"), info.batching
            with urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=10) as page:
                text = page.read().decode()
            assert sample_value(text, "disco_forward_batching_packed") == float(packed)
            assert sample_value(text, "disco_forward_batching_info", {"detail": info.batching}) == 1
            # What runs its forwards (Info.forward, disco_forward_info): the start-up log's line.
            assert info.forward == describe_forward(loaded.model) and info.forward.startswith(("lean decoder", "the HF"))
            assert sample_value(text, "disco_forward_info", {"forward": info.forward}) == 1
            if loaded.kernel in q4q8.KERNELS:
                assert "layer loop in C++" in info.forward
        finally:
            running.stop(0)
