"""The lean decode path: a Qwen2/Llama-style decoder as plain tensor ops over the packed row.

transformers' decoder forward wraps every layer in module calls, decorators, keyword
plumbing and output recorders: for the 24-layer 0.5B draft that Python work is a large part
of a one-token forward on a CPU (docs/engines.md, "The lean decode path"). Here the packed
forward's decoder (:func:`disco.engines.packed_forward.packed_forward`, step 1) runs as one
loop over the layers, calling only what computes:

* the **same ops on the same weights** as the HF forward: the model's own linear modules
  (so the engines' row plans, weight-only kernels and dense prefill spans apply unchanged),
  HF's RMSNorm arithmetic (float32 mean of squares, rsqrt, back to the model's dtype), the
  model's own rotary embedding, and the packed attention of
  :mod:`disco.engines.packed_forward` (per-session caches, one query at a time or the one-call
  plan). Element-wise ops give the same bits whatever tensor they run on, so q and k are
  rotated in one call.
* **fused projections** where the kernel allows it: when q/k/v (and gate/up) are q4 x q8 int4
  layers (:mod:`disco.models.q4q8`), they run as one call over one weight buffer (the parts'
  buffers become views of it: no second copy). That kernel computes every output channel from
  the row's own int8 activations alone, so a fused call gives each channel its own layer's bits.
  Rows of a long prefill block (dense spans) run through the separate layers, as in HF, unless
  the layers multiply their prefill spans on the kernel too (``dense_dtype`` ``None``: where the
  kernel measured faster at load, :func:`disco.models.weight_only.choose_prefill_path`).

It calls the layers' linear modules (and norms other than HF's RMSNorm), not the decoder
layers or attention modules themselves: hooks registered on those do not run on this path
(hooks on the linears do).

The promise is **bit identity with the HF forward** — so every exactness proof of the packed
forward (row plans, a verified block equals decoding, the start-up packing proof) holds for
it. :func:`disco.engines.packed_forward.lean_decoder_for` checks that promise once per model (a
short prefill and a block through both forwards, logits compared bit for bit) and falls back to
the HF forward, with the reason in the log, where it does not hold or the architecture is not
one it knows. The decoder is built over the model's modules as they stand; the models room moves
the model's weights version when it changes them (:mod:`disco.models.model_record`), and the next
forward gets a new decoder (:meth:`LeanDecoder.is_current`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from disco.engines.decoder_shape import DecoderShape
from disco.engines.native_loop import NativeLoop, native_loop
from disco.models import q4q8
from disco.models.int4 import Int4Linear
from disco.models.model_record import model_record
from disco.models.weight_only import dense_spans_active

#: Architectures whose decoder layer is the one below (pre-norm RMSNorm, rotary GQA
#: attention with optional q/k/v biases, SwiGLU MLP, no sliding window).
ARCHITECTURES = ("qwen2", "llama")
_NORM_CLASSES = ("Qwen2RMSNorm", "LlamaRMSNorm")

#: One layer's attention: ``(attention module, query [1, heads, rows, dim], key, value [1, kv_heads,
#: rows, dim]) -> [1, rows, heads, dim]``; it also stores the new keys and values in its caches.
Attention = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection of a block, as gpt-fast names them (``wqkv``, ``wo``, ``w13``, ``w2``): the
    model's linear layers side by side (q, k, v; gate, up; or one), and, where they are q4 x q8
    int4 layers, ``direct``: the one layer whose kernel is called for all of them (their fused
    weights, :func:`_fused`; a single part itself).

    Calling it gives the parts' outputs side by side ``[1, rows, sum of out_features]``: one
    kernel call over ``direct`` where every row of the forward runs on the kernel
    (:func:`_on_kernel`), else the parts called as HF calls them (dense prefill spans)."""

    parts: tuple[nn.Module, ...]
    direct: Int4Linear | None = None

    def __call__(self, states: torch.Tensor, spans: bool) -> torch.Tensor:  # [1, rows, in] -> [1, rows, out]
        if self.direct is not None and (not spans or _on_kernel(spans, *self.parts)):
            return _project(self.direct, states)
        if len(self.parts) == 1:
            return self.parts[0](states)
        return torch.cat([part(states) for part in self.parts], dim=-1)


