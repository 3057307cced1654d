"""The lean decode path (:mod:`disco.engines.lean_decoder`): the packed forward's decoder as a
plain loop gives the HF forward's logits bit for bit — float32, bf16 and the q4 x q8 int4
engine with fused projections; decoding, verification blocks, long (dense) prefills and
packed batches — and falls back to the HF forward where it cannot promise that."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import pytest
import torch

from disco.engines import lean_decoder
from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward, supports_packing
from disco.engines.kv_pool import PoolCache
from disco.models import q4q8, row_stable
from disco.models.int4 import Int4Linear
from disco.models.quantize import quantize_model
from tests import tiny

HOME = Path(os.environ.get("DISCO_HOME", "/tmp/disco_q4q8_tests"))


def prepared(model: torch.nn.Module) -> torch.nn.Module:
    assert supports_packing(model)
    return model


def run(model: torch.nn.Module, lean, prompts: list[list[int]], blocks: list[int], steps: int = 3
        ) -> list[torch.Tensor]:
    """Prefill every prompt together (one packed forward), then ``steps`` packed forwards in
    which session i feeds a block of ``blocks[i]`` tokens (kept: the caches grow). Returns
    every logits tensor, in order."""
    caches = [PoolCache.for_model(model, len(p) + steps * max(blocks) + 1) for p in prompts]
    lengths = [len(p) - 1 for p in prompts]
    outputs = [logits for logits, _ in packed_forward(
        model, [SessionRows(cache, 0, p[:-1], 0) for cache, p in zip(caches, prompts)], lean=lean)]
    pending = [[p[-1]] for p in prompts]
    for step in range(steps):
        rows = []
        for index, (cache, block) in enumerate(zip(caches, blocks)):
            tokens = pending[index] + [(7 * step + 13 * index + j) % 500 + 1 for j in range(block - 1)]
            rows.append(SessionRows(cache, lengths[index], tokens, len(tokens)))
        for index, (logits, _) in enumerate(packed_forward(model, rows, lean=lean)):
            outputs.append(logits)
            lengths[index] += len(rows[index].tokens)
            pending[index] = [int(logits[-1].argmax())]
    return outputs


def assert_same(model: torch.nn.Module, prompts: list[list[int]], blocks: list[int]) -> lean_decoder.LeanDecoder:
    lean = lean_decoder_for(model)
    assert lean is not None
    got, expected = run(model, lean, prompts, blocks), run(model, False, prompts, blocks)
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), index
    return lean


PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 77], [9] * 11]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_lean_forward_gives_the_hf_bits(family, dtype):
    """Alone and packed, decoding (blocks of 1) and verification (blocks of 3 and 5)."""
    model = prepared((tiny.qwen2(0) if family == "qwen2" else tiny.llama(0)).to(dtype))
    assert_same(model, PROMPTS[:1], [1])
    assert_same(model, PROMPTS, [1, 3, 5])


def test_a_long_prefill_block_takes_the_separate_layers():
    """A prefill of at least DENSE_MIN_ROWS tokens (dense spans) packed with a decoding row."""
    model = prepared(tiny.qwen2(1).to(torch.bfloat16))
    assert_same(model, [list(range(1, 70)), PROMPTS[1]], [1, 2])


@pytest.fixture(scope="module")
def ops():
    if not q4q8.cpu_supports():
        pytest.skip("the CPU has neither AVX-512 VNNI nor AVX2")
    why_not = q4q8.load(HOME)
    if why_not is not None:
        pytest.skip(why_not)


def q4q8_model(seed: int) -> torch.nn.Module:
    model = quantize_model(tiny.qwen2(seed), engine="int4")
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.use_kernel(q4q8.loaded_kernel())
    return prepared(model)


def test_fused_q4q8_projections_give_the_hf_bits(ops):
    model = q4q8_model(2)
    lean = assert_same(model, PROMPTS, [1, 4, 2])
    assert lean.fused and "4 fused projections" in lean.describe()
    block = lean.blocks[0]
    assert block.wqkv.direct is not None and block.w13.direct is not None
    # The parts read views of the fused buffer: no second copy of the weights.
    q_proj = block.wqkv.parts[0]
    assert q_proj.q4q8_weights.untyped_storage().data_ptr() == block.wqkv.direct.q4q8_weights.untyped_storage().data_ptr()
    assert_same(model, [list(range(1, 60)), PROMPTS[0]], [1, 3])  # dense spans: the separate layers


def test_a_model_changed_after_its_first_forward_gets_a_new_decoder():
    model = prepared(tiny.qwen2(3))
    first = lean_decoder_for(model)
    assert lean_decoder_for(model) is first
    quantize_model(model, engine="int8")  # every linear swapped for a quantized one
    second = lean_decoder_for(model)
    assert second is not None and second is not first
    assert_same(model, PROMPTS[:2], [1, 3])


def test_row_plans_given_after_the_first_forward_reach_the_fused_projections(ops):
    """The models room's changes move the model's weights version (row plans here, as an engine's
    start gives them when its first proof fails): the next forward builds a decoder whose fused
    projections run in the parts' new plans; nothing else rebuilds it."""
    model = q4q8_model(5)
    first = lean_decoder_for(model)
    assert first.blocks[0].wqkv.direct.row_plan is None
    assert lean_decoder_for(model) is first and first.is_current()
    row_stable.stabilize(model)
    assert not first.is_current()
    second = lean_decoder_for(model)
    parts = second.blocks[0].wqkv.parts
    assert second is not first and parts[0].row_plan is not None
    assert second.blocks[0].wqkv.direct.row_plan == parts[0].row_plan
    assert lean_decoder_for(model) is second
    assert_same(model, PROMPTS, [1, 3, 2])


