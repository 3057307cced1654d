"""Int8 weight-only linears: the ``--dtype int8`` engine.

Every ``nn.Linear`` of a model becomes an :class:`Int8Linear`: its weight quantized
symmetrically per output channel (``w ≈ q * scale``, ``q`` in [-127, 127], one scale per
output row), its activations left in the model's compute dtype (bfloat16). The product
runs in ``torch._weight_int8pack_mm``, the CPU kernel that reads the int8 weights
directly (on AVX2 it is 1.5-3x faster than a bf16 linear at 1-8 rows; docs/engines.md
has the measurements and why torchao is not used). Everything else (embeddings, norms,
rotary, attention) runs in bfloat16 as in the dense engine.

Row invariance: the kernel computes each output row from its input row alone, so a row
gets the same bits whether it is multiplied alone or with others. A verification
forward over k + 1 tokens and k + 1 single-token forwards then agree in every linear,
and packed cross-session batching stays bit-exact (tests/test_int8.py checks it).

Long prefill blocks run as float32 GEMMs over the same weights (:mod:`disco.models.weight_only`).

A quantized model is cached as one safetensors file holding every tensor of the model
(int8 weights, scales, the bf16 rest, non-persistent buffers included), so a second
load builds the model skeleton on the meta device and assigns the tensors: seconds, no
dense weights read and nothing re-quantized (:func:`save_quantized`,
:func:`load_quantized`).

The cache is keyed by format and by device kind: the folder's name carries the format
(:data:`QUANT_FORMATS`, ``disco.models.loading.quantized_folder``), and the manifest names the
device kind whose kernels the tensors are laid out for (:data:`CACHE_DEVICE`: int4's packed
weights are in the layout of ``_convert_weight_to_int4pack_for_cpu``, which a CUDA int4
kernel would read as other numbers). :func:`read_manifest` and :func:`load_quantized` refuse
a cache of another format or device kind; a manifest from before the field was written for
the CPU (the only device these engines run on: ``ModelConfig.validate`` refuses int8/int4 on
CUDA). NOTE: the folder name holds no device because only CPU layouts exist; an engine with
CUDA weight-only kernels gets formats of its own in :data:`QUANT_FORMATS`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from disco.models.gguf_blocks import Int4Groups
from disco.models.int4 import GROUP_SIZE, Int4Linear, int4_fits
from disco.models.model_record import weights_changed
from disco.models.weight_only import WeightOnlyLinear, chunked_gemm

#: Version of the quantized format per engine (the cache is keyed by it).
QUANT_FORMATS = {"int8": "int8wo-v1", "int4": f"int4wo-g{GROUP_SIZE}-v2"}  # v2: a GGUF's Q4_K kept as it is
QUANT_FORMAT = QUANT_FORMATS["int8"]
#: Compute dtype of the int8 engine's activations and non-linear parts.
COMPUTE_DTYPE = torch.bfloat16
#: Whether the LM head is quantized too (decided by measurement, docs/engines.md).
QUANTIZE_LM_HEAD = True
#: The device kind the cached tensors are laid out for (the weight-only kernels are torch's CPU ops).
CACHE_DEVICE = "cpu"
#: Written last into a cache folder: marks it complete and says what it holds.
MANIFEST_FILE = "disco_quantized.json"
WEIGHTS_FILE = "model.safetensors"

_QMAX = 127
_CHUNK_ROWS = 8192  # rows quantized at once (bounds the float32 copy of a 150k-row LM head)
_OP = "aten::_weight_int8pack_mm"


class Int8Linear(WeightOnlyLinear):
    """A linear layer with int8 weights (per-output-channel scales) and floating activations.

    Buffers: ``weight`` int8 ``[out_features, in_features]``, ``scales``
    ``[out_features]`` in the compute dtype, optional ``bias`` ``[out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = COMPUTE_DTYPE, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor,  # [out_features, in_features], any float dtype
                    bias: torch.Tensor | None = None,  # [out_features]
                    dtype: torch.dtype = COMPUTE_DTYPE) -> "Int8Linear":
        """Quantize ``weight`` symmetrically per output row."""
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, bias is not None, dtype, weight.device)
        quantized, scales = quantize_weight(weight, dtype)
        module.weight = quantized
        module.scales = scales
        if bias is not None:
            module.bias = bias.detach().to(dtype).clone()
        return module

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:  # rows: [n, in_features] -> [n, out_features]
        if rows.device.type == "cpu" or torch._C._dispatch_has_kernel_for_dispatch_key(
                _OP, rows.device.type.upper()):
            return torch._weight_int8pack_mm(rows, self.weight, self.scales)
        # NOTE: no int8 kernel on this device: dequantize on the fly (correct, not fast)
        return torch.nn.functional.linear(rows, self.weight.to(rows.dtype)) * self.scales

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:  # rows: [n, in_features] -> [n, out_features]
        """A prefill block: float32 GEMMs over the int8 weights converted a slice of output
        channels at a time (the slice stays in cache), scaled per output channel."""
        out = chunked_gemm(rows, self.out_features, lambda start, end, buffer: buffer.copy_(self.weight[start:end]),
                           self.dense_dtype)
        return (out * self.scales.float()).to(rows.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer effectively multiplies by, ``[out_features, in_features]`` float32."""
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scales={self.scales.dtype}")


def quantize_weight(weight: torch.Tensor,  # [out_features, in_features]
                    dtype: torch.dtype = COMPUTE_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization.

    The scales are rounded to ``dtype`` first and the weights divided by the rounded
    scales, so ``q * scale`` is the nearest grid point of the scale the kernel uses.

    Returns:
        ``(q, scales)``: int8 ``[out_features, in_features]`` and ``dtype`` ``[out_features]``.
    """
    weight = weight.detach()
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=dtype, device=weight.device)
    for start in range(0, weight.shape[0], _CHUNK_ROWS):
        rows = weight[start: start + _CHUNK_ROWS].float()  # [chunk, in_features]
        absmax = rows.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax / _QMAX, torch.ones_like(absmax)).to(dtype)
        scales[start: start + _CHUNK_ROWS] = scale
        quantized[start: start + _CHUNK_ROWS] = torch.round(rows / scale.float()[:, None]).clamp(-_QMAX, _QMAX)
    return quantized, scales


