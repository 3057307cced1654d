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

Where the quantized kernel multiplies many rows faster than the dense GEMM (the q4 x q8 kernel
on a VNNI CPU: a 128-row prefill of the 1.5B int4 target 0.71 s against 1.22 s in bf16 GEMMs
on a 2-core Zen 4, docs/engines.md "Prefill rows on the kernel"), :func:`choose_prefill_path`
sets ``dense_dtype = None`` at load: prefill spans then take the kernel too, in the row plan's
calls. A row's bits still depend on its own row only (the kernel is row-invariant), so a
prompt gets the same cache alone and batched, in target-only and in speculative decoding.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

#: A prefill block of at least this many tokens runs as a float32 GEMM.
DENSE_MIN_ROWS = 48
#: Output channels converted to float32 at once by a dense GEMM.
DENSE_CHUNK = 512
#: Prefill GEMMs run in bf16 only where they measure at most this fraction of float32's time.
DENSE_BF16_MARGIN = 0.9

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


def dense_spans_active() -> bool:
    """Whether the forward in flight has dense prefill spans (:func:`dense_prefill`)."""
    return bool(_SPANS.get())


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
                 fill_slice: Callable[[int, int, torch.Tensor], None],
                 dtype: torch.dtype = torch.float32, fills_dtype: bool = False) -> torch.Tensor:
    """``rows @ W^T`` as GEMMs in ``dtype`` (float32, or bfloat16 where the CPU multiplies it
    faster: :func:`choose_dense_dtype`), ``W`` given a slice of output channels at a time:
    ``fill_slice(start, end, buffer)`` writes ``W[start:end]`` as float32 into ``buffer``
    ``[end - start, in_features]`` (one buffer reused for every slice: converting in place
    instead of through temporaries made an int4 prefill GEMM of 200 rows 1.4x faster on an
    AVX2 CPU, docs/engines.md); for a bf16 GEMM the slice is then rounded once to bf16
    (``fills_dtype``: ``fill_slice`` writes the rounded ``dtype`` weights itself).
    Returns float32 ``[n, out_features]``."""
    inputs = rows.to(dtype)
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=rows.device)
    buffer = torch.empty(min(DENSE_CHUNK, out_features), rows.shape[1],
                         dtype=dtype if fills_dtype else torch.float32, device=rows.device)
    rounded = buffer if buffer.dtype == dtype else torch.empty(buffer.shape, dtype=dtype, device=rows.device)
    for start in range(0, out_features, DENSE_CHUNK):
        end = min(start + DENSE_CHUNK, out_features)
        fill_slice(start, end, buffer[:end - start])
        weights = rounded[:end - start]
        if rounded is not buffer:
            weights.copy_(buffer[:end - start])
        out[:, start:end] = inputs @ weights.T
    return out


