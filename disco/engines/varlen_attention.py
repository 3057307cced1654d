"""One attention call per layer for every query of a packed forward that asks for logits.

The reference (:func:`disco.engines.packed_forward.packed_attention`, ``one_call=False``)
attends each decoded or verified query on its own: one sdpa per query, per session, per
layer, over exactly the keys up to the query's position. That is what makes a verified
block give the logits of one-token decoding, and a packed batch give each session its solo
bits, but it costs ``sum of block sizes`` kernel launches per layer.

Here every such query of every session is one item of a single batched sdpa call:

* the items are the sessions, with their keys gathered from the caches into
  ``[sessions, kv_heads, padded_keys, head_dim]`` (one ``index_select`` of the concatenated
  caches; padding slots read a zero row); a session's queries ride in the head dimension
  (:class:`~disco.engines.batch_layout.BatchLayout`), so every (item, head) is a one-row
  attention like a decoding step's,
  and a boolean mask ``[sessions, heads, 1, padded_keys]`` gives each query its own keys up to
  its position (putting a block's queries in the rows instead would make the kernel's GEMMs
  take several rows, whose bits may depend on the row count);
* ``padded_keys`` is a multiple of :data:`KEY_GRANULE` (64), and so is the padding of a query
  run alone. That is what keeps a query's bits independent of its neighbours: the CPU flash
  kernel takes the exponentials of a key block's tail (``len % vector width``) with a scalar
  ``exp`` and the rest with a vectorised one, so padding a query's keys by an amount that is
  not a multiple of the vector width changes its bits (measured: 1-5 of 16 queries keep their
  bits when padded to the longest neighbour, in float32 and bf16); padded to multiples of 64
  keys, every query kept its bits whatever the neighbours (20 queries of 1-1100 keys,
  1 and 2 threads, 0-5 extra granules of padding; float32 and bf16; and 12 sessions of 1-5
  queries against their token-by-token solo runs). Masked keys add exact
  zeros (``exp(-inf) = 0``, rescale factors of exactly 1), so extra granules change nothing.

The contract is therefore *bit identity within this path*: a query gives the same bits alone
(decoding: one session, one query) and inside a packed batch or a verification block. It is
not bit-identical to the per-query reference (padded, the tail rounds differently: within
~1e-6 in float32); both paths are exact on their own, and an engine uses one of them for
decoding and verification alike (:func:`attention_plan` decides per device type).

On the CPU this path measured slower than the reference at every shape tried, so the CPU keeps
the reference (:func:`attention_plan`). On CUDA the call runs in the model's dtype (flash /
memory-efficient kernels); with a mask those kernels take no ``enable_gqa``, so keys are
repeated per query head there (:attr:`AttentionPlan.kernel_gqa`). The call is pinned to the
memory-efficient kernel (:data:`ONE_CALL_CUDA`): on an H200 torch's own choice (cuDNN for some
shapes) gave a query other bits packed than alone and inside a block than decoded; the pinned
kernel gave none. The packing proof (:mod:`disco.engines.packing_proof`) checks solo vs packed
at engine start, over the batch sizes, blocks and key granules the batcher issues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from disco.engines.batch_layout import BatchLayout, additive_bias

#: Padded key counts are multiples of this (>= every CPU vector width in floats: 16 on AVX-512).
KEY_GRANULE = 64


@dataclass(frozen=True)
class AttentionPlan:
    """How a packed forward attends the queries that ask for logits.

    Attributes:
        one_call: one batched call per layer (:func:`one_call_attention`); else the
            reference, one sdpa per query.
        compute_dtype: dtype of the attention arithmetic; ``None`` = the model's dtype.
        kernel_gqa: the kernel takes fewer key heads than query heads (``enable_gqa``);
            else the gathered keys are repeated per query head.
        key_granule: padded key counts are multiples of this.
    """

    one_call: bool
    compute_dtype: torch.dtype | None
    kernel_gqa: bool = True
    key_granule: int = KEY_GRANULE
    memory_efficient: bool = False

    def attend(self, items: torch.Tensor,  # [sessions, call_heads, 1, head_dim]
               keys: torch.Tensor, values: torch.Tensor,  # [sessions, call or kv heads, padded_keys, head_dim]
               mask: torch.Tensor,  # [sessions, call_heads, 1, padded_keys], bool: True where a query attends
               scale: float, enable_gqa: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
        """One attention call: torch's sdpa (its own kernel choice), or, with ``memory_efficient``,
        the memory-efficient kernel called directly (what sdpa runs when that backend is chosen:
        the boolean mask turned into an additive bias of 0 / -inf in the queries' dtype;
        ``bias``: that bias made once per forward, :attr:`~disco.engines.batch_layout.BatchLayout.bias`).

        NOTE: called directly, not through ``torch.nn.attention.sdpa_kernel``: that context sets
        process-wide backend flags, so another thread's attention (the other model's prefill) ran
        under them on the H200 and found no kernel ("No available kernel. Aborting execution.")."""
        if not self.memory_efficient:
            return torch.nn.functional.scaled_dot_product_attention(items, keys, values, attn_mask=mask, scale=scale,
                                                                    enable_gqa=enable_gqa)
        if bias is None:
            bias = additive_bias(mask, items.dtype)
        output, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(items, keys, values, bias, False, 0.0,
                                                                            False, scale=scale)
        return output


def attention_plan(device: torch.device | str) -> AttentionPlan:
    """The plan for a device type, chosen by measurement (docs/engines.md, "Packed attention").

    CPU: the reference (one sdpa per query, float32). Measured on the 2-core AVX-512 Xeon,
    1 thread, shared machine (load ~7), fastest of 3 runs, Qwen2.5-1.5B-like attention
    (12 query heads, 2 KV heads, head_dim 128, 28 layers, bf16 caches of 100-600 keys,
    float32 arithmetic), ms per forward, attention only, reference vs one call:
    1 session x 1 query 8.8 vs 20.9; 1x5 23.8 vs 25.5; 4x1 37.7 vs 83.9; 8x5 281 vs 692;
    16x1 132 vs 612; 16x5 509 vs 829 (``docs/analysis/packed_attention.py``). A CPU sdpa call
    costs little next to its arithmetic, and the one call pays for padding every session to
    the longest (the kernel does not skip masked keys) and for gathering the caches.
    CUDA: the one call in the model's dtype (launches dominate there: 16 sessions x 5 queries
    x 28 layers = 2,240 sdpa launches per verification otherwise); keys repeated per query
    head, as the masked CUDA kernels take no GQA. NOTE: not run on a GPU here.
    """
    if torch.device(device).type == "cpu":
        return REFERENCE_CPU
    return ONE_CALL_CUDA


#: The per-query reference in float32 — a one-query attention in bf16 is ~6x slower on CPUs
#: without bf16 arithmetic, and more exact. The CPU's plan; also what tests compare against.
REFERENCE_CPU = AttentionPlan(one_call=False, compute_dtype=torch.float32)
#: The one call as a CPU runs it (tests, benchmarks; the flash CPU kernel takes GQA with a mask).
ONE_CALL_CPU = AttentionPlan(one_call=True, compute_dtype=torch.float32, kernel_gqa=True)
#: The one call on CUDA, pinned to the memory-efficient kernel: measured on an H200 (torch
#: 2.11+cu130, bf16, 16 sessions of 1-21 queries over 30-700 keys, ``docs/analysis/cuda_exactness.py``),
#: torch's own choice changed 3 of 16 sessions' bits when packed and every block's bits against
#: its queries decoded alone, cuDNN 4/16 and 16, the math path 16/16 and 26; the memory-efficient
#: kernel 0 and 0 (it walks a query's keys in fixed blocks whatever the batch, and masked blocks
#: add exact zeros).
ONE_CALL_CUDA = AttentionPlan(one_call=True, compute_dtype=None, kernel_gqa=False, memory_efficient=True)


def one_call_attention(queries: torch.Tensor,  # [1, heads, call rows, head_dim]: the call sessions' rows, in order
                       keys: Sequence[torch.Tensor] | torch.Tensor,
                       values: Sequence[torch.Tensor] | torch.Tensor,
                       layout: BatchLayout, scaling: float, plan: AttentionPlan) -> torch.Tensor:
    """Every query of the layout's call over its own session's keys up to its position, in one
    sdpa call. ``keys``/``values``: each call session's own states ``[1, kv_heads, keys_s, head_dim]``
    (the packed forward: gathered by :attr:`BatchLayout.key_gather`), or the pool's slot chunk
    ``[slots, kv_heads, capacity, head_dim]`` (the static step: read by :attr:`BatchLayout.slots`).

    Returns ``[1, call rows, heads, head_dim]`` in the queries' dtype (the layout of the
    model's attention output)."""
    heads, head_dim = queries.shape[1], queries.shape[3]
    dtype = plan.compute_dtype or queries.dtype
    rows = queries[0]  # [heads, call rows, head_dim]
    if layout.query_gather is not None:
        padded = torch.cat([rows, rows.new_zeros(heads, 1, head_dim)], dim=1)  # [heads, queries + 1, dim]
        rows = padded.index_select(1, layout.query_gather)  # [heads, call sessions * max_queries, dim]
    output = attend_items(rows, session_states(keys, layout, dtype), session_states(values, layout, dtype),
                          layout.mask, layout.bias, scaling, plan)  # [heads, call sessions * max_queries, dim]
    if layout.query_rows is not None:
        output = output.index_select(1, layout.query_rows)  # [heads, num_queries, dim]
    return output.transpose(0, 1).unsqueeze(0).to(queries.dtype)  # [1, call rows, heads, head_dim]


