"""Row-stable linears: a row gets the same bits whatever the other rows of the call.

Exact speculative decoding in low precision needs it: target-only decoding multiplies one
row at a time, a verification multiplies k + 1 rows at once, and a batched step multiplies
the rows of several sessions. Where the kernel computes a row differently depending on how
many rows the call has, near-ties flip tokens.

Measured (torch 2.13.0+cpu): on the AVX2-only AMD EPYC machines the bf16 and fp16 CPU linears
are row-invariant. On a Xeon with AMX (Sapphire Rapids) they are not: oneDNN computes a
one-row bf16 call on another path than a multi-row call (for an 8960-input linear, 2 threads,
every count of 2-9 rows differs from one row alone; fp16 differs for every shape), and a
call of more than 32 rows differs again. Rows of calls of 2-32 rows are bit-identical,
whatever their neighbours. So :func:`stabilize` probes the model's own linear shapes once
at load and, where the plain calls are not row-invariant, makes every call use that range:
a one-row call gets a zero row added (as fast on AMX: tile kernels), a call of more rows
than the probed range is split into chunks. Where even that does not hold, the model is
left as it is and a warning says that near-ties may flip (benchmarks report the identical
rate).

A long prefill block (:mod:`disco.dense_prefill`'s spans, at least ``DENSE_MIN_ROWS``
tokens) is multiplied as one plain call of its own rows, not in chunks: its bits then
depend on that block only, so a prompt gets the same cache alone and batched, in
target-only and in speculative decoding (both prefill it the same way), while the weights
are read once instead of once per 32 rows (a 200-token prefill of the 1.5B target: 2.2x
faster on the AMX machine, docs/engines.md). A re-prefill after a lost session feeds the
generated tokens in such a block too, not as they were decoded: in bf16 a near-tie may
then flip after a failover (as with the int8 engine's float32 prefill GEMM).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from disco.dense_prefill import split_rows

logger = logging.getLogger(__name__)

#: Chunk sizes (rows per call) the probe may settle on, largest first.
CHUNK_CANDIDATES = (32, 16, 8)
#: Call sizes the probe compares with rows alone: both sides of each candidate, small blocks.
PROBE_COUNTS = (2, 3, 5, 8, 9, 16, 17, 32, 33, 64, 65)


class RowStableLinear(nn.Linear):
    """An ``nn.Linear`` whose calls all have between 2 and ``max_rows`` rows (module doc).

    Made by swapping the class of a loaded ``nn.Linear`` (:func:`stabilize`): same
    parameters, no copy."""

    max_rows: int = 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)
        out = split_rows(rows, lambda decoded: stable_linear(decoded, self.weight, self.bias, self.max_rows),
                         lambda prefill_block: nn.functional.linear(prefill_block, self.weight, self.bias))
        return out.reshape(*x.shape[:-1], self.out_features)


def stable_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  max_rows: int) -> torch.Tensor:
    """``F.linear`` over ``rows`` [n, in] in calls of 2..``max_rows`` rows -> [n, out]."""
    count = rows.shape[0]
    if 2 <= count <= max_rows:
        return nn.functional.linear(rows, weight, bias)
    if count == 1:
        padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        return nn.functional.linear(padded, weight, bias)[:1]
    if count == 0:
        return nn.functional.linear(rows, weight, bias)
    return torch.cat([stable_linear(rows[start:start + max_rows], weight, bias, max_rows)
                      for start in range(0, count, max_rows)])


def _row_invariant(weight: torch.Tensor, bias: torch.Tensor | None, inputs: torch.Tensor, call) -> bool:
    """Whether ``call(rows, weight, bias)`` gives every row of ``inputs`` the bits it gets
    alone (one-row reference computed with the same ``call``)."""
    alone = torch.cat([call(inputs[i: i + 1], weight, bias) for i in range(inputs.shape[0])])
    return all(torch.equal(call(inputs[:count], weight, bias), alone[:count]) for count in PROBE_COUNTS)


def probe_shape(weight: torch.Tensor, bias: torch.Tensor | None, seed: int = 0) -> int | None:
    """How calls to this linear must be cut for row-stable results: 0 if plain calls
    already are (calls of :data:`PROBE_COUNTS` rows), else the largest chunk size of
    :data:`CHUNK_CANDIDATES` for which :func:`stable_linear` is; ``None`` if none is."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(max(PROBE_COUNTS), weight.shape[1], generator=generator).to(weight.dtype)
    with torch.inference_mode():
        if _row_invariant(weight, bias, inputs, nn.functional.linear):
            return 0
        for max_rows in CHUNK_CANDIDATES:
            if _row_invariant(weight, bias, inputs,
                              lambda rows, w, b, limit=max_rows: stable_linear(rows, w, b, limit)):
                return max_rows
    return None


def stabilize(model: nn.Module) -> str:
    """Make the model's low-precision ``nn.Linear`` layers row-stable where this machine's
    kernels are not (module doc); returns what was done, for the load log. Float32 layers
    are left alone (near-ties there are ~1e-5 apart and the exactness tests hold)."""
    linears = [module for module in model.modules()
               if type(module) is nn.Linear and module.weight.dtype in (torch.bfloat16, torch.float16)
               and module.weight.device.type == "cpu"]
    verdicts: dict[tuple, int | None] = {}
    for module in linears:
        key = (tuple(module.weight.shape), module.weight.dtype, module.bias is not None)
        if key not in verdicts:
            verdicts[key] = probe_shape(module.weight, module.bias)
    if not verdicts or all(verdict == 0 for verdict in verdicts.values()):
        return "row-invariant linear kernels"
    if any(verdict is None for verdict in verdicts.values()):
        logger.warning("this machine's %s linear kernels give a row other bits depending on the rows of the call, "
                       "and no call size fixes it: speculative output may differ from target-only at near-ties",
                       next(iter(verdicts))[1])
        return "linear kernels not row-invariant (near-ties may flip)"
    max_rows = min(verdict for verdict in verdicts.values() if verdict)
    for module in linears:
        module.__class__ = RowStableLinear
        module.max_rows = max_rows
    return f"row-stable linears (calls of 2-{max_rows} rows)"
