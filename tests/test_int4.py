"""The int4 weight-only engine (``--dtype int4``, the draft's engine under ``--dtype auto``
on AVX2 CPUs): the kernel's layout and row invariance, the dense prefill path, greedy
exactness of speculation with an int4 draft, and the quantized cache."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from disco.config import ModelConfig, SamplingParams, SpeculationConfig
from disco.models import quantize
from disco.models.int4 import Int4Linear, group_size_for, quantize_weight_int4
from disco.models.loading import load_model, quantized_folder
from disco.models.quantize import Int8Linear, quantize_model
from disco.models.weight_only import dense_prefill
from tests.helpers import PROMPTS, local_generator

POLICIES = ("static:1", "static:4", "heuristic:2", "confidence:0.4")
LONG_PROMPT = "def add(a, b):\n    return a + b\n\n" * 6 + "class Stack:\n    def push(self, item):\n"


@pytest.mark.parametrize("in_features, group", [(64, 32), (96, 32), (896, 32)])
def test_int4_linear_matches_its_dequantized_weight_and_rows_are_independent(in_features, group):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 80, bias=True)
    module = Int4Linear.from_weight(linear.weight, linear.bias)
    assert module.group_size == group == group_size_for(in_features)
    x = torch.randn(12, in_features, dtype=torch.bfloat16)  # [rows, in_features]
    out = module(x)
    assert out.shape == (12, 80) and out.dtype == torch.bfloat16
    expected = x.float() @ module.dequantized().T + module.bias.float()
    assert torch.allclose(out.float(), expected, atol=0.03, rtol=0.02)  # the kernel reads the layout we wrote
    for i in range(12):  # row invariance: what bit-exact drafting alone and batched relies on
        assert torch.equal(out[i], module(x[i:i + 1])[0])
    with dense_prefill([(2, 9)]):  # a prefill span: a float32 GEMM over the same weights
        mixed = module(x)
    assert torch.equal(mixed[:2], out[:2]) and torch.equal(mixed[9:], out[9:])
    assert torch.allclose(mixed[2:9].float(), expected[2:9], atol=0.03, rtol=0.02)


def test_int4_quantization_is_within_half_a_step_per_group():
    torch.manual_seed(1)
    weight = torch.randn(16, 128)
    weight[3, :64] = 0.25  # a constant group
    q, scales, zeros = quantize_weight_int4(weight, 64)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scales.shape == zeros.shape == (16, 2)
    deq = (q.float().view(16, 2, 64) - 8) * scales.float()[..., None] + zeros.float()[..., None]
    step = scales.float()[..., None]
    assert torch.all((deq - weight.view(16, 2, 64)).abs() <= step / 2 + 1e-2 * weight.abs().view(16, 2, 64) + 1e-6)


def test_shapes_int4_cannot_take_stay_int8():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 30), torch.nn.Linear(30, 16))
    quantize_model(model, lm_head=False, engine="int4")
    assert [type(m) for m in model] == [Int4Linear, Int8Linear, Int8Linear]  # 30 outputs; 30 inputs


@pytest.mark.parametrize("draft_kind", ["same", "noisy"])
def test_speculation_with_an_int4_draft_is_greedy_exact(target_model, drafts, tokenizer, draft_kind):
    """An int8 target with an int4 draft (the ``auto`` pair on AVX2) gives the int8 target's
    own greedy output, whatever the draft proposes."""
    int8_target = quantize_model(copy.deepcopy(target_model))
    source = target_model if draft_kind == "same" else drafts["noisy"]
    int4_draft = quantize_model(copy.deepcopy(source), engine="int4")
    assert any(isinstance(m, Int4Linear) for m in int4_draft.modules())
    sampling = SamplingParams(max_new_tokens=32, ignore_eos=True)
    accepted = 0
    for prompt in (PROMPTS[0], LONG_PROMPT):
        prompt_ids = tokenizer(prompt)["input_ids"]
        reference = local_generator(int8_target, None, tokenizer).generate(
            prompt_ids, sampling, SpeculationConfig(policy="none")).token_ids
        assert len(set(reference)) > 8
        for policy in POLICIES:
            result = local_generator(int8_target, int4_draft, tokenizer).generate(
                prompt_ids, sampling, SpeculationConfig(policy=policy))
            assert result.token_ids == reference, (draft_kind, policy, prompt)
            accepted += result.stats.accepted_tokens
    assert accepted > 0  # the int4 draft does get tokens accepted


def test_int4_load_is_cached_apart_from_int8(tiny_pair_dirs, tmp_path, monkeypatch):
    config = ModelConfig(spec=str(tiny_pair_dirs["draft"]), dtype="int4")
    first = load_model(config, "draft", tmp_path, progress=False)
    assert first.engine == "int4" and any(isinstance(m, Int4Linear) for m in first.model.modules())
    folder = quantized_folder(tmp_path, first.name, first.fingerprint, engine="int4")
    manifest = json.loads((folder / quantize.MANIFEST_FILE).read_text())
    assert manifest["format"] == quantize.QUANT_FORMATS["int4"]
    assert folder != quantized_folder(tmp_path, first.name, first.fingerprint, engine="int8")

    def no_requantizing(*_args, **_kwargs):
        raise AssertionError("the second load must read the cache, not quantize again")

    monkeypatch.setattr(quantize, "quantize_model", no_requantizing)
    second = load_model(config, "draft", tmp_path, progress=False)
    ids = torch.tensor([[5, 9, 33, 2, 7]])
    with torch.inference_mode():
        assert torch.equal(first.model(input_ids=ids).logits, second.model(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gemms_in_either_dtype_multiply_by_the_layers_weights(dtype):
    """A prefill span's dense GEMM (float32, or bf16 where the CPU measures it faster)
    computes with the layer's own weights; the choice is made at load for every layer."""
    from disco.models.weight_only import choose_dense_dtype  # noqa: PLC0415

    torch.manual_seed(3)
    module = Int4Linear.from_weight(torch.randn(608, 256) * 0.05, torch.randn(608) * 0.01)  # 2 slices of 512
    module.dense_dtype = dtype
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    with dense_prefill([(0, 64)]):
        out = module(x)
    expected = x.float() @ module.dequantized().T + module.bias.float()
    assert torch.allclose(out.float(), expected, atol=0.02 * float(expected.abs().max()), rtol=0.02)
    with dense_prefill([(0, 64)]):
        assert torch.equal(module(x)[:32], module(x)[:32])  # the same span gives the same bits
    model = torch.nn.Sequential(module, Int4Linear.from_weight(torch.randn(256, 608) * 0.05))
    line = choose_dense_dtype(model)
    assert line.startswith("prefill GEMMs in ") and len({m.dense_dtype for m in model}) == 1
    assert str(model[0].dense_dtype).removeprefix("torch.") in line