def session_states(states: Sequence[torch.Tensor] | torch.Tensor, layout: BatchLayout,
                   dtype: torch.dtype) -> torch.Tensor:  # [call sessions, kv_heads, padded_keys, head_dim]
    """The call sessions' keys (or values) as the one call reads them, in ``dtype``: by slot id from
    the slot chunk, or gathered from each session's own states with one zero row for the padding."""
    if layout.slots is not None:
        return states.index_select(0, layout.slots).to(dtype)
    kv_heads, head_dim = states[0].shape[1], states[0].shape[3]
    zero = states[0].new_zeros(1, kv_heads, 1, head_dim)
    flat = torch.cat([*states, zero], dim=2)[0]  # [kv_heads, total + 1, head_dim]
    # Gathered and cast while contiguous; the kernel takes the transposed view as it is.
    picked = flat.index_select(1, layout.key_gather).to(dtype)  # [kv_heads, sessions * padded, head_dim]
    return picked.view(kv_heads, len(layout.call_sessions), layout.padded_keys, head_dim).transpose(0, 1)


def attend_items(rows: torch.Tensor,  # [heads, sessions * slots, head_dim]: session-major, kv-head-major heads
                 keys: torch.Tensor, values: torch.Tensor,  # [sessions, kv_heads, keys, head_dim], the plan's dtype
                 mask: torch.Tensor,  # [sessions, kv_heads * slots * group, 1, keys] (:func:`item_masks`)
                 bias: torch.Tensor | None, scale: float, plan: AttentionPlan
                 ) -> torch.Tensor:  # [heads, sessions * slots, head_dim] in the plan's dtype
    """The one attention call both one-call paths make (the packed forward's queries that ask for
    logits, :func:`one_call_attention`; the static step over its slots,
    :class:`disco.engines.static_step.StaticStep`): the query slots as items (:func:`as_items`)
    cast to the plan's dtype, the keys repeated per query head where the kernel takes no GQA,
    one :meth:`AttentionPlan.attend`, the items undone (:func:`from_items`)."""
    sessions, kv_heads = keys.shape[0], keys.shape[1]
    slots = rows.shape[1] // sessions
    items = as_items(rows, kv_heads, sessions).to(plan.compute_dtype or rows.dtype)
    repeats = items.shape[1] // kv_heads  # query heads per key head in the call: slots x group
    if not plan.kernel_gqa and repeats > 1:
        keys = keys.repeat_interleave(repeats, dim=1)
        values = values.repeat_interleave(repeats, dim=1)
    output = plan.attend(items, keys, values, mask, scale, plan.kernel_gqa and repeats > 1, bias)
    return from_items(output, kv_heads, slots)


def as_items(rows: torch.Tensor,  # [heads, sessions * slots, head_dim], session-major, heads kv-head-major
             kv_heads: int, sessions: int) -> torch.Tensor:  # [sessions, kv_heads * slots * group, 1, head_dim]
    """The one call's items: a session's query slots ride in the head dimension
    (:class:`~disco.engines.batch_layout.BatchLayout`)."""
    heads, count, head_dim = rows.shape
    group, slots = heads // kv_heads, count // sessions
    items = rows.view(kv_heads, group, sessions, slots, head_dim).permute(2, 0, 3, 1, 4)
    return items.reshape(sessions, kv_heads * slots * group, 1, head_dim)


def from_items(output: torch.Tensor,  # [sessions, kv_heads * slots * group, 1, head_dim]
               kv_heads: int, slots: int) -> torch.Tensor:  # [heads, sessions * slots, head_dim]
    """:func:`as_items` undone on the call's output."""
    sessions, call_heads, _, head_dim = output.shape
    group = call_heads // (kv_heads * slots)
    output = output.view(sessions, kv_heads, slots, group, head_dim).permute(1, 3, 0, 2, 4)
    return output.reshape(kv_heads * group, sessions * slots, head_dim)
