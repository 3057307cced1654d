"""What the first GPU run found, checked on the CPU: loads never take Hub kernels, the packing
proof covers the batches the batcher really issues, and the GPU's row plans are chosen by probe.

(The CUDA side of the same promises is in tests/test_gpu.py.)
"""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from disco.config import ModelConfig
from disco.engines import packing_proof
from disco.engines.packing_proof import (CPU_PROOF, GPU_PROOF, batch_sizes, proof_shape, prove_packing,
                                         synthetic_sessions)
from disco.engines.varlen_attention import KEY_GRANULE, ONE_CALL_CUDA, attention_plan
from disco.errors import ModelError
from disco.models import hub_kernels, row_stable
from disco.models.loading import load_model


# --- no Hub kernels, by construction -----------------------------------------------------

def test_every_load_keeps_hub_kernels_off(tiny_pair_dirs, tmp_path, monkeypatch):
    monkeypatch.delenv(hub_kernels.ENV_VAR, raising=False)
    seen = []
    original = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.append((kwargs.get("use_kernels"), os.environ.get(hub_kernels.ENV_VAR)))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    loaded = load_model(ModelConfig(spec=str(tiny_pair_dirs["target"]), dtype="bfloat16"), "target", tmp_path)
    assert seen == [(False, "NO")]  # the argument and the switch, both set before transformers loads
    assert loaded.model.use_kernels is False


