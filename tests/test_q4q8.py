"""The q4 x q8 kernel of the int4 engine (:mod:`disco.models.q4q8`): its arithmetic
against a reference written out in torch, row invariance (alone, in any call, under the
row-plan probe), clear errors on bad shapes, the per-machine choice, greedy exactness of
speculation and of concurrent sessions on a tiny model running it, and the same bits from
every build (AMX, VNNI, AVX2; the other builds in a second process). Skipped where the CPU
has neither AVX-512 VNNI nor AVX2 (the engine then keeps torch's kernel, also tested here)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.models import q4q8, row_stable
from disco.models.int4 import Int4Linear, use_chosen_kernel
from disco.models.quantize import quantize_model
from tests.helpers import PROMPTS, generate_at_once, local_generator

HOME = Path(os.environ.get("DISCO_HOME", "/tmp/disco_q4q8_tests"))
needs_q4q8 = pytest.mark.skipif(not q4q8.cpu_supports(), reason="the CPU has neither AVX-512 VNNI nor AVX2")


@pytest.fixture(scope="module")
def ops():
    why_not = q4q8.load(HOME)
    if why_not is not None:
        pytest.skip(why_not)


def reference_mm(rows: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    """The kernel's arithmetic: rows quantized to int8 per group of 32 in float32 (times
    127 / max|x|, round half to even), then in float64 the integer dot products with q - 8,
    scaled, plus the zero times the group's sum of the inputs."""
    x32 = rows.float().reshape(rows.shape[0], -1, 32)  # [n, groups, 32]
    amax = x32.abs().amax(dim=-1, keepdim=True)
    # 127 / max|x| divided in float32, as the kernel does (``127.0 / tensor`` multiplies by a reciprocal)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    xq = torch.round(x32 * inverse).double()
    dx = (amax / 127.0).squeeze(-1).double()  # [n, groups]
    x = x32.double()
    q = layer.centered.double().reshape(layer.out_features, -1, 32)  # [out, groups, 32]
    scales = layer.scales_and_zeros[:, :, 0].T.double()  # [out, groups]
    zeros = layer.scales_and_zeros[:, :, 1].T.double()
    dots = torch.einsum("ngk,ogk->nog", xq, q)  # [n, out, groups]
    return (dots * dx[:, None, :] * scales[None] + x.sum(-1)[:, None, :] * zeros[None]).sum(-1)


def layer(out_features: int, in_features: int, seed: int = 0) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) * 0.01
    return Int4Linear.from_weight(weight, bias)


