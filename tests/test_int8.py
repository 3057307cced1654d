"""The int8 weight-only engine (``--dtype int8``) and ``--dtype auto``: kernel row
invariance, quantization, greedy exactness of speculation on the same int8 engine, the
quantized cache, engine reporting, and the dtype resolution from CPU flags."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from disco.config import ModelConfig, SamplingParams, SpeculationConfig
from disco.engines.sessions import SessionLimits
from disco.errors import InvalidRequest
from disco.models import quantize
from disco.models.loading import load_model, quantized_folder
from disco.models.quantize import Int8Linear, quantize_model, quantize_weight
from disco.models.weight_only import DENSE_MIN_ROWS, dense_prefill
from disco.platform import resolve_dtype
from protos.convert import service_info_pb
from protos.runtime.metrics import ServerMetrics
from tests import tiny
from tests.helpers import PROMPTS, local_generator

POLICIES = ("static:1", "static:3", "static:7", "heuristic:2", "confidence:0.4")
LONG_PROMPT = "def add(a, b):\n    return a + b\n\n" * 6 + "class Stack:\n    def push(self, item):\n"


@pytest.fixture(scope="module")
def int8_target(target_model):
    return quantize_model(copy.deepcopy(target_model))


@pytest.fixture(scope="module")
def int8_drafts(drafts, int8_target):
    return {"random": quantize_model(copy.deepcopy(drafts["random"])), "same": int8_target,
            "noisy": quantize_model(copy.deepcopy(drafts["noisy"]))}


def _tied_model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, eos_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(3)
    return Qwen2ForCausalLM(config).float().eval()


# --- the kernel module -------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_rows_are_bitwise_independent_of_the_batch(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=bias)
    module = Int8Linear.from_weight(linear.weight, linear.bias)
    for rows in range(1, 18):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)  # [rows, in_features]
        together = module(x)
        assert together.shape == (rows, 80) and together.dtype == torch.bfloat16
        for i in range(rows):
            assert torch.equal(together[i], module(x[i:i + 1])[0]), (rows, i)


def test_int8_linear_matches_its_dequantized_weight():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 48, bias=True)
    module = Int8Linear.from_weight(linear.weight, linear.bias)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)  # [batch, rows, in_features]
    out = module(x)
    assert out.shape == (2, 5, 48)
    expected = x.float() @ module.dequantized().T + module.bias.float()
    assert torch.allclose(out.float(), expected, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="input features"):
        module(torch.randn(3, 63, dtype=torch.bfloat16))


def test_dense_prefill_spans_run_a_float32_gemm_and_leave_other_rows_alone(monkeypatch):
    torch.manual_seed(4)
    linear = torch.nn.Linear(96, 80, bias=True)
    module = Int8Linear.from_weight(linear.weight, linear.bias)
    x = torch.randn(30, 96, dtype=torch.bfloat16)  # [rows, in_features]
    kernel = module(x)
    dense_rows = []
    original = Int8Linear._dense
    monkeypatch.setattr(Int8Linear, "_dense", lambda self, rows: dense_rows.append(len(rows)) or original(self, rows))
    with dense_prefill([(3, 12), (20, 27)]):
        mixed = module(x)
    assert dense_rows == [9, 7]
    for start, end in ((0, 3), (12, 20), (27, 30)):  # outside the spans: the int8 kernel, same bits
        assert torch.equal(mixed[start:end], kernel[start:end])
    for start, end in ((3, 12), (20, 27)):  # inside: the same weights as one float32 GEMM
        gemm = torch.nn.functional.linear(x[start:end].float(), module.weight.float()) * module.scales.float()
        assert torch.equal(mixed[start:end], gemm.to(torch.bfloat16) + module.bias)
        expected = x[start:end].float() @ module.dequantized().T + module.bias.float()
        assert torch.allclose(mixed[start:end].float(), expected, atol=0.05, rtol=0.02)
    assert torch.equal(module(x), kernel) and dense_rows == [9, 7]  # the spans end with the block


def test_quantize_weight_is_symmetric_per_row_and_handles_zero_rows():
    torch.manual_seed(2)
    weight = torch.randn(6, 40)
    weight[3] = 0.0
    q, scales = quantize_weight(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (6,)
    assert int(q.abs().max()) == 127 and torch.all(q[3] == 0)
    error = (q.float() * scales.float()[:, None] - weight).abs()
    assert torch.all(error <= scales.float()[:, None] / 2 + 1e-6)
    assert torch.isfinite(scales.float()).all()


# --- the engine on the tiny models -------------------------------------------------------

def test_quantize_model_swaps_every_linear(target_model, int8_target):
    linears = [name for name, m in target_model.named_modules() if isinstance(m, torch.nn.Linear)]
    swapped = dict(int8_target.named_modules())
    assert linears and all(isinstance(swapped[name], Int8Linear) for name in linears)
    assert not any(isinstance(m, torch.nn.Linear) for m in int8_target.modules())
    assert int8_target.model.embed_tokens.weight.dtype == torch.bfloat16
    assert int8_target.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their dtype
    logits = int8_target(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, tiny.VOCAB_SIZE)
    dense = target_model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.corrcoef(torch.stack([logits.float().flatten(), dense.flatten()]))[0, 1] > 0.98


def test_tied_embeddings_stay_bf16_and_the_head_gets_an_int8_copy():
    model = quantize_model(_tied_model())
    assert isinstance(model.lm_head, Int8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    embedding = model.model.embed_tokens.weight.detach().float()  # [vocab, hidden]
    error = (model.lm_head.dequantized() - embedding).abs()
    assert torch.all(error <= model.lm_head.scales.float()[:, None] * 0.51 + 1e-2 * embedding.abs())
    dense_head = quantize_model(_tied_model(), lm_head=False)
    assert dense_head.lm_head.weight is dense_head.model.embed_tokens.weight


@pytest.mark.parametrize("draft_kind", ["random", "same", "noisy"])
def test_speculation_is_greedy_exact_on_the_int8_engine(int8_target, int8_drafts, tokenizer, draft_kind):
    """Speculative decoding reproduces target-only decoding of the same int8 engine token
    for token (bf16 activations: the int8 kernel is row-invariant)."""
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in (*PROMPTS[:2], LONG_PROMPT):
        prompt_ids = tokenizer(prompt)["input_ids"]
        if prompt is LONG_PROMPT:  # its prefill takes the dense GEMM
            assert len(prompt_ids) > DENSE_MIN_ROWS
        reference = local_generator(int8_target, None, tokenizer).generate(
            prompt_ids, sampling, SpeculationConfig(policy="none")).token_ids
        assert len(set(reference)) > 10  # a varied reference, or exactness proves nothing
        for policy in POLICIES:
            result = local_generator(int8_target, int8_drafts[draft_kind], tokenizer).generate(
                prompt_ids, sampling, SpeculationConfig(policy=policy))
            assert result.token_ids == reference, (draft_kind, policy, prompt)


# --- loading and the quantized cache -----------------------------------------------------

def _load_int8(folder: Path, home: Path, role: str = "target"):
    return load_model(ModelConfig(spec=str(folder), dtype="int8"), role, home, progress=False)


def _logits(model, ids=(5, 9, 33, 2, 7)) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([list(ids)])).logits


def test_int8_load_is_cached_and_the_cache_round_trips(tiny_pair_dirs, tmp_path, monkeypatch):
    first = _load_int8(tiny_pair_dirs["target"], tmp_path)
    assert first.engine == "int8" and isinstance(first.model.lm_head, Int8Linear)
    dense = load_model(ModelConfig(spec=str(tiny_pair_dirs["target"]), dtype="float32"), "target", tmp_path,
                       progress=False)
    assert first.fingerprint == dense.fingerprint and first.eos_token_ids == dense.eos_token_ids
    folder = quantized_folder(tmp_path, first.name, first.fingerprint)
    manifest = json.loads((folder / quantize.MANIFEST_FILE).read_text())
    assert manifest["format"] == quantize.QUANT_FORMAT and manifest["fingerprint"] == first.fingerprint

    def no_requantizing(*_args, **_kwargs):
        raise AssertionError("the second load must read the cache, not quantize again")

    monkeypatch.setattr(quantize, "quantize_model", no_requantizing)
    second = _load_int8(tiny_pair_dirs["target"], tmp_path)
    assert isinstance(second.model.lm_head, Int8Linear) and second.engine == "int8"
    assert not any(t.is_meta for t in [*second.model.parameters(), *second.model.buffers()])
    # safetensors packs tensors back to back; the kernels get 64-byte aligned ones (AVX-512 crashed otherwise)
    assert all(t.data_ptr() % quantize.KERNEL_ALIGNMENT == 0 for t in second.model.state_dict().values() if t.numel())
    assert torch.equal(_logits(first.model), _logits(second.model))
    assert second.fingerprint == first.fingerprint and second.tokenizer_hash == first.tokenizer_hash
    assert second.vocab_size == first.vocab_size


def test_damaged_cache_is_quantized_again(tiny_pair_dirs, tmp_path):
    first = _load_int8(tiny_pair_dirs["draft"], tmp_path, role="draft")
    folder = quantized_folder(tmp_path, first.name, first.fingerprint)
    (folder / quantize.WEIGHTS_FILE).write_bytes(b"not safetensors")
    again = _load_int8(tiny_pair_dirs["draft"], tmp_path, role="draft")
    assert torch.equal(_logits(first.model), _logits(again.model))


def test_tied_model_cache_round_trip(tmp_path, tokenizer):
    folder = tmp_path / "tied"
    _tied_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    first = _load_int8(folder, tmp_path / "home")
    second = _load_int8(folder, tmp_path / "home")
    assert isinstance(second.model.lm_head, Int8Linear)
    assert second.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(first.model), _logits(second.model))


def test_engine_is_reported_by_info_and_metrics(tiny_pair_dirs, tmp_path):
    loaded = _load_int8(tiny_pair_dirs["target"], tmp_path)
    info = service_info_pb("target", loaded, 512, 0, SessionLimits(), 0)
    assert info.dtype == "int8"
    metrics = ServerMetrics("target", loaded.name)
    metrics.describe_engine("int8", "cpu", (0.25, 0.26, 0.3), loaded.prefill)
    text = metrics.exposition()
    assert 'disco_engine_info{device="cpu",engine="int8"} 1.0' in text
    assert 'disco_engine_forward_seconds{new_tokens="3"} 0.3' in text
    assert loaded.prefill and f'disco_prefill_info{{path="{loaded.prefill}"}} 1.0' in text  # chosen at load


def test_generate_cli_names_the_int8_engine(capsys, tiny_pair_dirs, tmp_path, monkeypatch):
    from disco_cli.main import main

    monkeypatch.setenv("DISCO_HOME", str(tmp_path))
    code = main(["generate", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--dtype", "int8", "--prompt", "def f(x):", "--policy", "static:3", "--max-new-tokens", "8",
                 "--ignore-eos"])
    err = capsys.readouterr().err
    assert code == 0 and "[static:3 | int8]" in err


# --- dtype selection ---------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_is_bf16_for_both_roles(device):
    assert resolve_dtype("auto", device) == resolve_dtype("auto", device, role="draft") == "bfloat16"


def test_auto_on_a_cpu_is_not_decided_without_a_measurement():
    with pytest.raises(ValueError, match="measurement"):
        resolve_dtype("auto", "cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_explicit_dtype_is_kept(dtype):
    assert resolve_dtype(dtype, "cpu") == dtype
    assert resolve_dtype(dtype, "cpu", role="draft") == dtype


def test_model_config_accepts_int8_and_refuses_unresolved_auto():
    ModelConfig(dtype="int8").validate()
    ModelConfig(dtype="int4").validate()
    with pytest.raises(InvalidRequest, match="resolved"):
        ModelConfig(dtype="auto").validate()
    with pytest.raises(InvalidRequest, match="dtype must be one of"):
        ModelConfig(dtype="int2").validate()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_weight_only_engines_are_refused_on_cuda_with_the_engines_that_run_there(dtype):
    ModelConfig(dtype=dtype, device="cpu").validate()
    for device in ("cuda", "cuda:1"):
        with pytest.raises(InvalidRequest, match="CPU only.*bfloat16 or float32"):
            ModelConfig(dtype=dtype, device=device).validate()
    ModelConfig(dtype="bfloat16", device="cuda").validate()


def test_float16_is_refused_on_cuda_with_the_reason_and_the_engines_that_are_exact_there():
    ModelConfig(dtype="float16", device="cpu").validate()
    for device in ("cuda", "cuda:1"):
        with pytest.raises(InvalidRequest, match="float16 engine is refused on cuda.*differ from target-only.*"
                                                 "use bfloat16 \\(exact there\\) or float32"):
            ModelConfig(dtype="float16", device=device).validate()
