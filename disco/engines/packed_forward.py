"""The one forward pass of the engines: several sessions' pending tokens in one pass, each
session getting bit for bit what it gets alone, and every decoded token computed as in
one-token-at-a-time decoding.

Two numeric promises, and how they are kept:

1. **Batching changes no bits.** A padded batch changes each session's attention (keys
   left-padded to the longest cache, queries right-padded to the longest block), so the
   reductions run over other lengths and round differently: ~1e-5 in float32, a few ulps
   per layer in bf16 — enough to flip a greedy argmax a few dozen tokens in (issue 17).
   Here the pending tokens of all sessions form *one* row of ``sum(k_i)`` tokens with
   each session's own position ids. Everything but attention is row-wise (embeddings,
   norms, MLPs, projections, the LM head), and every low-precision CPU linear follows a
   row plan proven at load (:mod:`disco.models.row_stable`: call sizes whose bits do not
   depend on the other rows; :mod:`disco.engines.packing_proof` checks the whole forward
   at engine start); attention runs per session, on the session's own cache
   (:class:`PackedCache`) with the mask its own forward would build.
2. **A verified block equals decoding.** A target forward over a block of k draft tokens
   must give the logits that k one-token forwards give, or speculation changes the output
   in bf16 ("near-ties"). Row-wise ops already agree; attention over a block (one call, a
   causal mask) does not, so every forward that asks for logits attends *one query at a
   time*: query i over the keys up to its own position, unmasked — the call decoding makes.
   A prefill (the prompt, no logits) keeps the one-call causal attention: both decoding
   and speculation prefill the same way.

   How those queries attend is an :class:`~disco.engines.varlen_attention.AttentionPlan`:
   the reference above (one sdpa per query; the CPU's plan, by measurement) or every such
   query of every session in one sdpa call per layer (:mod:`disco.engines.varlen_attention`;
   CUDA's plan), bit-identical alone and packed within each plan.

With both, greedy speculative output in bf16 equals target-only output wherever the row
plans hold (measured: AVX2, AMX and AVX-512-BF16 CPUs, bf16 and int8/int4; float32 GEMM
is not row-invariant on AVX2, its ~1e-6 differences stay far below a flip).

The decoder runs as the model's lean decoder (:mod:`disco.engines.lean_decoder`: one plain loop
over the layers, the HF forward's bits with fewer ops; checked against the HF forward once per
model, :func:`lean_decoder_for`) or, for other architectures, as the HF decoder forward.

The attention function is installed once per model (:func:`install`); without a packed
forward in flight it is exactly the model's previous implementation (sdpa), so every other
use of the model is unchanged. Models whose layers are not all full attention, or that do
not use sdpa, fall back to plain unbatched forwards (:func:`supports_packing`).
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from disco.engines import lean_decoder
from disco.engines.batch_layout import BatchLayout, SessionRows, packed_layout
from disco.engines.decoder_shape import DecoderShape
from disco.engines.engine_state import engine_state
from disco.engines.kv_pool import PoolCache
from disco.engines.varlen_attention import AttentionPlan, attention_plan, one_call_attention
from disco.models.weight_only import DENSE_MIN_ROWS, dense_prefill

_NAME = "disco_packed_sdpa"
_BASE = "sdpa"

logger = logging.getLogger(__name__)


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether :func:`packed_forward` can run ``model`` (installs the attention hook once)."""
    config = model.config
    if config._attn_implementation == _NAME:
        return True
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or config._attn_implementation != _BASE:
        return False
    if _NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(_NAME, packed_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_NAME, ALL_MASK_ATTENTION_FUNCTIONS[_BASE])
    model.set_attn_implementation(_NAME)
    return config._attn_implementation == _NAME