def quantize_model(model: nn.Module, lm_head: bool = QUANTIZE_LM_HEAD,
                   dtype: torch.dtype = COMPUTE_DTYPE, engine: str = "int8",
                   native: Mapping[str, Int4Groups] | None = None) -> nn.Module:
    """Turn ``model`` into the int8 (or ``engine="int4"``: :mod:`disco.models.int4`, int8 where
    int4 does not fit a linear's shape) engine in place and return it.

    The model's parameters are cast to ``dtype`` (buffers such as rotary frequencies
    keep theirs, as ``from_pretrained(dtype=...)`` leaves them), then every ``nn.Linear``
    is replaced by an :class:`Int8Linear` (the output embedding only if ``lm_head``). A
    tied output embedding gets an int8 copy; the input embedding keeps its ``dtype``
    weights. ``native``: int4 weights as they are, by parameter name (``<linear>.weight``;
    a GGUF's Q4_K blocks, :func:`disco.models.gguf_blocks.native_int4_weights`), used instead
    of quantizing that linear's dense weight.
    """
    native = native or {}
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (module is output and not lm_head):
            continue
        kind = Int4Linear if engine == "int4" and int4_fits(module) else Int8Linear
        groups = native.get(f"{name}.weight") if kind is Int4Linear else None
        _set_submodule(model, name, kind.from_weight(module.weight, module.bias, dtype) if groups is None else
                       Int4Linear.from_groups(groups.q, groups.scales, groups.zeros, module.bias, dtype))
    weights_changed(model)
    return model


