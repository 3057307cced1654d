"""Row-stable linears: a row gets the same bits whatever the other rows of the call.

Exact speculative decoding in low precision needs it: target-only decoding multiplies one
row at a time, a verification multiplies k + 1 rows at once, and a batched step multiplies
the rows of several sessions. Where the kernel computes a row differently depending on how
many rows the call has, near-ties flip tokens.

What the CPU kernels do (torch 2.13.0+cpu, measured with :func:`probe_plan`'s inputs):

- Xeon with AMX (Sapphire Rapids), bf16/fp16: a one-row call takes another path than a
  multi-row call, and a call of more than 32 rows differs again.
- AMD EPYC Zen 4 (AVX-512-BF16, no AMX), bf16: a one-row call differs from a two-row call
  for every shape of the 1.5B target, and narrow linears switch paths at a few rows more
  (out 32 x in 64: calls of 1-2 rows differ from 3 or more; out 16: 1-4 rows from 5 or more).
- AVX2-only AMD EPYC: row-invariant in bf16 and int8 for the shapes measured.

- CUDA: cuBLAS picks a GEMM kernel (tiles, split-K) by the call's shape, rows included, so a
  row's bits depend on how many rows share its call (docs/engines.md, "Exactness on CUDA":
  on an H200 the 1536x8960 down projection gives a row other bits from 129 rows on, so a
  live batch of 16 sessions' blocks changed tokens while a one-session proof passed).
  :data:`GPU_PLANS` cut calls to at most 128 (else 64) rows where the probe shows every row
  keeps its one-row bits up to there, else pad every call to one fixed shape of
  :data:`GPU_CALL_ROWS` rows. The probe runs where the linear lives (:mod:`disco.models.loading`
  at load, on every device; :func:`disco.engines.packing_proof.exactness_for` for models built
  elsewhere).

So every call of a low-precision linear follows one :class:`RowPlan`: calls of fewer than
``min_rows`` rows get zero rows added, calls of more than ``max_rows`` rows are cut into
chunks. :func:`stabilize` probes the model's own linear shapes at load, for *every* row
count a call can then have (1 .. ``max_rows``), and picks the first plan of
:data:`PLANS` under which each row's bits equal its bits alone.

The probe's inputs are built to show any difference in summation order (issue 32): random
bf16 values seldom do — a different order changes the float32 accumulator by an ulp, which
rounding to bf16 almost always hides, so a probe on ``randn`` passed a 64x64 linear whose
calls of 80 rows differed, and 16 concurrent sessions then got other tokens. Here each
product in a dot product has a partner of opposite sign (the exact sum is 0) and magnitudes
spread over 2^16, so a row's result is nothing but its rounding: any other order shows.

A long prefill block (:mod:`disco.models.weight_only`'s spans, at least ``DENSE_MIN_ROWS``
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
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from disco.models.model_record import model_record, weights_changed
from disco.models.weight_only import WeightOnlyLinear, split_rows

logger = logging.getLogger(__name__)

RowCall = Callable[[torch.Tensor], torch.Tensor]  # rows [n, in_features] -> [n, out_features]


@dataclass(frozen=True)
class RowPlan:
    """How the calls of one linear are cut: every call has ``min_rows`` .. ``max_rows`` rows."""

    min_rows: int = 1
    max_rows: int = 32

    def run(self, rows: torch.Tensor, call: RowCall) -> torch.Tensor:  # rows: [n, in] -> [n, out]
        """``call(rows)``, in calls of ``min_rows`` .. ``max_rows`` rows (zero rows added)."""
        count = rows.shape[0]
        if count == 0:
            return call(rows)
        if count > self.max_rows:
            return torch.cat([self.run(rows[start:start + self.max_rows], call)
                              for start in range(0, count, self.max_rows)])
        if count < self.min_rows:
            padding = rows.new_zeros(self.min_rows - count, rows.shape[1])
            return call(torch.cat([rows, padding]))[:count]
        return call(rows)

    def describe(self) -> str:
        return f"calls of {self.min_rows}-{self.max_rows} rows"


#: The plans the probe tries on a CPU, in order: the largest calls first, then the fewest rows added.
PLANS = tuple(RowPlan(min_rows, max_rows) for max_rows in (32, 16, 8) for min_rows in (1, 2, 4, 8))
#: The plans the probe tries on a GPU (module doc, "CUDA"): calls of at most 128 or 64 rows
#: (on an H200 cuBLAS gave every row of the default target's linears its one-row bits up to
#: 128 rows; the 1536x8960 down projection changed at 129), then one fixed call shape of
#: :data:`GPU_CALL_ROWS` rows (every call padded to it: the same kernel for every row whatever
#: cuBLAS does by row count; a padded one-row call costs a second launch, ~0.02 ms, there).
GPU_CALL_ROWS = 64
GPU_PLANS = (RowPlan(1, 128), RowPlan(1, GPU_CALL_ROWS), RowPlan(GPU_CALL_ROWS, GPU_CALL_ROWS))
#: Every RMSNorm call on a GPU: one fixed shape (:class:`RowStableNorm`).
GPU_NORM_PLAN = RowPlan(GPU_CALL_ROWS, GPU_CALL_ROWS)


def plans_for(device: torch.device) -> tuple[RowPlan, ...]:
    """The plans :func:`stabilize` tries for linears on ``device``."""
    return PLANS if device.type == "cpu" else GPU_PLANS


#: Distinct output channels of a probe's weight (tiled to the layer's width).
PROBE_CHANNELS = 256


class RowStableLinear(nn.Linear):
    """An ``nn.Linear`` whose calls follow :attr:`row_plan` (module doc).

    Made by swapping the class of a loaded ``nn.Linear`` (:func:`stabilize`): same
    parameters, no copy."""

    row_plan: RowPlan = RowPlan()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)
        out = split_rows(rows, lambda decoded: self.row_plan.run(decoded, self._plain),
                         self._plain)  # a prefill block: one plain call of its own rows
        return out.reshape(*x.shape[:-1], self.out_features)

    def _plain(self, rows: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(rows, self.weight, self.bias)


class RowStableNorm(nn.Module):
    """Mixed into a model's RMSNorm class on a GPU (:func:`stabilize_norms`): every call
    runs in :data:`GPU_NORM_PLAN`'s fixed shape. The norm's float32 mean is a reduction kernel
    whose launch layout torch picks by the tensor's shape, rows included; one shape for every
    call keeps a row's bits whatever the batch (on an H200 the proof of a 16-session batch
    found one session whose first differing op was an RMSNorm)."""

    row_plan: RowPlan

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.row_plan.run(rows, super().forward)
        return out.reshape(hidden_states.shape)


_NORM_CLASSES: dict[type, type] = {}


def _row_stable_norm_class(cls: type) -> type:
    if cls not in _NORM_CLASSES:
        _NORM_CLASSES[cls] = type(f"RowStable{cls.__name__}", (RowStableNorm, cls), {})
    return _NORM_CLASSES[cls]


def cancelling_inputs(rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs ``[rows, in]``, weight ``[out, in]`` and bias ``[out]`` (float32 values exact in
    ``dtype``) under which each output is pure float32 rounding: every product ``x_i * w_i``
    has a partner ``x_j * w_j = -x_i * w_i``, magnitudes spread over 2^-8 .. 2^9, so a
    different summation order changes the result by far more than one bf16 step."""
    generator = torch.Generator().manual_seed(seed)

    def spread(*shape: int) -> torch.Tensor:
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        exponent = torch.randint(-8, 9, shape, generator=generator).float()
        return (sign * torch.pow(2.0, exponent) * (1 + torch.rand(shape, generator=generator))).to(dtype).float()

    order = torch.randperm(in_features, generator=generator)
    first, second = order[0::2][: in_features // 2], order[1::2]
    inputs, channels = spread(rows, in_features), spread(min(out_features, PROBE_CHANNELS), in_features)
    inputs[:, second] = inputs[:, first]
    channels[:, second] = -channels[:, first]
    weight = channels.repeat(-(-out_features // channels.shape[0]), 1)[:out_features]
    bias = spread(out_features) * 2.0 ** -12  # about the size of the rounding it is added to
    return inputs, weight, bias


def plan_holds(call: RowCall, inputs: torch.Tensor, plan: RowPlan) -> bool:
    """Whether ``plan.run`` gives every row of every call of 2 .. ``max_rows`` rows the
    bits the row gets alone (``inputs`` has at least ``max_rows`` rows)."""
    alone = torch.cat([plan.run(inputs[i: i + 1], call) for i in range(plan.max_rows)])
    return all(torch.equal(plan.run(inputs[:count], call), alone[:count])
               for count in range(2, plan.max_rows + 1))


def probe_plan(call: RowCall, inputs: torch.Tensor, plans: tuple[RowPlan, ...] = PLANS) -> RowPlan | None:
    """The first of ``plans`` that holds for ``call`` (``None``: none does)."""
    with torch.inference_mode():
        return next((plan for plan in plans if plan_holds(call, inputs, plan)), None)


def _device(module: nn.Module) -> torch.device:
    return next(module.buffers()).device if isinstance(module, WeightOnlyLinear) else module.weight.device


def _probe_call(module: nn.Module, rows: int = PLANS[0].max_rows) -> tuple[RowCall, torch.Tensor]:
    """A call of the module's kind and shape on ``rows`` :func:`cancelling_inputs`, and the inputs."""
    if isinstance(module, WeightOnlyLinear):
        dtype = module.compute_dtype
        inputs, weight, bias = cancelling_inputs(rows, module.out_features, module.in_features, dtype)
        probe = module.probe_twin(weight, bias if module.bias is not None else None)
        device = _device(module)
        return probe.to(device)._quantized, inputs.to(dtype=dtype, device=device)
    dtype, device = module.weight.dtype, module.weight.device
    inputs, weight, bias = cancelling_inputs(rows, module.out_features, module.in_features, dtype)
    weight, bias = weight.to(dtype=dtype, device=device), bias.to(dtype=dtype, device=device)
    has_bias = module.bias is not None
    return (lambda rows: nn.functional.linear(rows, weight, bias if has_bias else None)), inputs.to(dtype=dtype,
                                                                                                 device=device)


def _stabilizable(module: nn.Module) -> bool:
    """A low-precision linear without a plan yet, on any device (the probe runs where it lives)."""
    if isinstance(module, WeightOnlyLinear):
        return module.row_plan is None
    return type(module) is nn.Linear and module.weight.dtype in (torch.bfloat16, torch.float16)


def _gpu_norm(module: nn.Module) -> bool:
    """An RMSNorm of a low-precision model on a GPU, not yet row-stable."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, RowStableNorm)
            and isinstance(weight, torch.Tensor) and weight.device.type != "cpu"
            and weight.dtype in (torch.bfloat16, torch.float16))


def needs_plans(model: nn.Module) -> bool:
    """Whether the model has low-precision linears (or GPU norms) :func:`stabilize` has not given a plan."""
    return any(_stabilizable(module) or _gpu_norm(module) for module in model.modules())


def stabilize_norms(model: nn.Module) -> int:
    """Give the RMSNorms of a low-precision model on a GPU :data:`GPU_NORM_PLAN` (class swap,
    no copy); returns how many. A CPU model's norms are left as they are (the CPU's proofs
    cover them)."""
    norms = [module for module in model.modules() if _gpu_norm(module)]
    for module in norms:
        module.__class__ = _row_stable_norm_class(type(module))
        module.row_plan = GPU_NORM_PLAN
    return len(norms)


def _shape_key(module: nn.Module) -> tuple:
    dtype = module.compute_dtype if isinstance(module, WeightOnlyLinear) else module.weight.dtype
    return (type(module).__name__, module.out_features, module.in_features, dtype, module.bias is not None,
            _device(module).type)


def stabilize(model: nn.Module) -> str:
    """Give the model's low-precision linears (bf16/fp16 ``nn.Linear``, int8/int4
    weight-only) a :class:`RowPlan` proven on this machine, with the probe on the device the
    linear lives on (module doc); returns what was done, for the load log, and keeps that
    line in the model's record (:class:`~disco.models.model_record.ModelRecord`: the engine's exactness
    statement names it).
    Float32 layers are left alone (near-ties there are ~1e-5 apart and the exactness tests
    hold)."""
    line = _stabilize(model)
    model_record(model).row_plans = line
    weights_changed(model)  # the linears' and norms' plans (and classes)
    return line


def _stabilize(model: nn.Module) -> str:
    norms = stabilize_norms(model)
    line = _stabilize_linears(model)
    return f"{line}; norms in {GPU_NORM_PLAN.describe()}" if norms else line


def _stabilize_linears(model: nn.Module) -> str:
    linears = [module for module in model.modules() if _stabilizable(module)]
    plans: dict[tuple, RowPlan | None] = {}
    for module in linears:
        key = _shape_key(module)
        if key not in plans:
            candidates = plans_for(_device(module))
            plans[key] = probe_plan(*_probe_call(module, max(plan.max_rows for plan in candidates)), candidates)
            logger.debug("row plan of %s: %s", key, plans[key])
    if not plans:
        return "no low-precision linears"
    unstable = [key for key, plan in plans.items() if plan is None]
    if unstable:
        logger.warning("this machine's linear kernels give a row other bits depending on the rows of the call, "
                       "and no call size fixes it (%s): speculative output may differ from target-only at "
                       "near-ties", ", ".join(f"{kind} {out}x{inp}" for kind, out, inp, *_ in unstable))
        return "linear kernels not row-invariant (near-ties may flip)"
    for module in linears:
        plan = plans[_shape_key(module)]
        if isinstance(module, WeightOnlyLinear):
            module.row_plan = plan
        else:
            module.__class__ = RowStableLinear
            module.row_plan = plan
    return "row-stable linears (" + ", ".join(sorted({plan.describe() for plan in plans.values() if plan})) + ")"