@dataclass(frozen=True, slots=True)
class Block:
    """One decoder layer: its two norms (the model's modules), its projections and its attention
    module (its layer index and scaling, read by the attention callback)."""

    attention_norm: nn.Module
    wqkv: Projection
    attention: nn.Module
    wo: Projection
    ffn_norm: nn.Module
    w13: Projection
    w2: Projection

    @property
    def fused(self) -> int:
        """Projections of several parts that run as one kernel call."""
        return sum(projection.direct is not None for projection in (self.wqkv, self.w13))


def _block(layer: nn.Module, fuse: bool) -> Block:
    attention, mlp = layer.self_attn, layer.mlp

    def projection(*parts: nn.Module) -> Projection:
        if not fuse:
            return Projection(parts)
        if len(parts) == 1:
            return Projection(parts, parts[0] if _kernel_direct(parts[0]) else None)
        return Projection(parts, _fused(list(parts)) if _fusable(list(parts)) else None)

    return Block(layer.input_layernorm, projection(attention.q_proj, attention.k_proj, attention.v_proj), attention,
                 projection(attention.o_proj), layer.post_attention_layernorm,
                 projection(mlp.gate_proj, mlp.up_proj), projection(mlp.down_proj))


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the lean forward cannot run ``model``, or ``None`` when it can."""
    config = model.config
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"architecture {getattr(config, 'model_type', None)!r} (lean: {', '.join(ARCHITECTURES)})"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r}"
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) != "default":
        return f"rotary embedding {getattr(rotary, 'rope_type', None)!r}"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "layers other than full attention"
    for layer in decoder.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                return f"a decoder layer without {name}"
        if not all(hasattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "an attention without q/k/v/o projections"
        if not all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP without gate/up/down projections"
    return None


def _fusable(parts: list[nn.Module]) -> bool:
    """Whether ``parts`` can run as one call: q4 x q8 int4 layers of one input width, kernel,
    row plan and dtype, output widths multiples of the kernel's 16-channel blocks."""
    if not all(isinstance(part, Int4Linear) and part.kernel in q4q8.KERNELS for part in parts):
        return False
    first = parts[0]
    return all(part.in_features == first.in_features and part.kernel == first.kernel
               and part.row_plan == first.row_plan and part.compute_dtype == first.compute_dtype
               and part.out_features % 16 == 0 and (part.bias is None) == (first.bias is None) for part in parts)


def _fused(parts: list[nn.Module]) -> Int4Linear:
    """One int4 layer whose output is the parts' outputs side by side. The kernel's layout
    stores blocks of 16 output channels one after the other, so the fused weights are the
    parts' buffers concatenated; the parts then read views of that buffer (no second copy)."""
    first = parts[0]
    fused = Int4Linear.__new__(Int4Linear)
    nn.Module.__init__(fused)
    fused.in_features, fused.group_size = first.in_features, first.group_size
    fused.out_features = sum(part.out_features for part in parts)
    fused.register_buffer("packed", torch.empty(0, dtype=torch.uint8))
    fused.register_buffer("centered", torch.empty(0, dtype=torch.int8))
    # Only the dtype is read (compute_dtype): the q4 x q8 weights carry their scales.
    fused.register_buffer("scales_and_zeros", first.scales_and_zeros[:0, :0])
    fused.register_buffer("bias", None if first.bias is None else torch.cat([part.bias for part in parts]))
    fused.kernel, fused.row_plan, fused.dense_dtype = first.kernel, first.row_plan, first.dense_dtype
    weights = torch.cat([part.q4q8_weights for part in parts])
    fused.q4q8_weights = weights
    offset = 0
    for part in parts:
        size = part.q4q8_weights.numel()
        part.q4q8_weights = weights[offset: offset + size]
        offset += size
    return fused


