"""Int4 weight-only linears: the draft's engine on CPUs without bf16 units (``int4``).

A draft forward on an AVX2 CPU is bound by reading its weights from memory: the 0.5B
draft in int8 spends 84% of a one-token forward in ``_weight_int8pack_mm`` (profiled),
and half the bytes per weight make the same linears ~1.6x faster (24 layers of the
draft's linears at one row: 57 ms int8, 31-38 ms int4; its 151,936-row LM head 18 ms
int8, 11 ms int4; docs/engines.md). Only the draft runs in int4 by default (``--dtype
auto``): its quality decides only how many tokens are accepted, never the output.

Each ``nn.Linear`` becomes an :class:`Int4Linear`: weights quantized asymmetrically per
group of :data:`GROUP_SIZE` input features (``w ≈ (q - 8) * scale + zero``, ``q`` in
[0, 15], a bf16 scale and zero per group and output channel: the layout of torch's
``_weight_int4pack_mm_for_cpu`` kernel), activations bf16. The kernel computes each
output row from its input row alone (row-invariant, tested), so drafting stays bit-exact
alone and batched. Long prefill blocks run as float32 GEMMs over the same weights
(:mod:`disco.models.weight_only`), from an unpacked int8 copy of ``q - 8`` (one byte per
weight more: the packed layout has no cheap float32 view). A linear whose input size is
not a multiple of 32 (or output size not of 16) stays int8 (:func:`int4_fits`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from disco.models import q4q8
from disco.models.model_record import weights_changed
from disco.models.weight_only import WeightOnlyLinear, chunked_gemm

#: Input features per quantization group (the kernel takes 32, 64, 128 or 256): 32 is a GGUF
#: Q4_K sub-block, so the shipped target's weights map onto the groups as they are
#: (:mod:`disco.models.gguf_blocks`); the kernel costs the same at 32 and 64 (docs/engines.md).
GROUP_SIZE = 32
_OUT_MULTIPLE = 16  # the packed layout's output-channel tile
_LEVELS = 15
_MID = 8


def group_size_for(in_features: int) -> int | None:
    """The group size a linear of ``in_features`` inputs gets (``None``: int4 does not fit)."""
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else None


def int4_fits(module: nn.Linear) -> bool:
    """Whether the kernel takes the shape: input size a multiple of 32, output of 16."""
    return group_size_for(module.in_features) is not None and module.out_features % _OUT_MULTIPLE == 0


class Int4Linear(WeightOnlyLinear):
    """A linear layer with group-wise int4 weights and bf16 activations.

    Buffers: ``packed`` uint8 ``[out_features, in_features // 2]`` (the kernel's layout),
    ``scales_and_zeros`` bf16 ``[in_features // group, out_features, 2]``, ``centered``
    int8 ``[out_features, in_features]`` (``q - 8``, for the dense prefill GEMM), optional
    ``bias`` bf16 ``[out_features]``.

    Decoded rows go to torch's kernel, or, after :meth:`use_kernel` with
    a kernel of :data:`disco.models.q4q8.KERNELS`, to the q4 x q8 kernel over a repacked copy of
    the same weights, ``q4q8_weights`` (``packed`` and ``centered`` are then freed: the
    prefill GEMMs dequantize from the repacked copy, to the same bits).
    """

    #: The kernel of decoded rows (:func:`disco.models.q4q8.choose_kernel` picks it at load).
    kernel = q4q8.TORCH_KERNEL

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        group = group_size_for(in_features)
        if group is None:
            raise ValueError(f"int4 needs input features divisible by {GROUP_SIZE}, got {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales_and_zeros",
                             torch.empty(in_features // group, out_features, 2, dtype=dtype, device=device))
        self.register_buffer("centered", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor,  # [out_features, in_features], any float dtype
                    bias: torch.Tensor | None = None,  # [out_features]
                    dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, bias is not None, dtype, weight.device)
        q, scales, zeros = quantize_weight_int4(weight, module.group_size, dtype)
        return module._filled(q, scales, zeros, bias)

    @classmethod
    def from_groups(cls, q: torch.Tensor,  # uint8 [out_features, in_features], in [0, 15]
                    scales: torch.Tensor,  # [out_features, in_features // GROUP_SIZE]
                    zeros: torch.Tensor,  # [out_features, in_features // GROUP_SIZE]
                    bias: torch.Tensor | None = None,  # [out_features]
                    dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """A layer over weights already on an int4 grid, ``w = (q - 8) * scale + zero`` per
        group of :data:`GROUP_SIZE` inputs (a GGUF's Q4_K blocks, :mod:`disco.models.gguf_blocks`):
        ``q`` is kept as it is, the scales and zeros rounded to ``dtype``."""
        out_features, in_features = q.shape
        module = cls(in_features, out_features, bias is not None, dtype, q.device)
        if tuple(scales.shape) != (out_features, in_features // module.group_size) or scales.shape != zeros.shape:
            raise ValueError(f"scales/zeros {list(scales.shape)}/{list(zeros.shape)} do not fit groups of "
                             f"{module.group_size} over a weight {list(q.shape)}")
        return module._filled(q, scales.to(dtype), zeros.to(dtype), bias)

    def _filled(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None) -> "Int4Linear":
        """Pack ``q`` (uint8 ``[out, in]``) and the ``[out, groups]`` scales and zeros into the buffers."""
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.centered = (q.to(torch.int16) - _MID).to(torch.int8)
        if bias is not None:
            self.bias = bias.detach().to(scales.dtype).clone()
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def use_kernel(self, kernel: str) -> None:
        """Multiply decoded rows with ``kernel`` (one of :data:`disco.models.q4q8.KERNELS` needs
        its build loaded: :func:`disco.models.q4q8.load`)."""
        if kernel == self.kernel:
            return
        if kernel not in q4q8.KERNELS or self.kernel != q4q8.TORCH_KERNEL:
            raise ValueError(f"cannot switch an int4 linear from {self.kernel} to {kernel}")
        if q4q8.loaded_kernel() != kernel:
            raise ValueError(f"{kernel} is not the kernel loaded in this process ({q4q8.loaded_kernel()})")
        q = (self.centered.to(torch.int16) + _MID).to(torch.uint8)
        self.q4q8_weights = q4q8.pack(q, self.scales_and_zeros[:, :, 0].T, self.scales_and_zeros[:, :, 1].T)
        # Both the rows and the prefill GEMMs now read the repacked copy: the other two go.
        self.packed = torch.empty(0, dtype=torch.uint8, device=self.packed.device)
        self.centered = torch.empty(0, dtype=torch.int8, device=self.centered.device)
        self.kernel = kernel

    def probe_twin(self, weight: torch.Tensor,  # [out_features, in_features]
                   bias: torch.Tensor | None) -> "Int4Linear":  # [out_features]
        twin = Int4Linear.from_weight(weight, bias, self.compute_dtype)
        twin.use_kernel(self.kernel)
        return twin

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:  # rows: [n, in_features] -> [n, out_features]
        if self.kernel in q4q8.KERNELS:
            return q4q8.mm(rows, self.q4q8_weights, self.out_features)
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:  # rows: [n, in_features] -> [n, out_features]
        return chunked_gemm(rows, self.out_features, self._fill_dense_slice, self.dense_dtype,
                            fills_dtype=self.kernel in q4q8.KERNELS).to(rows.dtype)

    def _fill_dense_slice(self, start: int, end: int, buffer: torch.Tensor) -> None:
        """Write the weights of output channels ``start:end`` into ``buffer`` ``[end - start,
        in_features]``, in place: ``(q - 8) * scale + zero`` per group in float32 (with the q4 x q8
        kernel, rounded to ``buffer``'s dtype in the same pass)."""
        if self.kernel in q4q8.KERNELS:
            q4q8.dequantize(self.q4q8_weights, self.out_features, self.in_features, start, end, buffer)
            return
        groups = self.in_features // self.group_size
        scales = self.scales_and_zeros[:, start:end, 0].T.float()  # [channels, groups]
        zeros = self.scales_and_zeros[:, start:end, 1].T.float()
        buffer.copy_(self.centered[start:end])
        grouped = buffer.view(end - start, groups, self.group_size)
        grouped.mul_(scales[..., None]).add_(zeros[..., None])

    def dequantized(self) -> torch.Tensor:
        """The weight the layer effectively multiplies by, ``[out_features, in_features]`` float32."""
        weights = torch.empty(self.out_features, self.in_features, dtype=torch.float32,
                              device=self.scales_and_zeros.device)
        self._fill_dense_slice(0, self.out_features, weights)
        return weights

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, kernel={self.kernel}")


def use_chosen_kernel(model: nn.Module, home: Path) -> q4q8.KernelChoice | None:
    """Give every :class:`Int4Linear` of ``model`` the kernel chosen for this machine
    (:func:`disco.models.q4q8.choose_kernel`); ``None`` where the model has none."""
    linears = [module for module in model.modules() if isinstance(module, Int4Linear)]
    if not linears:
        return None
    choice = q4q8.choose_kernel(home)
    for module in linears:
        module.use_kernel(choice.kernel)
    weights_changed(model)
    return choice


def quantize_weight_int4(weight: torch.Tensor,  # [out_features, in_features]
                         group_size: int, dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: ``w ≈ (q - 8) * scale + zero`` with ``q`` in [0, 15].

    Scales and zeros are rounded to ``dtype`` first and ``q`` computed against the rounded
    values, so ``(q - 8) * scale + zero`` is the nearest grid point the kernel uses.

    Returns:
        ``(q, scales, zeros)``: uint8 ``[out, in]``, ``dtype`` ``[out, in // group_size]`` twice.
    """
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / _LEVELS).clamp(min=1e-8).to(dtype)
    zeros = (low + _MID * scales.float()).to(dtype)
    origin = zeros.float() - _MID * scales.float()  # the value of q = 0
    q = torch.round((groups - origin[..., None]) / scales.float()[..., None]).clamp(0, _LEVELS)
    return q.to(torch.uint8).reshape(out_features, in_features), scales, zeros