def test_a_copied_model_gets_its_own_decoder():
    model = prepared(tiny.qwen2(4))
    lean = lean_decoder_for(model)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.model.layers[0].mlp.up_proj.weight.mul_(2)
    assert lean_decoder_for(copied) is not lean
    assert_same(copied, PROMPTS[:2], [1, 2])


def test_a_decoder_that_differs_falls_back_to_the_hf_forward(monkeypatch, caplog):
    model = prepared(tiny.qwen2(5))
    monkeypatch.setattr(lean_decoder, "_rotate_half", lambda states: states)  # a broken rotary
    with caplog.at_level(logging.INFO, logger="disco.engines.packed_forward"):
        assert lean_decoder_for(model) is None
    assert "the HF forward" in caplog.text and "differ" in caplog.text
    # The packed forward still runs (the HF decoder) and gives what the HF decoder gives.
    assert all(torch.equal(a, b) for a, b in zip(run(model, None, PROMPTS[:1], [2]), run(model, False, PROMPTS[:1], [2])))


def test_other_architectures_run_the_hf_forward():
    model = tiny.qwen2(6)
    model.config.hidden_act = "gelu"
    assert "activation" in lean_decoder.unsupported_reason(model)
    assert lean_decoder_for(prepared(model)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
def test_the_direct_one_query_attention_is_the_wrapper_s_call(dtype, groups):
    """The reference attention calls sdpa itself: the bits of transformers' sdpa wrapper for
    one query without a mask, with and without key groups."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from disco.engines.packed_forward import _decoding_sdpa

    class Module(torch.nn.Module):
        num_key_value_groups = groups
        is_causal = True

    generator = torch.Generator().manual_seed(groups)
    query = torch.randn(1, 2 * groups, 1, 64, generator=generator).to(dtype)
    keys, values = (torch.randn(1, 2, 37, 64, generator=generator).to(dtype) for _ in range(2))
    module = Module()
    wrapper, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, keys, values, None, dropout=0.0, scaling=0.11)
    direct = _decoding_sdpa(module, keys, values, dropout=0.0, scaling=0.11)(query, keys, values)
    assert direct.shape == wrapper.shape == (1, 1, 2 * groups, 64)
    assert torch.equal(direct, wrapper)
