"""One forward's batch as its attention reads it, built once per forward and read by every layer
(vLLM's attention metadata as the model): which rows are whose, how many positions each session's
cache holds, each row's position, and for the one attention call per layer where each session's
keys are read from and which of them each query sees (mask and bias).

Both forwards describe their batch with it:

* the packed forward (:mod:`disco.engines.packed_forward`: any mix of prefills, decoding and
  verification; each session's keys in its own run of the model's KV pool), :func:`packed_layout`;
* the static step (:mod:`disco.engines.static_step`: a bucket of sessions in slots, ``block``
  query slots each), :func:`slot_layout`, from device tensors only, so a CUDA graph captures it.

Either way a session asks for rows through a :class:`SessionRows` (its cache, the positions the
cache holds, the tokens to feed, the logits it wants), and the one attention call
(:func:`disco.engines.varlen_attention.one_call_attention`) takes the layout as it is. Which keys a
query sees is one rule, :func:`visible_keys`, and the call's mask is built from it here once per
forward (:func:`item_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.cache_utils import Cache



@dataclass
class SessionRows:
    """One session's part of a forward (the packed forward's, or a static step's where the cache
    is a slot's).

    Attributes:
        cache: the session's KV cache (covers ``cache_len`` tokens; extended in place): a
            :class:`~disco.engines.kv_pool.PoolCache` (a run of the model's pool; a slot's run for
            the static step) or any transformers cache.
        cache_len: tokens the cache covers before this forward.
        tokens: the tokens to feed.
        num_logits: logits wanted for the last ``num_logits`` fed tokens; 0 for a prefill.
        want_hidden: also return the last hidden states of those positions (a prefill: of every
            fed position, in the model's dtype, and no logits: the prompt's log-probabilities).
    """

    cache: Cache
    cache_len: int
    tokens: Sequence[int]
    num_logits: int
    want_hidden: bool = False

    @property
    def one_query_at_a_time(self) -> bool:
        return self.num_logits > 0  # decoding and verification; a prefill attends as one block


@dataclass(frozen=True)
class BatchLayout:
    """Where everything of one forward is (module doc). ``sessions`` is the batch's session count;
    the *call* is the one attention call per layer over the sessions whose queries ask for logits
    (``call_sessions``; the static step: every row).

    Attributes:
        query_starts: ``[sessions + 1]`` host ints: session ``s`` feeds rows
            ``query_starts[s]:query_starts[s + 1]`` of the forward (cumulative query counts).
        cache_lengths: ``[sessions]`` long: positions each session's cache holds before the forward (the
            packed forward: on the host, nothing on the device reads it; the static step: its input buffer).
        positions: ``[1, rows]`` long: each row's position (the rotary embedding's input).
        call_sessions: host ints: the sessions in the one call, in call order; empty: no call.
        max_queries: query slots per session in the call (a session's queries ride in the head
            dimension, kv-head-major: :func:`~disco.engines.varlen_attention.as_items`).
        padded_keys: key slots per session in the call (a multiple of the key granule; the static
            step: the slots' capacity).
        mask: ``[call sessions, kv_heads * max_queries * group, 1, padded_keys]`` bool, True where a
            query attends (:func:`item_masks`); ``None``: no call.
        bias: ``mask`` as the memory-efficient kernel's additive bias, when the plan calls that kernel.
        slots: ``[call sessions]`` long: each one's slot in the pool's slot chunk, where the call
            reads its keys by slot id (the static step); ``None``: sessions in runs of their own.
        key_gather: ``[call sessions * padded_keys]`` long: indices into the call sessions' keys
            concatenated, plus one zero row (index ``sum of their keys``) for the padding; ``None``
            where keys are read by slot id.
        query_gather: ``[call sessions * max_queries]`` long: indices into the call's query rows
            plus one zero row (index ``num_queries``) for the padding; ``None``: the rows are
            already ``max_queries`` per session, in order (the static step).
        query_rows: ``[num queries]`` long: where the real queries are among ``call sessions *
            max_queries``; ``None`` with ``query_gather``.
    """

    query_starts: tuple[int, ...]
    cache_lengths: torch.Tensor
    positions: torch.Tensor
    call_sessions: tuple[int, ...] = ()
    max_queries: int = 0
    padded_keys: int = 0
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    key_gather: torch.Tensor | None = None
    query_gather: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None

    @property
    def sessions(self) -> int:
        return len(self.query_starts) - 1

    def rows_of(self, session: int) -> tuple[int, int]:
        """The forward's rows ``[start, end)`` session ``session`` feeds."""
        return self.query_starts[session], self.query_starts[session + 1]


def packed_layout(cache_lengths: Sequence[int], query_counts: Sequence[int], in_call: Sequence[bool],
                  kv_heads: int, group: int, granule: int, device: torch.device | str,
                  bias_dtype: torch.dtype | None = None, one_call: bool = True) -> BatchLayout:
    """The packed forward's layout: session ``s`` holds ``cache_lengths[s]`` positions and feeds
    ``query_counts[s]`` rows; with ``one_call``, the sessions marked ``in_call`` (queries that ask
    for logits, at least one row) attend in the one call, query ``i`` of such a session seeing its
    first ``cache_lengths[s] + 1 + i`` keys. ``group``: query heads per key head; ``granule``:
    padded key counts are multiples of it; ``bias_dtype``: also make the bias."""
    starts = [0]
    for count in query_counts:
        starts.append(starts[-1] + count)
    positions = torch.cat([torch.arange(length, length + count) for length, count in zip(cache_lengths, query_counts)]
                          or [torch.zeros(0, dtype=torch.long)]).to(device).unsqueeze(0)  # [1, rows]
    lengths = torch.tensor(list(cache_lengths), dtype=torch.long)
    chosen = tuple(index for index, (count, wanted) in enumerate(zip(query_counts, in_call)) if wanted and count)
    if not one_call or not chosen:
        return BatchLayout(tuple(starts), lengths, positions)
    keys = torch.tensor([cache_lengths[s] + query_counts[s] for s in chosen], dtype=torch.long)  # after the update
    queries = torch.tensor([query_counts[s] for s in chosen], dtype=torch.long)
    max_queries = int(queries.max())
    padded = max(1, -(-int(keys.max()) // granule)) * granule
    key_offsets = torch.cumsum(keys, 0) - keys  # [call sessions]
    query_offsets = torch.cumsum(queries, 0) - queries
    key_slots = torch.arange(padded)  # [padded]
    key_gather = torch.where(key_slots < keys[:, None], key_offsets[:, None] + key_slots, int(keys.sum()))
    query_slots = torch.arange(max_queries)  # [max_queries]
    real = query_slots < queries[:, None]  # [call sessions, max_queries]
    query_gather = torch.where(real, query_offsets[:, None] + query_slots, int(queries.sum()))
    item_positions = torch.where(real, (keys - queries)[:, None] + query_slots, 0)  # [call sessions, max_queries]
    mask, bias = item_masks(item_positions.to(device), padded, kv_heads, group, bias_dtype)
    return BatchLayout(tuple(starts), lengths, positions, chosen, max_queries, padded, mask, bias,
                       key_gather=key_gather.reshape(-1).to(device), query_gather=query_gather.reshape(-1).to(device),
                       query_rows=real.reshape(-1).nonzero().squeeze(1).to(device))


def slot_layout(slots: torch.Tensor,  # [sessions] long: each row's slot
                cache_lengths: torch.Tensor,  # [sessions] long: the positions its slot holds
                offsets: torch.Tensor,  # [block] long: 0..block-1
                capacity: int, kv_heads: int, group: int, bias_dtype: torch.dtype | None = None) -> BatchLayout:
    """The static step's layout: every session feeds ``block`` rows at the positions after its slot's
    length and all of them attend in the one call, over the slot's whole capacity (keys past a
    query's position are masked: they add exact zeros). Built from device tensors alone (no host
    value read), so a CUDA graph captures it."""
    sessions, block = slots.shape[0], offsets.shape[0]
    positions = cache_lengths[:, None] + offsets  # [sessions, block]
    mask, bias = item_masks(positions, capacity, kv_heads, group, bias_dtype)
    return BatchLayout(tuple(range(0, sessions * block + 1, block)), cache_lengths, positions.reshape(1, -1),
                       tuple(range(sessions)), block, capacity, mask, bias, slots=slots)


def visible_keys(positions: torch.Tensor,  # [sessions, slots]: each query's position (a padding query: 0)
                 keys: int) -> torch.Tensor:  # [sessions, slots, keys], bool
    """The one rule of which keys a query sees: its session's keys up to its own position, what
    a one-token decoding step at that position attends (so a verified block gives decoding's
    bits); a padding query sees key 0 only (no row is empty). Padded keys past a session's
    length are masked: they add exact zeros."""
    return torch.arange(keys, device=positions.device) <= positions[:, :, None]


def item_masks(positions: torch.Tensor,  # [sessions, slots]: each query's position (a padding query: 0)
               keys: int, kv_heads: int, group: int, bias_dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one call's mask ``[sessions, kv_heads * slots * group, 1, keys]`` (:func:`visible_keys`
    laid out as :func:`~disco.engines.varlen_attention.as_items` lays out the queries) and, with
    ``bias_dtype`` (the memory-efficient kernel's plans), its additive bias."""
    mask = item_mask(visible_keys(positions, keys), kv_heads, group)
    return mask, additive_bias(mask, bias_dtype) if bias_dtype is not None else None


def item_mask(visible: torch.Tensor,  # [sessions, slots, keys], bool: True where query slot attends key
              kv_heads: int, group: int) -> torch.Tensor:  # [sessions, kv_heads * slots * group, 1, keys]
    """A mask per query slot as the one call's mask, kv-head-major like the call's items."""
    sessions, slots, keys = visible.shape
    expanded = visible[:, None, :, None, :].expand(sessions, kv_heads, slots, group, keys)
    return expanded.reshape(sessions, kv_heads * slots * group, 1, keys)


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as sdpa converts it for its fused kernels: 0 where True, -inf
    where False, in ``dtype``, same shape."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full_like(zero, float("-inf")))