def quantized_skeleton(model: nn.Module, lm_head: bool = QUANTIZE_LM_HEAD, dtype: torch.dtype = COMPUTE_DTYPE,
                       engine: str = "int8") -> nn.Module:
    """Replace the linears of a meta-device model by empty quantized linears (to be filled
    by :func:`load_quantized`), exactly where and as :func:`quantize_model` puts them."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (module is output and not lm_head):
            continue
        kind = Int4Linear if engine == "int4" and int4_fits(module) else Int8Linear
        _set_submodule(model, name, kind(module.in_features, module.out_features, module.bias is not None,
                                         dtype, device="meta"))
    weights_changed(model)
    return model


def save_quantized(model: nn.Module, folder: Path, manifest: dict, engine: str = "int8") -> None:
    """Write every tensor of ``model`` (parameters and buffers, non-persistent ones too)
    into ``folder``; the manifest (with the tensors' aliases) is written last, and the
    folder appears under its final name only when complete."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, tensor in _named_tensors(model):
        key = id(tensor)
        if key in seen:  # tied weights: stored once
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().cpu().contiguous()
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / MANIFEST_FILE).write_text(json.dumps({**manifest, "format": QUANT_FORMATS[engine],
                                                     "device": CACHE_DEVICE, "aliases": aliases}, indent=2) + "\n")
        for path in tmp.iterdir():  # NOTE: services may run as another user
            path.chmod(0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if (folder / MANIFEST_FILE).is_file():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def read_manifest(folder: Path, device: str = CACHE_DEVICE) -> dict | None:
    """The manifest of a complete cache folder of a current format laid out for ``device``'s
    kind (a manifest without ``"device"``: :data:`CACHE_DEVICE`, all that was written before
    the field), else ``None``."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") not in QUANT_FORMATS.values():
        return None
    return manifest if manifest.get("device", CACHE_DEVICE) == torch.device(device).type else None


def load_quantized(skeleton: nn.Module, folder: Path, device: str = "cpu") -> nn.Module:
    """Fill a meta-device :func:`quantized_skeleton` with the tensors saved in ``folder``,
    for ``device`` (the cache must be laid out for its kind).

    Raises:
        ValueError: no complete cache of a current format for ``device``'s kind, or the file
            does not match the skeleton (a tensor missing, extra, or of another shape), so the
            cache cannot be used.
    """
    manifest = read_manifest(folder, device)
    if manifest is None:
        raise ValueError(f"{folder} holds no complete quantized model of a current format for "
                         f"{torch.device(device).type}")
    stored = load_file(str(folder / WEIGHTS_FILE), device=device)
    expected = dict(_named_tensors(skeleton))
    names = set(stored) | set(manifest.get("aliases", {}))
    if names != set(expected):
        missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
        raise ValueError(f"quantized cache does not match the model: missing {missing[:3]}, extra {extra[:3]}")
    for name, tensor in stored.items():
        if tuple(tensor.shape) != tuple(expected[name].shape) or tensor.dtype != expected[name].dtype:
            raise ValueError(f"quantized cache tensor {name} is {tensor.dtype}{list(tensor.shape)}, "
                             f"the model expects {expected[name].dtype}{list(expected[name].shape)}")
        stored[name] = _aligned(tensor)
        _assign(skeleton, name, stored[name])
    for name, source in manifest.get("aliases", {}).items():
        _assign(skeleton, name, stored[source])
    return skeleton


#: Bytes of alignment the CPU kernels may assume (AVX-512 vectors; torch's CPU allocator gives 64).
KERNEL_ALIGNMENT = 64


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied where it does not start on a :data:`KERNEL_ALIGNMENT` boundary.

    NOTE: a safetensors file packs tensors back to back, so a loaded tensor can start at
    any byte. ``torch._weight_int8pack_mm``'s AVX-512 path (CPUs with AVX-512/AMX) crashed
    with a segmentation fault on scales at an address 56 mod 64 (torch 2.13.0+cpu); the
    AVX2 path did not. A fresh allocation is aligned."""
    if tensor.device.type != "cpu" or tensor.data_ptr() % KERNEL_ALIGNMENT == 0:
        return tensor
    return tensor.clone()


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by its full name, shared ones under each name."""
    named = []
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    named.append((f"{prefix}.{name}" if prefix else name, tensor))
    return named


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    prefix, _, attribute = name.rpartition(".")
    module = model.get_submodule(prefix) if prefix else model
    if attribute in module._parameters:
        module._parameters[attribute] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attribute] = tensor


def _set_submodule(model: nn.Module, name: str, replacement: nn.Module) -> None:
    prefix, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(prefix) if prefix else model, attribute, replacement)