@needs_q4q8
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 96), (256, 896)])
def test_kernel_computes_the_q4_q8_products(ops, out_features, in_features):
    linear = layer(out_features, in_features)
    rows = (torch.randn(7, in_features, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    rows[2, :32] = 0  # a group of zeros: scale 0, no division by it
    expected = reference_mm(rows.float(), linear)
    linear.use_kernel(q4q8.loaded_kernel())
    got = linear._quantized(rows).double()
    # The kernel rounds its float32 sum to bf16: within half a bf16 step of the float64 value.
    assert torch.allclose(got, expected, rtol=2 ** -8, atol=1e-5 * expected.abs().max().item())
    # And the product is the layer's: close to its dequantized weight times the inputs.
    dense = rows.float() @ linear.dequantized().T
    assert ((got.float() - dense).norm() / dense.norm()).item() < 0.02


@needs_q4q8
def test_each_row_gets_its_bits_alone_in_any_call(ops):
    linear = layer(64, 128)
    linear.use_kernel(q4q8.loaded_kernel())
    rows = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([linear._quantized(rows[i:i + 1].contiguous()) for i in range(40)])
    for count in (2, 5, 8, 9, 17, 40):
        assert torch.equal(linear._quantized(rows[:count].contiguous()), alone[:count]), count
    # The load-time probe (on inputs that show any other summation order) finds no cut needed.
    call, inputs = row_stable._probe_call(linear)
    assert row_stable.probe_plan(call, inputs) == row_stable.PLANS[0]


@needs_q4q8
def test_bad_shapes_are_refused_with_a_message(ops):
    linear = layer(32, 64)
    linear.use_kernel(q4q8.loaded_kernel())
    with pytest.raises(RuntimeError, match="do not fit"):
        q4q8.mm(torch.zeros(1, 64, dtype=torch.bfloat16), linear.q4q8_weights, 48)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        q4q8.mm(torch.zeros(1, 64), linear.q4q8_weights, 32)
    with pytest.raises(ValueError, match="cannot switch"):
        linear.use_kernel(q4q8.TORCH_KERNEL)


def test_the_choice_is_measured_once_and_falls_back_without_the_instructions(tmp_path, monkeypatch):
    monkeypatch.setattr(q4q8, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.setattr(q4q8, "ops_loaded", lambda: False)
    choice = q4q8.choose_kernel(tmp_path)
    assert choice.kernel == q4q8.TORCH_KERNEL and "has neither" in choice.reason
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quantize_model(model, lm_head=False, engine="int4")
    assert use_chosen_kernel(model, tmp_path) == choice and model[0].kernel == q4q8.TORCH_KERNEL


def test_the_amx_build_only_where_linux_grants_the_tiles(monkeypatch, caplog):
    """An AMX CPU gets the AMX build; where Linux refuses the tile state, the VNNI build (the
    same bits) and a warning saying why."""
    flags = frozenset({"amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "avx2"})
    monkeypatch.setattr(q4q8, "cpu_flags", lambda: flags)
    monkeypatch.setattr(q4q8, "request_amx", lambda: "")
    assert q4q8.best_variant().kernel == "q4q8-amx"
    monkeypatch.setattr(q4q8, "request_amx", lambda: "arch_prctl(...) failed: Operation not permitted")
    assert q4q8.best_variant().kernel == "q4q8-vnni"
    assert "not permitted" in caplog.text
    monkeypatch.setattr(q4q8, "cpu_flags", lambda: flags - {"amx_int8"})
    monkeypatch.setattr(q4q8, "request_amx", lambda: pytest.fail("asked without AMX"))
    assert q4q8.best_variant().kernel == "q4q8-vnni"


@needs_q4q8
def test_the_choice_is_cached_per_thread_count(ops, tmp_path, monkeypatch):
    monkeypatch.setattr(q4q8, "kernels_dir", lambda home, variant: home)
    first = q4q8.choose_kernel(tmp_path)
    assert first.kernel in (q4q8.loaded_kernel(), q4q8.TORCH_KERNEL) and "measured" in first.reason
    cached = json.loads((tmp_path / f"choice-t{torch.get_num_threads()}.json").read_text())
    assert cached["kernel"] == first.kernel
    monkeypatch.setattr(q4q8, "_measure_choice", lambda kernel, threads: pytest.fail("measured twice"))
    assert q4q8.choose_kernel(tmp_path) == first


def q4q8_model(model: torch.nn.Module) -> torch.nn.Module:
    quantized = quantize_model(copy.deepcopy(model), engine="int4")
    linears = [module for module in quantized.modules() if isinstance(module, Int4Linear)]
    assert linears
    for module in linears:
        module.use_kernel(q4q8.loaded_kernel())
    return quantized


@needs_q4q8
@pytest.mark.parametrize("draft_kind", ["same", "noisy"])
def test_speculation_on_the_kernel_is_greedy_exact(ops, target_model, drafts, tokenizer, draft_kind):
    """A q4 x q8 target verifies a block as it decodes token by token: speculative greedy
    output equals its own target-only output, whatever the draft proposes."""
    target = q4q8_model(target_model)
    draft = q4q8_model(target_model if draft_kind == "same" else drafts["noisy"])
    sampling = SamplingParams(max_new_tokens=32, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS[:2]:
        prompt_ids = tokenizer(prompt)["input_ids"]
        reference = local_generator(target, None, tokenizer).generate(
            prompt_ids, sampling, SpeculationConfig(policy="none")).token_ids
        assert len(set(reference)) > 8
        for policy in ("static:1", "static:4", "heuristic:2", "confidence:0.4"):
            result = local_generator(target, draft, tokenizer).generate(
                prompt_ids, sampling, SpeculationConfig(policy=policy))
            assert result.token_ids == reference, (draft_kind, policy, prompt)
            accepted += result.stats.accepted_tokens
    assert accepted > 0


@needs_q4q8
def test_concurrent_sessions_on_the_kernel_get_their_solo_tokens(ops, target_model, drafts, tokenizer):
    """Eight sessions at once (packed forwards of their rows) get the tokens each gets alone."""
    target = q4q8_model(target_model)
    draft = q4q8_model(drafts["noisy"])
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    generator = local_generator(target, draft, tokenizer)
    jobs = [(tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"], policy)
            for i, policy in enumerate(["none", "static:4", "heuristic:2", "static:2"] * 2)]
    solo = [generator.generate(ids, sampling, SpeculationConfig(policy=policy)).token_ids for ids, policy in jobs]
    assert generate_at_once(generator, jobs, sampling) == solo


@needs_q4q8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gemms_from_the_repacked_weights_have_the_same_bits(ops, dtype):
    """The dense prefill path dequantizes from the kernel's layout (``packed`` and ``centered``
    are freed) to the bits the torch-kernel layer multiplies by, in either GEMM dtype."""
    before = layer(1040, 96)  # 1040 output channels: two 512-channel slices and a 16-channel one
    after = copy.deepcopy(before)
    after.use_kernel(q4q8.loaded_kernel())
    assert after.packed.numel() == 0 and after.centered.numel() == 0
    assert torch.equal(after.dequantized(), before.dequantized())
    before.dense_dtype = after.dense_dtype = dtype
    rows = torch.randn(60, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(after._dense(rows), before._dense(rows))
    with pytest.raises(RuntimeError, match="whole blocks of 16"):
        q4q8.dequantize(after.q4q8_weights, 1040, 96, 8, 16, torch.empty(8, 96))


AVX2_SCRIPT = """
import sys, torch
from pathlib import Path
from disco.models import q4q8
variant = next(v for v in q4q8.VARIANTS if v.kernel == "q4q8-avx2")
assert q4q8.load(Path(sys.argv[1]), variant) is None and q4q8.loaded_kernel() == "q4q8-avx2"
inputs = torch.load(sys.argv[2])
out = torch.empty(1040, 96, dtype=torch.bfloat16)
q4q8.dequantize(inputs["packed"], 1040, 96, 0, 1040, out)
torch.save({"mm": q4q8.mm(inputs["rows"], inputs["packed"], 1040), "dequantized": out,
            "peak_macs": (q4q8.int8_peak(1000), q4q8.int8_peak(2000)), "group_peak": q4q8.int8_group_peak(10)},
           sys.argv[3])
"""


@needs_q4q8
@pytest.mark.skipif(not {"avx2", "fma"} <= q4q8.cpu_flags(), reason="the CPU lacks AVX2")
def test_the_avx2_build_computes_the_bits_of_the_vnni_build(ops, tmp_path):
    """The AVX2 build (VPMADDUBSW + VPMADDWD in 8-lane halves) gives the same bits as the
    build this process runs, in its own process (one build per process)."""
    linear = layer(1040, 96)
    linear.use_kernel(q4q8.loaded_kernel())
    rows = (torch.randn(11, 96, generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16)
    torch.save({"packed": linear.q4q8_weights, "rows": rows}, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", AVX2_SCRIPT, str(HOME), str(tmp_path / "inputs.pt"),
                    str(tmp_path / "out.pt")], check=True, timeout=300, cwd=Path(__file__).parents[1])
    avx2 = torch.load(tmp_path / "out.pt")
    out = torch.empty(1040, 96, dtype=torch.bfloat16)
    q4q8.dequantize(linear.q4q8_weights, 1040, 96, 0, 1040, out)
    assert torch.equal(avx2["mm"], linear._quantized(rows))
    assert avx2["peak_macs"][1] == 2 * avx2["peak_macs"][0] > 0  # the roofline's probe builds and runs there too
    assert avx2["group_peak"] == -1  # the VNNI instruction mix: not measured on AVX2
    assert torch.equal(avx2["dequantized"], out)


VNNI_SCRIPT = """
import sys, torch
from pathlib import Path
from disco.models import q4q8
variant = next(v for v in q4q8.VARIANTS if v.kernel == "q4q8-vnni")
assert q4q8.load(Path(sys.argv[1]), variant) is None and q4q8.loaded_kernel() == "q4q8-vnni"
inputs = torch.load(sys.argv[2])
counts = inputs.pop("counts")
outputs = {}
for name, (packed, out_features, in_features, rows) in inputs.items():
    out = torch.empty(out_features, in_features, dtype=torch.bfloat16)
    q4q8.dequantize(packed, out_features, in_features, 0, out_features, out)
    outputs[name] = {"mm": [q4q8.mm(rows[:n].contiguous(), packed, out_features) for n in counts],
                     "dequantized": out}
torch.save(outputs, sys.argv[3])
"""
AMX_ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 33)


@needs_q4q8
@pytest.mark.skipif(not {"amx_tile", "amx_int8"} <= q4q8.cpu_flags(), reason="the CPU lacks AMX-INT8")
def test_the_amx_build_computes_the_bits_of_the_vnni_build(ops, tmp_path):
    """The AMX build (TDPBSUD's integer dot products for calls of several rows, then the VNNI
    path's float epilogue) gives the VNNI build's bits for every call size, in its own process."""
    if q4q8.loaded_kernel() != "q4q8-amx":
        pytest.skip(f"this process runs {q4q8.loaded_kernel()}")
    assert q4q8.amx_refused() == ""  # the AMX path runs here, not the VNNI fallback
    inputs, ours = {}, {}
    for seed, (out_features, in_features) in enumerate([(1040, 96), (256, 896)]):
        linear = layer(out_features, in_features, seed)
        linear.use_kernel(q4q8.loaded_kernel())
        rows = (torch.randn(max(AMX_ROWS), in_features, generator=torch.Generator().manual_seed(5 + seed)) * 2
                ).to(torch.bfloat16)
        rows[1, :32] = 0  # a group of zeros
        rows[4, 32:64] = 0
        name = f"{out_features}x{in_features}"
        inputs[name] = (linear.q4q8_weights, out_features, in_features, rows)
        out = torch.empty(out_features, in_features, dtype=torch.bfloat16)
        q4q8.dequantize(linear.q4q8_weights, out_features, in_features, 0, out_features, out)
        ours[name] = {"mm": [linear._quantized(rows[:n].contiguous()) for n in AMX_ROWS], "dequantized": out}
        # Row-invariant: each row of every call is the row alone (the one-row call's path).
        alone = torch.cat([linear._quantized(rows[i:i + 1].contiguous()) for i in range(max(AMX_ROWS))])
        for count, got in zip(AMX_ROWS, ours[name]["mm"]):
            assert torch.equal(got, alone[:count]), (name, count)
    torch.save({**inputs, "counts": AMX_ROWS}, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", VNNI_SCRIPT, str(HOME),
                    str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   check=True, timeout=300, cwd=Path(__file__).parents[1])
    vnni = torch.load(tmp_path / "out.pt")
    for name in inputs:
        for count, got, expected in zip(AMX_ROWS, ours[name]["mm"], vnni[name]["mm"]):
            assert torch.equal(got, expected), (name, count)
        assert torch.equal(ours[name]["dequantized"], vnni[name]["dequantized"]), name