def _kernel_direct(module: nn.Module) -> bool:
    """Whether :func:`_project` may call ``module``'s q4 x q8 kernel itself."""
    return isinstance(module, Int4Linear) and module.kernel in q4q8.KERNELS


def _project(module: Int4Linear, states: torch.Tensor) -> torch.Tensor:  # [1, rows, in] -> [1, rows, out]
    """A q4 x q8 layer's kernel over every row, in the row plan's calls, and the bias add made
    here — what :class:`Int4Linear`'s forward does for decoded rows, without its Python layers
    (only where no row is in a dense prefill span, or the layer's spans take the kernel too: the
    caller checks, :func:`_on_kernel`)."""
    rows = states.shape[1]
    plan = module.row_plan
    if plan is not None and not plan.min_rows <= rows <= plan.max_rows:  # a prefill on the kernel
        flat = states.reshape(rows, module.in_features).to(module.compute_dtype).contiguous()
        out = plan.run(flat, lambda part: q4q8.mm(part, module.q4q8_weights, module.out_features))
    else:
        out = q4q8.mm(states.reshape(rows, module.in_features).contiguous(), module.q4q8_weights, module.out_features)
    if module.bias is not None:
        out = out + module.bias
    return out.view(1, rows, module.out_features)


def _on_kernel(spans: bool, *parts: nn.Module) -> bool:
    """Whether the parts multiply every row of this forward on their quantized kernel: no dense
    prefill span in it, or the parts' spans take the kernel too (``dense_dtype`` ``None``,
    :func:`disco.models.weight_only.choose_prefill_path`)."""
    return not spans or all(getattr(part, "dense_dtype", 0) is None for part in parts)


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
    """HF's Qwen2/Llama RMSNorm arithmetic without the module call; any other norm module
    (a GPU's row-stable norm) is called as it is."""
    if type(norm).__name__ not in _NORM_CLASSES:
        return norm(hidden)
    states = hidden.to(torch.float32)
    variance = states.pow(2).mean(-1, keepdim=True)
    states = states * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * states.to(hidden.dtype)


