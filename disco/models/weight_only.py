"""Which rows of a forward the weight-only engines multiply as float32 GEMMs (prefill blocks).

The int8 and int4 kernels (``torch._weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
are fastest for a few rows, but their cost grows linearly past ~4 rows: a 200-token
prefill of the 1.5B target took 9.9 s in int8. A long prefill block instead runs as a
float32 GEMM over the same quantized weights, converted to float32 a slice of output
channels at a time (the slice stays in cache, nothing extra is kept in memory); measured
on a 1536x8960 linear (AVX2, 2 threads): 15 / 25 / 47 ms for 64 / 128 / 256 rows against
21 / 45 / 105 ms in the int8 kernel (a float32 copy of the whole weight: 22 / 30 / 55 ms,
and 4 bytes per weight more memory).

:func:`disco.engines.packed_forward.packed_forward` names the packed rows of prefill blocks of at
least :data:`DENSE_MIN_ROWS` tokens (:func:`dense_prefill`); each weight-only linear splits
its rows with :func:`split_rows`. Each span is multiplied on its own, so its bits depend on
its own rows only (a prefill gives the same cache alone and batched); decoding and
verification rows always take the row-invariant quantized kernel. The row-stable bf16/fp16
linears (:mod:`disco.models.row_stable`) split the same way: a span is one plain call instead of
32-row chunks.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

#: A prefill block of at least this many tokens runs as a float32 GEMM.
DENSE_MIN_ROWS = 48
#: Output channels converted to float32 at once by a dense GEMM.
DENSE_CHUNK = 512

# Row spans ``(start, end)`` of the forward in flight that run dense; set by
# :func:`dense_prefill`, per thread and context (like torch's grad mode).
_SPANS: ContextVar[tuple[tuple[int, int], ...]] = ContextVar("disco_dense_prefill_spans", default=())


@contextmanager
def dense_prefill(spans: Sequence[tuple[int, int]]) -> Iterator[None]:
    """Within this block, weight-only linears multiply the packed rows ``start:end`` of each
    span as a float32 GEMM (sorted, non-overlapping spans; empty: none)."""
    token = _SPANS.set(tuple(spans))
    try:
        yield
    finally:
        _SPANS.reset(token)


def split_rows(rows: torch.Tensor,  # [n, in_features]
               quantized: Callable[[torch.Tensor], torch.Tensor],
               dense: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``quantized(rows)``, except the spans of :func:`dense_prefill`, which go to ``dense``
    one span at a time. Returns ``[n, out_features]``."""
    spans = _SPANS.get()
    if not spans:
        return quantized(rows)
    pieces, done = [], 0
    for start, end in spans:
        if start > done:
            pieces.append(quantized(rows[done:start]))
        pieces.append(dense(rows[start:end]))
        done = end
    if done < rows.shape[0]:
        pieces.append(quantized(rows[done:]))
    return torch.cat(pieces)


def chunked_gemm(rows: torch.Tensor,  # [n, in_features], any float dtype
                 out_features: int,
                 fill_slice: Callable[[int, int, torch.Tensor], None]) -> torch.Tensor:
    """``rows @ W^T`` in float32, ``W`` given a slice of output channels at a time:
    ``fill_slice(start, end, buffer)`` writes ``W[start:end]`` as float32 into ``buffer``
    ``[end - start, in_features]`` (one buffer reused for every slice: converting in place
    instead of through temporaries made an int4 prefill GEMM of 200 rows 1.4x faster on an
    AVX2 CPU, docs/engines.md). Returns float32 ``[n, out_features]``."""
    inputs = rows.float()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=rows.device)
    buffer = torch.empty(min(DENSE_CHUNK, out_features), rows.shape[1], dtype=torch.float32, device=rows.device)
    for start in range(0, out_features, DENSE_CHUNK):
        end = min(start + DENSE_CHUNK, out_features)
        weights = buffer[:end - start]
        fill_slice(start, end, weights)
        out[:, start:end] = inputs @ weights.T
    return out


class WeightOnlyLinear(nn.Module):
    """The forward the weight-only linears share: flatten the leading dimensions, send
    prefill spans to :meth:`_dense` and the other rows to :meth:`_quantized`, add the bias.
    Subclasses set ``in_features``, ``out_features``, ``bias`` and :attr:`compute_dtype`."""

    in_features: int
    out_features: int
    #: How calls of decoded rows are cut (a ``disco.models.row_stable.RowPlan``, set by
    #: ``row_stable.stabilize`` at load); ``None``: one call of all rows.
    row_plan = None

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # [rows, in_features]
        quantized = self._quantized if self.row_plan is None else (
            lambda decoded: self.row_plan.run(decoded, self._quantized))
        out = split_rows(rows, quantized, self._dense)  # [rows, out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features]
        raise NotImplementedError

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features]
        raise NotImplementedError