def test_an_environment_that_forces_hub_kernels_on_is_refused_naming_the_variable(tiny_pair_dirs, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv(hub_kernels.ENV_VAR, "yes")
    with pytest.raises(ModelError, match="USE_HUB_KERNELS=yes in the environment.*unset USE_HUB_KERNELS"):
        load_model(ModelConfig(spec=str(tiny_pair_dirs["target"]), dtype="float32"), "target", tmp_path)
    monkeypatch.setenv(hub_kernels.ENV_VAR, "0")  # a false value is the user's own "off": kept working
    hub_kernels.keep_off()
    assert os.environ[hub_kernels.ENV_VAR] == "NO"


def test_a_kernelized_model_is_refused(target_model):
    model = copy.deepcopy(target_model)
    hub_kernels.check_model(model, "tiny")
    model._use_kernels = True  # what transformers' kernelize leaves behind
    with pytest.raises(ModelError, match="loaded with Hugging Face Hub kernels"):
        hub_kernels.check_model(model, "tiny")


def test_the_cli_sets_the_switch_before_any_command(monkeypatch, capsys):
    from disco_cli.main import main

    monkeypatch.delenv(hub_kernels.ENV_VAR, raising=False)
    assert main(["policies"]) == 0
    assert os.environ[hub_kernels.ENV_VAR] == "NO"
    monkeypatch.setenv(hub_kernels.ENV_VAR, "1")
    assert main(["policies"]) == 2
    assert "USE_HUB_KERNELS=1" in capsys.readouterr().err


# --- the packing proof runs what live batches run ------------------------------------------

@pytest.mark.parametrize("shape", [GPU_PROOF, CPU_PROOF], ids=["gpu", "cpu"])
def test_the_synthetic_sessions_cover_blocks_granules_and_prefills(target_model, shape):
    specs = synthetic_sessions(target_model, 16 + len(shape.prefill_blocks), shape=shape)
    blocks = {len(spec.block) for spec in specs if spec.num_logits}
    assert blocks == set(range(1, shape.max_block + 1)) or (min(blocks) == 1 and max(blocks) == shape.max_block
                                                             and len(blocks) >= 10)
    assert {spec.cache_len // KEY_GRANULE for spec in specs} >= {0, 1, 2, 3}
    assert any(spec.cache_len % KEY_GRANULE == 0 and spec.cache_len for spec in specs)  # a granule's edge
    assert sorted(len(spec.block) for spec in specs if spec.num_logits == 0) == sorted(shape.prefill_blocks)
    sequence = specs[3].build(target_model)
    again = specs[3].build(target_model)
    assert sequence.cache_len == specs[3].cache_len
    assert torch.equal(sequence.cache.layers[0].keys, again.cache.layers[0].keys)  # seeded: same bits


def test_the_gpu_proof_feeds_verifications_of_the_max_lookahead_and_a_long_prefill():
    from disco.config import DEFAULT_MAX_LOOKAHEAD
    from disco.models.weight_only import DENSE_MIN_ROWS

    assert GPU_PROOF.max_block == DEFAULT_MAX_LOOKAHEAD + 1 and max(GPU_PROOF.prefill_blocks) >= DENSE_MIN_ROWS
    assert proof_shape(torch.device("cuda")) is GPU_PROOF and proof_shape(torch.device("cpu")) is CPU_PROOF


def test_batch_sizes_every_size_on_a_gpu_a_few_on_a_cpu():
    assert batch_sizes(torch.device("cuda"), 16) == tuple(range(2, 17))
    assert batch_sizes(torch.device("cpu"), 16) == (2, 16)
    assert batch_sizes(torch.device("cpu"), 1) == ()


class _LargeCallDependent(torch.nn.Module):
    """A linear whose rows change in calls of more than 64 rows (cuBLAS on an H200: 129 rows):
    only a live batch reaches that; one session, or 16 sessions of one to five tokens, do not."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out * (1 + 2 ** -6) if x.reshape(-1, x.shape[-1]).shape[0] > 64 else out


def test_the_proof_catches_what_only_a_live_batch_does(target_model):
    model = copy.deepcopy(target_model).to(torch.bfloat16)
    row_stable.stabilize(model)
    assert prove_packing(model, 16).packed
    layer = model.model.layers[1].mlp
    layer.down_proj = _LargeCallDependent(layer.down_proj)
    assert packing_proof.prove_decoding(model).proven  # decoding blocks stay under 64 rows
    verdict = prove_packing(model, 16, sizes=range(2, 17), shape=GPU_PROOF)  # the GPU's proof, run here
    assert not verdict.packed and "sessions" in verdict.detail and "changed" in verdict.detail


class _KeyCountDependent(torch.nn.Module):
    """Stands in for an attention kernel whose split depends on the batch: here the o_proj input of
    a row changes when the forward holds sessions whose caches reach past 192 keys."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.long_batch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * (1 + 2 ** -6) if self.long_batch else x)


def test_the_proof_feeds_caches_across_key_granules(target_model, monkeypatch):
    """A failure that needs long caches in the batch is caught (the old proof's caches held
    one token)."""
    model = copy.deepcopy(target_model).to(torch.bfloat16)
    row_stable.stabilize(model)
    attention = model.model.layers[0].self_attn
    attention.o_proj = probe = _KeyCountDependent(attention.o_proj)
    original = packing_proof.CachedSequence.forward_batch

    def forward_batch(sequences, num_logits, want_hidden):
        probe.long_batch = len(sequences) > 1 and max(s.cache_len for s in sequences) > 3 * KEY_GRANULE
        return original(sequences, num_logits, want_hidden)

    monkeypatch.setattr(packing_proof.CachedSequence, "forward_batch", staticmethod(forward_batch))
    assert not prove_packing(model, 8).packed  # the CPU's proof too


# --- the GPU's row plans and attention kernel ------------------------------------------------

def test_gpu_plans_cut_calls_where_the_kernel_holds_else_pad_to_one_shape():
    inputs, weight, _ = row_stable.cancelling_inputs(128, 32, 64, torch.bfloat16)
    inputs, weight = inputs.to(torch.bfloat16), weight.to(torch.bfloat16)

    def changes_past(rows_limit):
        def call(rows):  # row by row: row-invariant on any CPU (a bf16 GEMM is not on an AMX Xeon past 32 rows)
            out = torch.cat([torch.nn.functional.linear(row[None], weight) for row in rows])
            return out * (1 + 2 ** -6) if rows.shape[0] > rows_limit else out
        return call

    plans = row_stable.plans_for(torch.device("cuda"))
    assert plans == row_stable.GPU_PLANS and row_stable.plans_for(torch.device("cpu")) == row_stable.PLANS
    assert row_stable.probe_plan(changes_past(1000), inputs, plans) == row_stable.RowPlan(1, 128)
    assert row_stable.probe_plan(changes_past(100), inputs, plans) == row_stable.RowPlan(1, 64)
    fixed = row_stable.probe_plan(changes_past(1), inputs, plans)
    assert fixed == row_stable.RowPlan(row_stable.GPU_CALL_ROWS, row_stable.GPU_CALL_ROWS)


def test_the_cuda_attention_plan_calls_the_memory_efficient_kernel_without_global_flags(monkeypatch):
    """The CUDA plan calls the memory-efficient kernel itself, with sdpa's additive bias for the
    boolean mask; it never sets torch's process-wide backend flags (another thread's attention
    would run under them: on the H200 it found no kernel)."""
    assert attention_plan("cuda:0") == ONE_CALL_CUDA and ONE_CALL_CUDA.memory_efficient
    assert not attention_plan("cpu").memory_efficient
    calls = []

    def efficient(query, key, value, bias, log_sumexp, dropout, causal, scale):
        calls.append((bias, log_sumexp, dropout, causal, scale))
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale), None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", efficient)
    flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()
    generator = torch.Generator().manual_seed(0)
    items, keys, values = (torch.randn(2, 4, n, 8, generator=generator) for n in (1, 64, 64))
    mask = torch.rand(2, 4, 1, 64, generator=generator) > 0.5
    mask[..., 0] = True
    got = ONE_CALL_CUDA.attend(items, keys, values, mask, 0.3, False)
    expected = torch.nn.functional.scaled_dot_product_attention(items, keys, values, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(got, expected)
    bias, log_sumexp, dropout, causal, scale = calls[0]
    assert bias.dtype == items.dtype and torch.equal(bias == 0, mask) and torch.isinf(bias[~mask]).all()
    assert (log_sumexp, dropout, causal, scale) == (False, 0.0, False, 0.3)
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == flags


def test_a_row_stable_norm_computes_what_the_norm_computes_in_fixed_shape_calls(target_model):
    """The GPU's norms (class swapped at load there) run every call padded or cut to 64 rows;
    here, swapped by hand on the CPU, the logits stay those of the plain model."""
    model = copy.deepcopy(target_model)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and row_stable.stabilize_norms(model) == 0  # a CPU model's norms are left alone
    for module in norms:
        module.__class__ = row_stable._row_stable_norm_class(type(module))
        module.row_plan = row_stable.GPU_NORM_PLAN
    assert not row_stable.needs_plans(model)
    ids = torch.arange(1, 151).unsqueeze(0)  # 150 rows: two full calls and a padded one
    with torch.inference_mode():
        expected = target_model(ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_cuda_layout_makes_the_bias_once_per_forward():
    """The memory-efficient kernel's bias is built with the layout (once per forward), not per layer."""
    from disco.engines.batch_layout import additive_bias, packed_layout

    layout = packed_layout([67, 4], [3, 1], [True, True], 2, 2, KEY_GRANULE, "cpu", bias_dtype=torch.bfloat16)
    assert layout.bias is not None and layout.bias.dtype == torch.bfloat16
    assert torch.equal(layout.bias, additive_bias(layout.mask, torch.bfloat16))
    assert packed_layout([67, 4], [3, 1], [True, True], 2, 2, KEY_GRANULE, "cpu").bias is None