def _rotate_half(states: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    return torch.cat((-states[..., half:], states[..., :half]), dim=-1)


class LeanDecoder:
    """The decoder of one model as a plain loop (module doc), over a model that
    :func:`disco.engines.packed_forward.supports_packing` (its attention is the packed one).
    Built and checked by :func:`disco.engines.packed_forward.lean_decoder_for`."""

    def __init__(self, model: nn.Module, fuse: bool = True, native: bool = True) -> None:
        self.model = model
        self.version = model_record(model).version  # the weights it reads (is_current)
        decoder = model.get_decoder()
        self.decoder = decoder
        self.shape = DecoderShape.of(model)
        self.heads, self.kv_heads, self.head_dim = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        self.blocks: tuple[Block, ...] = tuple(_block(layer, fuse) for layer in decoder.layers)
        # The layer loop in C++ for decoding and verification rows (disco.engines.native_loop).
        self.native: NativeLoop | None = None
        self.native_off = "off"  # why there is none
        if native:
            self.native, self.native_off = native_loop(self.blocks, self.heads, self.kv_heads, self.head_dim)

    def is_current(self) -> bool:
        """Whether the model's modules are still those this decoder was built over: the models
        room moves the model's weights version whenever it changes them (quantizing, a kernel,
        row plans; :mod:`disco.models.model_record`), and a model changed after its first forward
        gets a new decoder. One integer compared per forward."""
        return model_record(self.model).version == self.version

    @property
    def fused(self) -> bool:
        return any(block.fused for block in self.blocks)

    def describe(self) -> str:
        loop = "layer loop in C++ for decoding rows" if self.native is not None else f"Python layer loop ({self.native_off})"
        return (f"lean decoder ({len(self.blocks)} layers, {sum(block.fused for block in self.blocks)} fused projections, "
                f"{loop})")

    def __call__(self, input_ids: torch.Tensor,  # [1, rows]
                 position_ids: torch.Tensor,  # [1, rows]
                 packed_cache) -> torch.Tensor:  # a disco.engines.packed_forward.PackedCache
        """The last hidden states ``[1, rows, hidden]`` (after the final norm); extends every
        session's cache in place, as the HF decoder does through the packed cache."""
        hidden, cos, sin = self._inputs(input_ids, position_ids)
        if self.native is not None and not dense_spans_active():
            out = self.native.run(hidden, cos, sin, packed_cache)
            if out is not None:
                return _rms_norm(self.decoder.norm, out)
        attend = ALL_ATTENTION_FUNCTIONS[self.model.config._attn_implementation]  # the packed forward's attention

        def packed(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            key, value = packed_cache.update(key, value, module.layer_idx)
            attended, _ = attend(module, query, key, value, None, packed_cache=packed_cache, dropout=0.0,
                                 scaling=module.scaling)
            return attended

        return self._layers(hidden, cos, sin, packed)

    def _inputs(self, tokens: torch.Tensor,  # [1, rows]
                positions: torch.Tensor  # [1, rows]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embedded tokens ``[1, rows, hidden]`` and the rotary ``cos``, ``sin`` ``[1, rows, 1, head_dim]``."""
        hidden = self.decoder.embed_tokens(tokens)  # [1, rows, hidden]
        cos, sin = self.decoder.rotary_emb(hidden, positions)  # each [1, rows, head_dim]
        return hidden, cos.unsqueeze(2), sin.unsqueeze(2)  # heads in dim 2

    def forward(self, tokens: torch.Tensor,  # [1, rows]
                positions: torch.Tensor,  # [1, rows]
                attention: Attention) -> torch.Tensor:  # [1, rows, hidden]
        """The blocks over ``tokens`` with ``attention`` (which stores the keys and values where
        its caches live and returns ``[1, rows, heads, head_dim]``); the last hidden states."""
        return self._layers(*self._inputs(tokens, positions), attention)

    def _layers(self, hidden: torch.Tensor,  # [1, rows, hidden]
                cos: torch.Tensor, sin: torch.Tensor,  # each [1, rows, 1, head_dim]
                attention: Attention) -> torch.Tensor:  # [1, rows, hidden]
        """The Python layer loop and the final norm."""
        rows = hidden.shape[1]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        # A long prefill block whose layers multiply it as dense GEMMs: the parts, as HF runs them.
        spans = dense_spans_active()
        for block in self.blocks:
            qkv = block.wqkv(_rms_norm(block.attention_norm, hidden), spans).view(1, rows, heads + 2 * kv_heads, dim)
            query_key = qkv[:, :, : heads + kv_heads]
            query_key = (query_key * cos) + (_rotate_half(query_key) * sin)
            attended = attention(block.attention, query_key[:, :, :heads].transpose(1, 2),  # [1, heads, rows, dim]
                                 query_key[:, :, heads:].transpose(1, 2),  # [1, kv_heads, rows, dim]
                                 qkv[:, :, heads + kv_heads:].transpose(1, 2))  # [1, kv_heads, rows, dim]
            hidden = hidden + block.wo(attended.reshape(1, rows, heads * dim).contiguous(), spans)
            gate_up = block.w13(_rms_norm(block.ffn_norm, hidden), spans)  # [1, rows, 2 * intermediate]
            width = gate_up.shape[-1] // 2
            hidden = hidden + block.w2(nn.functional.silu(gate_up[..., :width]) * gate_up[..., width:], spans)
        return _rms_norm(self.decoder.norm, hidden)
