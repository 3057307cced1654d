"""The lean decoder's layer loop as one C++ call, for the forwards a CPU decodes and verifies with.

The Python loop of :class:`disco.engines.lean_decoder.LeanDecoder` makes ~60 tensor calls per
layer; on a 2-core Zen 4 the interpreter's work between them was ~4.7 ms of the 24-layer
draft's ~15 ms token (docs/engines.md, "The layer loop in C++"). ``kernels/decode_loop.cpp``
(built into the q4 x q8 kernel's library) runs the same ATen ops in the same order on the same
tensors, so it gives the same bits, in one call that also releases the GIL.

It covers the forwards that dominate decoding on a CPU, and only those; any other forward takes
the Python loop:

* every projection of every layer is a q4 x q8 layer called directly (the lean decoder's
  ``direct``), over a row count each layer's row plan takes in one call, and no row is in a
  dense prefill span;
* every session asks for logits (decoding, verification) and attends one query at a time, the
  CPU's reference plan (:data:`disco.engines.varlen_attention.REFERENCE_CPU`);
* every session's cache is a :class:`~disco.engines.kv_pool.PoolCache` (a run of the model's KV
  pool, in the model's dtype) already holding its prompt (the run grows here, before the call,
  where the new rows would not fit).

Its bits are checked against the HF forward with the rest of the lean decoder's
(``packed_forward._lean_check``: the 4-token block there runs here), and it is switched off with
the reason in the log where they differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from disco.engines.kv_pool import PoolCache
from disco.models import q4q8

#: RMSNorm modules whose arithmetic the C++ loop repeats (the lean decoder's ``_rms_norm``).
_NORM_CLASSES = ("Qwen2RMSNorm", "LlamaRMSNorm")


@dataclass(frozen=True)
class NativeLoop:
    """The arguments of ``disco_q4q8.decode_layers`` that do not change between forwards.

    Attributes:
        weights: per layer: attention norm weight, wqkv weights and bias, wo weights and bias,
            ffn norm weight, w13 weights and bias, w2 weights and bias (an empty bias: none).
        out_features: per layer, the four projections' output widths.
        min_rows, max_rows: the row counts every projection's row plan takes in one call.
        eps: the norms' epsilon (all layers share it).
        scaling: the attention's softmax scale.
        enable_gqa: fewer key/value heads than query heads.
    """

    weights: tuple[torch.Tensor, ...]
    out_features: tuple[int, ...]
    min_rows: int
    max_rows: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    enable_gqa: bool

    def run(self, hidden: torch.Tensor,  # [1, rows, hidden]
            cos: torch.Tensor, sin: torch.Tensor,  # each [1, rows, 1, head_dim]
            packed_cache) -> torch.Tensor | None:  # a disco.engines.packed_forward.PackedCache
        """The hidden states after the last layer ``[1, rows, hidden]`` (before the final norm),
        every session's cache extended; ``None`` (nothing done) where this forward is not one the
        loop covers (module doc)."""
        rows = hidden.shape[1]
        plan = packed_cache.plan
        layout = packed_cache.layout
        if not self.min_rows <= rows <= self.max_rows or plan.one_call:
            return None
        runs, spans = [], []
        for index, session in enumerate(packed_cache.sessions):
            cache = session.cache
            start, end = layout.rows_of(index)
            if not (session.one_query_at_a_time and end > start and isinstance(cache, PoolCache)
                    and cache.run.length > 0 and cache.run.dtype == hidden.dtype):
                return None  # a prefill, or a cache without its prompt or in another dtype
            runs.append(cache.run)
        for index, run in enumerate(runs):
            start, end = layout.rows_of(index)
            packed_cache.sessions[index].cache.pool.grow(run, run.length + end - start)  # before the call: it only writes
            spans.extend((start, end, run.length))
        layer_count = len(self.out_features) // 4
        keys = [run.keys[index] for index in range(layer_count) for run in runs]  # layer-major, as the C++ loop reads
        values = [run.values[index] for index in range(layer_count) for run in runs]
        out = torch.ops.disco_q4q8.decode_layers(
            hidden, cos, sin, self.weights, self.out_features, keys, values, spans, self.heads, self.kv_heads,
            self.head_dim, self.eps, self.scaling, self.enable_gqa, plan.compute_dtype or hidden.dtype)
        for index, run in enumerate(runs):
            start, end = layout.rows_of(index)
            run.length += end - start
        return out


def native_loop(blocks: Sequence, heads: int, kv_heads: int, head_dim: int) -> tuple[NativeLoop | None, str]:
    """The C++ loop for a lean decoder's ``blocks`` (:class:`disco.engines.lean_decoder.Block`) of
    that shape, or ``None`` and why it cannot run them."""
    if not q4q8.ops_loaded() or not hasattr(torch.ops.disco_q4q8, "decode_layers"):
        return None, "the q4 x q8 kernel's library is not loaded"
    if os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1":
        return None, "TRANSFORMERS_SDPA_FORCE_GQA is set (the attention then takes another route)"
    weights: list[torch.Tensor] = []
    out_features: list[int] = []
    epsilons, scalings, row_ranges = set(), set(), []
    empty = torch.empty(0)
    for block in blocks:
        projections = (block.wqkv, block.wo, block.w13, block.w2)
        if any(projection.direct is None for projection in projections):
            return None, "a projection not on the q4 x q8 kernel"
        for norm in (block.attention_norm, block.ffn_norm):
            if type(norm).__name__ not in _NORM_CLASSES:
                return None, f"a {type(norm).__name__} norm"
            epsilons.add(float(norm.variance_epsilon))
        scalings.add(float(block.attention.scaling))
        if getattr(block.attention, "num_key_value_groups", 1) != heads // kv_heads:
            return None, "an attention whose key groups differ from the config's"
        for projection in projections:
            direct = projection.direct
            plan = direct.row_plan
            row_ranges.append((1, 1 << 30) if plan is None else (plan.min_rows, plan.max_rows))
        wqkv, wo, w13, w2 = (projection.direct for projection in projections)
        weights += [block.attention_norm.weight, wqkv.q4q8_weights, _bias(wqkv, empty), wo.q4q8_weights,
                    _bias(wo, empty), block.ffn_norm.weight, w13.q4q8_weights, _bias(w13, empty),
                    w2.q4q8_weights, _bias(w2, empty)]
        out_features += [wqkv.out_features, wo.out_features, w13.out_features, w2.out_features]
    if len(epsilons) != 1 or len(scalings) != 1:
        return None, "layers with different norm epsilons or attention scales"
    if any(weight.dtype != torch.bfloat16 for weight in weights[0::10] + weights[5::10]):
        return None, "norm weights not in bfloat16"
    loop = NativeLoop(tuple(weights), tuple(out_features), max(low for low, _ in row_ranges),
                      min(high for _, high in row_ranges), heads, kv_heads, head_dim,
                      epsilons.pop(), scalings.pop(), heads != kv_heads)
    if loop.min_rows > loop.max_rows:
        return None, "row plans without a common call size"
    return loop, ""


def _bias(module, empty: torch.Tensor) -> torch.Tensor:
    return empty if module.bias is None else module.bias