@torch.inference_mode()
def packed_forward(model: torch.nn.Module, sessions: Sequence[SessionRows], plan: AttentionPlan | None = None,
                   lean: lean_decoder.LeanDecoder | bool | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Feed every session's tokens in one forward; extend each session's cache.

    Returns, per session, its logits ``[num_logits, vocab]`` (float32; empty for a
    prefill) and, if asked, the matching last hidden states ``[num_logits, hidden]``.
    The model must pass :func:`supports_packing`. ``plan``: how the queries that ask for
    logits attend (default: :func:`~disco.engines.varlen_attention.attention_plan` of the
    model's device; the same plan must serve decoding and verification). ``lean``: the
    decoder's forward — ``None``, the model's lean decoder where it has one
    (:func:`lean_decoder_for`: the same bits, fewer ops); ``False``,
    the HF forward; or a given :class:`~disco.engines.lean_decoder.LeanDecoder`.
    """
    device = next(model.parameters()).device
    packed_cache = _packed_cache(model, sessions, plan or attention_plan(device))
    layout = packed_cache.layout
    input_ids = torch.tensor([[token for rows in sessions for token in rows.tokens]], dtype=torch.long, device=device)
    # A ready-made 4D mask is passed through untouched by transformers' mask builders, so
    # no mask is built for the packed row; the attention applies each session's own mask.
    unused_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
    # Long prefill blocks are multiplied on their own: the weight-only engines' dense GEMM,
    # the row-stable linears' one plain call (no effect on other engines).
    dense = [layout.rows_of(index) for index, rows in enumerate(sessions)
             if not rows.one_query_at_a_time and len(rows.tokens) >= DENSE_MIN_ROWS]
    decoder = lean_decoder_for(model) if lean is None or lean is True else lean or None  # None: HF's
    # 1. One forward of the decoder over the packed row; attention per session.
    with dense_prefill(dense):
        if decoder is not None:
            hidden = decoder(input_ids, layout.positions, packed_cache)[0]  # [rows, hidden]
        else:
            hidden = model.get_decoder()(input_ids=input_ids, attention_mask=unused_mask,
                                         position_ids=layout.positions,
                                         cache=packed_cache, use_cache=True,
                                         packed_cache=packed_cache).last_hidden_state[0]  # [rows, hidden]
    # 2. One LM-head matmul for every row asked for: the head is the largest weight matrix,
    # reading it once per session would cost as much as a forward of a small model.
    ends = layout.query_starts[1:]
    wanted = [hidden[end - rows.num_logits: end] for rows, end in zip(sessions, ends)]  # each [num_logits, hidden]
    results: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.empty(0), None)] * len(sessions)
    if any(rows.num_logits for rows in sessions):
        all_logits = model.get_output_embeddings()(torch.cat(wanted)).float()  # [sum of num_logits, vocab]
        for index, (rows, states, logits) in enumerate(
                zip(sessions, wanted, all_logits.split([len(w) for w in wanted]))):
            if rows.num_logits:
                results[index] = (logits, states.float() if rows.want_hidden else None)
    for index, rows in enumerate(sessions):
        if rows.want_hidden and not rows.num_logits:  # a prefill keeping its hidden states (prompt logprobs)
            start, end = layout.rows_of(index)
            results[index] = (torch.empty(0), hidden[start: end])  # [fed, hidden]
    return results


class PackedCache:
    """Stands in for the model's cache during a packed forward: ``update`` appends each
    session's rows of the new keys/values to the session's own cache; the attention function
    reads the per-session states back. It carries the forward's :class:`BatchLayout` (built
    once, read by every layer) and each prefill block's causal mask."""

    def __init__(self, sessions: Sequence[SessionRows], layout: BatchLayout, plan: AttentionPlan,
                 prefill_masks: Sequence[torch.Tensor | None]) -> None:
        self.sessions = sessions
        self.layout = layout
        self.plan = plan
        self.prefill_masks = prefill_masks  # per session: what its own block attention gets (a prefill)
        self.one_query = tuple(rows.one_query_at_a_time for rows in sessions)  # read per layer: once here
        self._states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,  # [1, kv_heads, rows, head_dim]
               layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.layout.query_starts
        self._states[layer_idx] = [
            rows.cache.update(key_states[:, :, start: end], value_states[:, :, start: end], layer_idx)
            if end > start else (key_states[:, :, :0], value_states[:, :, :0])
            for rows, start, end in zip(self.sessions, starts, starts[1:])]
        return key_states, value_states  # unused: the attention reads the per-session states

    def session_states(self, layer_idx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._states[layer_idx]


def _packed_cache(model: torch.nn.Module, sessions: Sequence[SessionRows], plan: AttentionPlan) -> PackedCache:
    """The forward's layout (the one call over the sessions that ask for logits, with a one-call
    plan) and each prefill block's causal mask, as the model's own forward builds it."""
    device = next(model.parameters()).device
    dtype = model.get_input_embeddings().weight.dtype
    shape = DecoderShape.of(model)
    layout = packed_layout([rows.cache_len for rows in sessions], [len(rows.tokens) for rows in sessions],
                           [rows.one_query_at_a_time for rows in sessions], shape.kv_heads, shape.group,
                           plan.key_granule, device,
                           bias_dtype=(plan.compute_dtype or dtype) if plan.memory_efficient else None,
                           one_call=plan.one_call)
    hidden_size, masks = int(model.config.hidden_size), []
    for index, rows in enumerate(sessions):
        mask = None
        if rows.tokens and not rows.one_query_at_a_time:
            start, end = layout.rows_of(index)
            shape_only = torch.empty(1, end - start, hidden_size, dtype=dtype, device=device)  # the mask reads its shape
            mask = create_causal_mask(config=model.config, inputs_embeds=shape_only, attention_mask=None,
                                      cache=rows.cache, position_ids=layout.positions[:, start: end])
        masks.append(mask)
    return PackedCache(sessions, layout, plan, masks)


def packed_attention(module: torch.nn.Module, query: torch.Tensor,  # query: [1, heads, rows, head_dim]
                      key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa per prefill block; the queries that ask for logits one at a time (reference) or
    all in one call (:mod:`disco.engines.varlen_attention`), as the packed cache's plan says."""
    sdpa = ALL_ATTENTION_FUNCTIONS[_BASE]
    packed: PackedCache | None = kwargs.pop("packed_cache", None)
    if packed is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    states = packed.session_states(module.layer_idx)
    layout = packed.layout
    one_call = None
    if layout.call_sessions:
        bounds = [layout.rows_of(index) for index in layout.call_sessions]
        rows = torch.cat([query[:, :, start: end] for start, end in bounds], dim=2)  # [1, heads, queries, dim]
        scaling = kwargs.get("scaling") or module.scaling
        one_call = iter(one_call_attention(rows, [states[index][0] for index in layout.call_sessions],
                                           [states[index][1] for index in layout.call_sessions], layout, scaling,
                                           packed.plan)
                        .split([end - start for start, end in bounds], dim=1))  # each [1, k, heads, dim]
    outputs = []
    starts = layout.query_starts
    for index, (start, end, one_query, (session_keys, session_values)) in enumerate(
            zip(starts, starts[1:], packed.one_query, states)):
        if end == start:
            continue
        if one_query and one_call is not None:
            outputs.append(next(one_call))
        elif one_query:  # the reference: query i sees the keys up to its own position, as in decoding
            outputs.extend(_one_query_at_a_time(module, query[:, :, start: end], session_keys, session_values,
                                                packed.plan, **kwargs))
        else:
            output, _ = sdpa(module, query[:, :, start: end], session_keys, session_values,
                             packed.prefill_masks[index], **kwargs)
            outputs.append(output)  # [1, k, heads, head_dim]
    return torch.cat(outputs, dim=1), None


def _one_query_at_a_time(module: torch.nn.Module, queries: torch.Tensor,  # [1, heads, k, head_dim]
                         session_keys: torch.Tensor, session_values: torch.Tensor,  # [1, kv_heads, keys, head_dim]
                         plan: AttentionPlan, **kwargs) -> list[torch.Tensor]:
    """The reference: one sdpa per query over exactly the keys up to its position (each
    output ``[1, 1, heads, head_dim]``).

    Each query is the call transformers' sdpa attention makes for a one-token forward
    without a mask (:func:`_decoding_sdpa`), made directly: the wrapper's Python work, once
    per query and layer, was a measurable part of a verification's cost on a CPU."""
    dtype = queries.dtype
    # NOTE: in float32 on the CPU — a one-query attention in bf16 is ~6x slower on CPUs without
    # bf16 arithmetic (AVX2: 0.9 vs 0.15 ms per layer for 200 keys), and more exact.
    compute = plan.compute_dtype or dtype
    queries, session_keys, session_values = queries.to(compute), session_keys.to(compute), session_values.to(compute)
    first_key_end = session_keys.shape[2] - queries.shape[2] + 1
    attend = _decoding_sdpa(module, session_keys, session_values, **kwargs)
    outputs = []
    for offset in range(queries.shape[2]):
        keys_end = first_key_end + offset
        output = attend(queries[:, :, offset: offset + 1], session_keys[:, :, :keys_end],
                        session_values[:, :, :keys_end])
        outputs.append(output.to(dtype))  # [1, 1, heads, head_dim]
    return outputs


def _decoding_sdpa(module: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor, **kwargs):
    """``attend(query [1, heads, 1, dim], keys, values) -> [1, 1, heads, dim]``: what
    ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` computes for one query
    and no mask — ``scaled_dot_product_attention`` with GQA where the module has key groups, not
    causal, then the heads moved before the dim — called directly. Where the wrapper would take
    another route (key and value dims differ or exceed 256, forced GQA, dropout), the wrapper."""
    sdpa = ALL_ATTENTION_FUNCTIONS[_BASE]
    groups = getattr(module, "num_key_value_groups", 1)
    direct = (keys.shape[-1] == values.shape[-1] <= 256 and not kwargs.get("dropout")
              and os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") != "1")
    if not direct:
        return lambda query, keys, values: sdpa(module, query, keys, values, None, **kwargs)[0]
    scale = kwargs.get("scaling")
    if groups > 1:
        return lambda query, keys, values: torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False,
            enable_gqa=True).transpose(1, 2)
    return lambda query, keys, values: torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False).transpose(1, 2)


def lean_decoder_for(model: torch.nn.Module) -> lean_decoder.LeanDecoder | None:
    """The model's lean decoder, built and checked once (cached on the model); ``None`` where
    the HF forward runs instead (an architecture it does not know, or a check that failed)."""
    state = engine_state(model)
    cached = state.lean
    if cached is False or (cached is not None and cached.is_current()):
        return cached or None
    reason = lean_decoder.unsupported_reason(model) if supports_packing(model) else "no packed forward"
    lean = None
    if reason is None:
        lean = lean_decoder.LeanDecoder(model)
        reason = _lean_check(model, lean)
        if reason is not None and lean.native is not None:
            logger.warning("%s: the C++ layer loop off (%s)", type(model).__name__, reason)
            lean = lean_decoder.LeanDecoder(model, native=False)
            reason = _lean_check(model, lean)
        if reason is not None and lean.fused:
            logger.warning("%s: fused projections off (%s)", type(model).__name__, reason)
            # the parts keep views of the fused buffers: same values
            lean = lean_decoder.LeanDecoder(model, fuse=False, native=False)
            reason = _lean_check(model, lean)
    if reason is not None:
        logger.info("%s: the HF forward (no lean decoder: %s)", type(model).__name__, reason)
        lean = None
    state.lean = lean or False
    return lean


def describe_forward(model: torch.nn.Module) -> str:
    """What runs the model's packed forwards, for the start-up log: its lean decoder or the HF forward."""
    lean = lean_decoder_for(model)
    return lean.describe() if lean is not None else "the HF decoder forward (no lean decoder for this model)"


def _lean_check(model: torch.nn.Module, lean: lean_decoder.LeanDecoder) -> str | None:
    """Compare the lean and the HF forward bit for bit on a short prefill and a 3-token block;
    ``None`` when they agree, else what differed."""
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (12,), generator=generator).tolist()
    outputs = []
    for forward in (False, lean):
        cache = PoolCache.for_model(model, 16)
        packed_forward(model, [SessionRows(cache, 0, tokens[:8], 0)], lean=forward)
        logits, _ = packed_forward(model, [SessionRows(cache, 8, tokens[8:], 4)], lean=forward)[0]
        outputs.append(logits)
    if not torch.equal(outputs[0], outputs[1]):
        differing = int((outputs[0] != outputs[1]).any(dim=-1).sum())
        return f"its logits differ from the HF forward's in {differing} of 4 positions"
    return None