def _now(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has run its queued kernels.

    NOTE: :func:`disco.engines.device_clock.now`'s rule, restated here because
    :mod:`disco.models` may not import :mod:`disco.engines` (tests/test_layers.py)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _prefill_probe(model: nn.Module, rows: int) -> tuple[list["WeightOnlyLinear"], "WeightOnlyLinear", torch.Tensor]:
    """The model's weight-only linears, the largest of them (not the LM head: a prefill asks one
    row of it) and ``rows`` fixed random inputs for it on its device; no linears: ``([], None, None)``."""
    linears = [module for module in model.modules() if isinstance(module, WeightOnlyLinear)]
    if not linears:
        return [], None, None
    probe = max(linears, key=lambda module: module.in_features * module.out_features
                if module.out_features < 65536 else 0)
    device = next(probe.buffers()).device  # the timers wait for its queued kernels (CUDA)
    inputs = torch.randn(rows, probe.in_features, generator=torch.Generator().manual_seed(0)).to(
        dtype=probe.compute_dtype, device=device)
    return linears, probe, inputs


def _best_seconds(device: torch.device, calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each call's best of 3, the calls interleaved (a busy moment hits all of them alike)."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(3):
            for name, call in calls.items():
                started = _now(device)
                call()
                seconds[name].append(_now(device) - started)
    return {name: min(values) for name, values in seconds.items()}


def choose_dense_dtype(model: nn.Module, rows: int = 128) -> str:
    """Time a prefill-sized GEMM of the model's largest weight-only linear in float32 and in
    bfloat16 (:func:`chunked_gemm`, best of 3 each, interleaved) and give every weight-only
    linear bf16 where it is clearly faster (:data:`DENSE_BF16_MARGIN`; the CPU multiplies bf16
    in hardware: AMX, AVX-512-BF16), else float32.
    A prefill block's bits depend only on its own rows either way. Returns a line for the
    load log."""
    linears, probe, inputs = _prefill_probe(model, rows)
    if not linears:
        return "no weight-only linears"

    def dense(dtype: torch.dtype) -> Callable[[], object]:
        def call() -> object:
            probe.dense_dtype = dtype
            return probe._dense(inputs)
        return call

    seconds = _best_seconds(inputs.device, {"float32": dense(torch.float32), "bfloat16": dense(torch.bfloat16)})
    # bf16 must win clearly: where both cost about the same, noise must not flip a restart's
    # prefill numerics (a near-tie could then differ between two starts or two replicas).
    best = torch.bfloat16 if seconds["bfloat16"] < DENSE_BF16_MARGIN * seconds["float32"] else torch.float32
    for module in linears:
        module.dense_dtype = best
    return (f"prefill GEMMs in {str(best).removeprefix('torch.')} (measured {rows} rows x "
            f"{probe.out_features}x{probe.in_features}: float32 {seconds['float32'] * 1e3:.1f} ms, "
            f"bfloat16 {seconds['bfloat16'] * 1e3:.1f} ms)")


def prefill_path(model: nn.Module) -> str:
    """How the model's weight-only linears multiply prefill spans (``Info.prefill``): ``"kernel"``,
    ``"bfloat16 GEMM"`` or ``"float32 GEMM"``, several joined by ``+``; empty without such linears."""
    paths = sorted({"kernel" if module.dense_dtype is None else f"{str(module.dense_dtype).removeprefix('torch.')} GEMM"
                    for module in model.modules() if isinstance(module, WeightOnlyLinear)})
    return "+".join(paths)


def choose_prefill_path(model: nn.Module, rows: int = 128) -> str | None:
    """Time a prefill-sized call of the model's largest weight-only linear on its quantized
    kernel (in the row plan's calls, as decoded rows run) against its dense GEMM (the dtype
    :func:`choose_dense_dtype` chose), best of 3 each, interleaved; where the kernel is clearly
    faster (:data:`DENSE_BF16_MARGIN`: a near-tie must not flip a restart's prefill numerics),
    every weight-only linear multiplies its prefill spans on the kernel (``dense_dtype = None``).
    Returns a line for the load log (``None``: the model has no weight-only linears)."""
    linears, probe, inputs = _prefill_probe(model, rows)
    if not linears:
        return None
    if probe.dense_dtype is None:
        return "prefill rows on the quantized kernel (chosen before)"
    plan = probe.row_plan
    seconds = _best_seconds(inputs.device, {
        "dense": lambda: probe._dense(inputs),
        "kernel": lambda: probe._quantized(inputs) if plan is None else plan.run(inputs, probe._quantized)})
    dense_dtype = str(probe.dense_dtype).removeprefix("torch.")
    measured = (f"measured {rows} rows x {probe.out_features}x{probe.in_features}: {dense_dtype} GEMM "
                f"{seconds['dense'] * 1e3:.2f} ms, kernel {seconds['kernel'] * 1e3:.2f} ms")
    if seconds["kernel"] >= DENSE_BF16_MARGIN * seconds["dense"]:
        return f"prefill rows in {dense_dtype} GEMMs ({measured})"
    for module in linears:
        module.dense_dtype = None
    return f"prefill rows on the quantized kernel ({measured})"


class WeightOnlyLinear(nn.Module):
    """The forward the weight-only linears share: flatten the leading dimensions, send
    prefill spans to :meth:`_dense` and the other rows to :meth:`_quantized`, add the bias.
    Subclasses set ``in_features``, ``out_features``, ``bias`` and :attr:`compute_dtype`."""

    in_features: int
    out_features: int
    #: How calls of decoded rows are cut (a ``disco.models.row_stable.RowPlan``, set by
    #: ``row_stable.stabilize`` at load); ``None``: one call of all rows.
    row_plan = None
    #: The dtype of the prefill GEMMs (:func:`choose_dense_dtype` sets it at load); ``None``:
    #: prefill spans take the quantized kernel too (:func:`choose_prefill_path`).
    dense_dtype: torch.dtype | None = torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # [rows, in_features]
        quantized = self._quantized if self.row_plan is None else (
            lambda decoded: self.row_plan.run(decoded, self._quantized))
        # [rows, out_features]
        out = quantized(rows) if self.dense_dtype is None else split_rows(rows, quantized, self._dense)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def probe_twin(self, weight: torch.Tensor,  # [out_features, in_features]
                   bias: torch.Tensor | None) -> "WeightOnlyLinear":  # [out_features]
        """A layer of this kind and kernel over other weights (the row-plan probe's)."""
        return type(self).from_weight(weight, bias, self.compute_dtype)

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features]
        raise NotImplementedError

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features]
        raise NotImplementedError
