"""A GGUF's Q4_K weights kept as they are in the int4 engine (issue 28, item 1): the decoding
against the gguf package's own dequantization, the kernel computing with them, and the
loader's name mapping and its check (a weight that does not match is re-quantized)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from disco.models.gguf_blocks import Int4Groups, checked_native_weights, matches_dense, q4_k_groups
from disco.models.int4 import Int4Linear
from disco.models.quantize import Int8Linear, quantize_model

Q4_K = gguf.GGMLQuantizationType.Q4_K


def random_q4_k(out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K super-blocks: every byte random except d and dmin (small finite fp16)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_features * in_features // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 3e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 3e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(out_features, -1)


def test_q4_k_blocks_decode_exactly_as_the_gguf_package_dequantizes_them():
    blocks = random_q4_k(48, 512)
    groups = q4_k_groups(blocks, 48, 512)
    reference = gguf.quants.dequantize(blocks, Q4_K)  # [48, 512] float32, ggml's formula
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    assert groups.scales.shape == (48, 16)
    assert np.array_equal(groups.dequantized().numpy(), reference)  # exactly: nothing re-quantized
    assert len(torch.unique(groups.q)) == 16 and len(torch.unique(groups.scales)) > 100


def test_an_int4_linear_from_q4_k_groups_multiplies_by_those_weights_with_bf16_scales():
    groups = q4_k_groups(random_q4_k(64, 256, seed=1), 64, 256)
    module = Int4Linear.from_groups(groups.q, groups.scales, groups.zeros)
    assert torch.equal(module.centered.to(torch.int16) + 8, groups.q.to(torch.int16))  # q kept as it is
    exact = groups.dequantized()
    # only the scales and zeros are rounded to bf16: the weight moves by far less than a step
    assert ((module.dequantized() - exact).norm() / exact.norm()) < 0.01
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    expected = x.float() @ module.dequantized().T
    assert torch.allclose(module(x).float(), expected, atol=0.02 * float(expected.abs().max()), rtol=0.02)
    with pytest.raises(ValueError, match="do not fit"):
        Int4Linear.from_groups(groups.q, groups.scales[:, :3], groups.zeros[:, :3])


class _Attention(torch.nn.Module):
    def __init__(self, q_proj: torch.nn.Linear, k_proj: torch.nn.Linear, v_proj: torch.nn.Linear) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj


def _model_with(q_proj, k_proj, v_proj) -> torch.nn.Module:
    """A module tree with HF Qwen2 names: model.layers.0.self_attn.{q,k,v}_proj."""
    layer = torch.nn.Module()
    layer.self_attn = _Attention(q_proj, k_proj, v_proj)
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([layer])
    root = torch.nn.Module()
    root.model = inner
    return root


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.to(torch.bfloat16)
    return linear


def test_the_loader_keeps_matching_q4_k_weights_and_requantizes_the_rest(tmp_path, caplog):
    q_blocks, k_blocks = random_q4_k(32, 256, seed=2), random_q4_k(32, 256, seed=3)
    v_weight = np.random.default_rng(4).standard_normal((32, 256)).astype(np.float32) * 0.02
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", q_blocks, raw_dtype=Q4_K)
    writer.add_tensor("blk.0.attn_k.weight", k_blocks, raw_dtype=Q4_K)
    writer.add_tensor("blk.0.attn_v.weight", gguf.quants.quantize(v_weight, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    q_dense = torch.from_numpy(gguf.quants.dequantize(q_blocks, Q4_K))
    k_dense = torch.from_numpy(gguf.quants.dequantize(k_blocks, Q4_K)).flip(0)  # rows permuted: must not map
    model = _model_with(_linear(q_dense), _linear(k_dense), _linear(torch.from_numpy(v_weight)))
    with caplog.at_level(logging.WARNING):
        mapped, report = checked_native_weights(path, model)
    assert list(mapped) == ["model.layers.0.self_attn.q_proj.weight"]
    assert report == {"gguf_file": "tiny.gguf", "native_int4": 1, "requantized": {"Q4_K": 1, "Q8_0": 1}}
    assert "k_proj.weight does not match" in caplog.text
    quantize_model(model, engine="int4", native=mapped)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int4Linear) and torch.equal(q_proj.centered.to(torch.int16) + 8,
                                                          mapped["model.layers.0.self_attn.q_proj.weight"].q.to(torch.int16))
    assert not isinstance(model.model.layers[0].self_attn.v_proj, Int8Linear)  # int4, re-quantized


def test_matches_dense_tolerates_bf16_rounding_only():
    groups = q4_k_groups(random_q4_k(16, 256, seed=5), 16, 256)
    dense = groups.dequantized()
    assert matches_dense(groups, dense.to(torch.bfloat16))
    assert not matches_dense(groups, dense * 1.05)
    assert not matches_dense(groups, dense[:, :128])
    assert isinstance(groups, Int4Groups)
