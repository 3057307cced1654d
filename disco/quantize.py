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

Prefill blocks: ``_weight_int8pack_mm`` costs ~0.7 ms per row of a 1536x8960 linear past
4 rows, so a prompt of a few hundred tokens took seconds (a 200-token prefill of the 1.5B
target: 9.9 s). A long prefill block instead runs as one float32 GEMM over the same int8
weights (``(x @ q^T) * scale``, the int8 weights converted to float32 512 output channels
at a time, so the converted slice stays in cache and nothing extra is kept in memory):
measured on a 1536x8960 linear (AVX2, 2 threads) 15 / 25 / 47 ms for 64 / 128 / 256 rows
against 21 / 45 / 105 ms in the int8 kernel (a float32 copy of the whole weight: 22 / 30 /
55 ms, and 4 bytes per weight more memory). Which packed rows do so is set per
forward by :func:`dense_prefill` (:func:`disco.packed_forward.packed_forward` passes the
spans of prefill blocks of at least :data:`DENSE_MIN_ROWS` tokens); each span is
multiplied on its own, so its bits depend on its own rows only (a prefill gives the same
cache alone and batched). Decoding and verification rows always take the int8 kernel.

A quantized model is cached as one safetensors file holding every tensor of the model
(int8 weights, scales, the bf16 rest, non-persistent buffers included), so a second
load builds the model skeleton on the meta device and assigns the tensors: seconds, no
dense weights read and nothing re-quantized (:func:`save_quantized`,
:func:`load_quantized`).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

#: Version of the quantized format (the cache is keyed by it).
QUANT_FORMAT = "int8wo-v1"
#: Compute dtype of the int8 engine's activations and non-linear parts.
COMPUTE_DTYPE = torch.bfloat16
#: Whether the LM head is quantized too (decided by measurement, docs/engines.md).
QUANTIZE_LM_HEAD = True
#: Written last into a cache folder: marks it complete and says what it holds.
MANIFEST_FILE = "disco_quantized.json"
WEIGHTS_FILE = "model.safetensors"

#: A prefill block of at least this many tokens runs as a float32 GEMM (docstring above).
DENSE_MIN_ROWS = 48
#: Row spans ``(start, end)`` of the current forward that run dense; set by :func:`dense_prefill`
#: (per thread and context, like torch's grad mode).
_DENSE_SPANS: ContextVar[tuple[tuple[int, int], ...]] = ContextVar("disco_int8_dense_spans", default=())

_DENSE_CHUNK = 512  # output channels converted to float32 at once by the dense prefill GEMM
_QMAX = 127
_CHUNK_ROWS = 8192  # rows quantized at once (bounds the float32 copy of a 150k-row LM head)
_OP = "aten::_weight_int8pack_mm"


class Int8Linear(nn.Module):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()  # [rows, in_features]
        spans = _DENSE_SPANS.get()
        if not spans:
            out = self._int8(rows)
        else:
            pieces, done = [], 0
            for start, end in spans:
                if start > done:
                    pieces.append(self._int8(rows[done:start]))
                pieces.append(self._dense(rows[start:end]))
                done = end
            if done < rows.shape[0]:
                pieces.append(self._int8(rows[done:]))
            out = torch.cat(pieces)  # [rows, out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _int8(self, rows: torch.Tensor) -> torch.Tensor:  # rows: [n, in_features] -> [n, out_features]
        if rows.device.type == "cpu" or torch._C._dispatch_has_kernel_for_dispatch_key(
                _OP, rows.device.type.upper()):
            return torch._weight_int8pack_mm(rows, self.weight, self.scales)
        # NOTE: no int8 kernel on this device: dequantize on the fly (correct, not fast)
        return torch.nn.functional.linear(rows, self.weight.to(rows.dtype)) * self.scales

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:  # rows: [n, in_features] -> [n, out_features]
        """A prefill block: float32 GEMMs over the int8 weights converted a slice of output
        channels at a time (the slice stays in cache), scaled per output channel."""
        inputs = rows.float()  # [n, in_features]
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=rows.device)
        for start in range(0, self.out_features, _DENSE_CHUNK):
            weight = self.weight[start: start + _DENSE_CHUNK].float()  # [chunk, in_features]
            out[:, start: start + _DENSE_CHUNK] = inputs @ weight.T
        return (out * self.scales.float()).to(rows.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer effectively multiplies by, ``[out_features, in_features]`` float32."""
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scales={self.scales.dtype}")


@contextmanager
def dense_prefill(spans: Sequence[tuple[int, int]]) -> Iterator[None]:
    """Within this block, :class:`Int8Linear` s multiply the packed rows ``start:end`` of
    each span as a float32 GEMM (sorted, non-overlapping spans; empty: none)."""
    token = _DENSE_SPANS.set(tuple(spans))
    try:
        yield
    finally:
        _DENSE_SPANS.reset(token)


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
                   dtype: torch.dtype = COMPUTE_DTYPE) -> nn.Module:
    """Turn ``model`` into the int8 engine in place and return it.

    The model's parameters are cast to ``dtype`` (buffers such as rotary frequencies
    keep theirs, as ``from_pretrained(dtype=...)`` leaves them), then every ``nn.Linear``
    is replaced by an :class:`Int8Linear` (the output embedding only if ``lm_head``). A
    tied output embedding gets an int8 copy; the input embedding keeps its ``dtype``
    weights.
    """
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (module is output and not lm_head):
            continue
        _set_submodule(model, name, Int8Linear.from_weight(module.weight, module.bias, dtype))
    return model


def int8_skeleton(model: nn.Module, lm_head: bool = QUANTIZE_LM_HEAD, dtype: torch.dtype = COMPUTE_DTYPE) -> nn.Module:
    """Replace the linears of a meta-device model by empty :class:`Int8Linear` s (to be filled
    by :func:`load_quantized`), exactly where :func:`quantize_model` puts them."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (module is output and not lm_head):
            continue
        _set_submodule(model, name, Int8Linear(module.in_features, module.out_features, module.bias is not None,
                                               dtype, device="meta"))
    return model


def save_quantized(model: nn.Module, folder: Path, manifest: dict) -> None:
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
        (tmp / MANIFEST_FILE).write_text(json.dumps({**manifest, "format": QUANT_FORMAT, "aliases": aliases},
                                                    indent=2) + "\n")
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


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a complete cache folder of the current format, else ``None``."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == QUANT_FORMAT else None


def load_quantized(skeleton: nn.Module, folder: Path, device: str = "cpu") -> nn.Module:
    """Fill a meta-device :func:`int8_skeleton` with the tensors saved in ``folder``.

    Raises:
        ValueError: the file does not match the skeleton (a tensor missing, extra, or
            of another shape), so the cache cannot be used.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder} holds no complete quantized model of format {QUANT_FORMAT}")
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
        _assign(skeleton, name, tensor)
    for name, source in manifest.get("aliases", {}).items():
        _assign(skeleton, name, stored[source])
    return skeleton


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
