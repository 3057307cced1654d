"""A GGUF file's own 4-bit weights, read as the int4 engine's groups without re-quantizing.

The default target ships as Q4_K_M: most linears are **Q4_K** tensors, super-blocks of 256
weights cut into 8 sub-blocks of 32, each weight ``d * sc * q - dmin * m`` with ``q`` in
[0, 15], 6-bit ``sc`` / ``m`` per sub-block and fp16 ``d`` / ``dmin`` per super-block. That is
an affine int4 grid per group of 32 inputs, which is what torch's int4 kernel multiplies
(:class:`disco.models.int4.Int4Linear`: ``w = (q - 8) * scale + zero``), so a Q4_K tensor maps
onto it with ``scale = d * sc`` and ``zero = 8 * d * sc - dmin * m``: the same ``q``, nothing
re-quantized. The kernel keeps scales and zeros in bf16 (its float32 path is 50x slower,
docs/engines.md), so only they round; what that costs is measured against the GGUF's own
float32 dequantization in docs/engines.md.

Other GGUF types (Q6_K, Q5_0, Q8_0, F16, ...) are not a 4-bit affine grid: their tensors are
re-quantized from the dequantized weights as before (:func:`disco.models.int4.quantize_weight_int4`).
:func:`native_int4_weights` says which tensors mapped; the caller checks each mapped weight
against the dense weight it replaces (:func:`matches_dense`), so a name or layout mismatch
(an architecture whose converter permutes rows) falls back to re-quantizing instead of
loading wrong weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Weights per Q4_K super-block and per sub-block (the int4 group it maps onto).
QK_K = 256
Q4_K_GROUP = 32
_Q4_K_BYTES = 2 + 2 + 12 + QK_K // 2  # d, dmin, packed 6-bit scales and mins, 4-bit quants
_MID = 8  # the kernel's offset: w = (q - 8) * scale + zero


@dataclass(frozen=True)
class Int4Groups:
    """One linear weight as int4 groups of :data:`Q4_K_GROUP` inputs: ``w = (q - 8) * scale + zero``.

    ``q``: uint8 ``[out_features, in_features]`` in [0, 15]; ``scales``, ``zeros``: float32
    ``[out_features, in_features // 32]``; ``source_type``: the GGUF type it came from."""
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    source_type: str

    def dequantized(self) -> torch.Tensor:
        """The weights ``[out_features, in_features]`` in float32 (the scales unrounded)."""
        out_features, in_features = self.q.shape
        grouped = self.q.float().view(out_features, -1, Q4_K_GROUP) - _MID
        return (grouped * self.scales[..., None] + self.zeros[..., None]).view(out_features, in_features)


def q4_k_groups(blocks: np.ndarray,  # uint8 [out_features, in_features // 256 * 144], the tensor's rows
                out_features: int, in_features: int) -> Int4Groups:
    """Decode Q4_K super-blocks into int4 groups of 32, exactly (no rounding)."""
    if in_features % QK_K:
        raise ValueError(f"a Q4_K tensor has whole super-blocks of {QK_K} inputs, got {in_features}")
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, _Q4_K_BYTES)  # [super-blocks, 144]
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _q4_k_scales_and_mins(raw[:, 4:16])  # [n, 8] each, 6-bit integers
    # 128 bytes of quants: four chunks of 32 bytes; a chunk's low nibbles are sub-block 2c,
    # its high nibbles sub-block 2c + 1 (ggml's dequantize_row_q4_K).
    quants = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (quants & 0x0F).reshape(out_features, in_features)
    scales = (d * sc).reshape(out_features, in_features // Q4_K_GROUP)  # exact: fp16 x 6-bit fits float32
    mins = (dmin * m).reshape(out_features, in_features // Q4_K_GROUP)
    return Int4Groups(q=torch.from_numpy(q.astype(np.uint8)), scales=torch.from_numpy(scales),
                      zeros=torch.from_numpy(_MID * scales - mins), source_type="Q4_K")


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # packed: uint8 [n, 12]
    """The 8 six-bit scales and mins of each super-block (ggml's ``get_scale_min_k4``)."""
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def native_int4_weights(gguf_path: Path, hf_names: list[str]) -> tuple[dict[str, Int4Groups], dict[str, str]]:
    """The weights among ``hf_names`` (HF parameter names, e.g.
    ``model.layers.0.self_attn.q_proj.weight``) that the file stores as Q4_K, as int4 groups.

    Returns ``(mapped, types)``: ``mapped[name]`` for each Q4_K weight, ``types[name]`` the
    GGUF type of every name found in the file (for the report of what happened to each)."""
    import gguf  # NOTE: imported here: only loads that read a .gguf need it

    reader = gguf.GGUFReader(str(gguf_path))
    arch_field = reader.fields["general.architecture"]
    arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode()
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        logger.info("%s: architecture %r unknown to the gguf package; every weight re-quantized", gguf_path, arch_name)
        return {}, {}
    blocks = max((int(name.split(".")[1]) + 1 for name in (t.name for t in reader.tensors)
                  if name.startswith("blk.")), default=0)
    name_map = gguf.get_tensor_name_map(arch, blocks)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    mapped: dict[str, Int4Groups] = {}
    types: dict[str, str] = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        tensor = tensors.get(gguf_name or "")
        if tensor is None:
            continue
        types[hf_name] = tensor.tensor_type.name
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_K:
            in_features, out_features = (int(size) for size in tensor.shape[:2])  # ggml order: inputs first
            mapped[hf_name] = q4_k_groups(np.asarray(tensor.data), out_features, in_features)
    return mapped, types


def matches_dense(groups: Int4Groups, dense: torch.Tensor) -> bool:  # dense: [out_features, in_features]
    """Whether ``groups`` is the weight ``dense`` holds (a dense copy rounded to bf16 or
    coarser agrees within that rounding): the check that the names and layout mapped."""
    if tuple(dense.shape) != tuple(groups.q.shape):
        return False
    exact = groups.dequantized()
    reference = dense.detach().float()
    tolerance = exact.abs() * 2.0 ** -7 + 1e-6  # bf16 keeps 8 significant bits
    return bool(((exact - reference).abs() <= tolerance).all())


def checked_native_weights(gguf_path: Path, model: torch.nn.Module) -> tuple[dict[str, Int4Groups], dict]:
    """The Q4_K weights of ``gguf_path`` for ``model``'s linears (the dense model converted
    from that file), each checked against the dense weight it replaces (:func:`matches_dense`;
    one that does not match is left out and re-quantized). Returns ``(mapped, report)``:
    ``report`` counts the linears kept as they are (``native_int4``) and the others by
    GGUF type (``requantized``), for the cache manifest and the load log."""
    linears = {f"{name}.weight": module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)}
    found, types = native_int4_weights(gguf_path, list(linears))
    mapped = {name: groups for name, groups in found.items() if matches_dense(groups, linears[name].weight)}
    for name in sorted(set(found) - set(mapped)):
        logger.warning("%s: %s does not match the converted weight; re-quantized instead", gguf_path.name, name)
    requantized: dict[str, int] = {}
    for name in linears:
        if name not in mapped:
            kind = types.get(name, "not in file")
            requantized[kind] = requantized.get(kind, 0) + 1
    report = {"gguf_file": gguf_path.name, "native_int4": len(mapped), "requantized": requantized}
    return mapped, report
