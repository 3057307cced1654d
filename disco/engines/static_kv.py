"""A preallocated KV cache, rolled back by setting its length.

transformers' ``DynamicCache`` appends with ``torch.cat``: every decoded token copies the
whole cache of every layer, and the tensors move in memory at every step (no CUDA graph can
hold their addresses). :class:`PreallocatedCache` keeps per layer two buffers
``[1, kv_heads, capacity, head_dim]`` and a length:

* ``update`` writes the new keys/values into ``buffer[:, :, length: length + n]`` and
  returns the views ``buffer[:, :, :length + n]`` (what ``DynamicCache`` returns, so every
  transformers forward, mask builder and ``deepcopy`` works unchanged);
* ``crop(-n)`` (the rollback of a rejected draft) sets the length back: no copy;
* the capacity is given up front (a session's prompt plus its ``max_new_tokens``: then the
  buffers never move) or grows geometrically (doubling, in multiples of
  :data:`CAPACITY_STEP`) when a write would overflow it.

Memory: a buffer is allocated at the first write of a layer, in that write's dtype and
device; slots past the length hold stale or zero values that nothing reads.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from disco.engines.decoder_shape import DecoderShape

#: Capacities are multiples of this many positions.
CAPACITY_STEP = 64


def _rounded(positions: int) -> int:
    return max(1, -(-positions // CAPACITY_STEP)) * CAPACITY_STEP


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in fixed buffers; ``keys``/``values`` are the valid views."""

    is_croppable = True

    def __init__(self, capacity: int = CAPACITY_STEP) -> None:
        self._capacity = _rounded(capacity)
        self._length = 0
        self._key_buffer: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
        self._value_buffer: torch.Tensor | None = None
        super().__init__()

    # transformers' layer API reads and assigns ``keys``/``values`` (init, offload, reorder).
    @property
    def keys(self) -> torch.Tensor | None:  # [batch, kv_heads, length, head_dim]
        return None if self._key_buffer is None else self._key_buffer[:, :, : self._length]

    @keys.setter
    def keys(self, states: torch.Tensor | None) -> None:
        self._key_buffer = states
        self._length = 0 if states is None else states.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:  # [batch, kv_heads, length, head_dim]
        return None if self._value_buffer is None else self._value_buffer[:, :, : self._length]

    @values.setter
    def values(self, states: torch.Tensor | None) -> None:
        self._value_buffer = states
        self._length = 0 if states is None else states.shape[-2]

    @property
    def capacity(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, kv_heads, _, head_dim = key_states.shape
        self._key_buffer = key_states.new_zeros(batch, kv_heads, self._capacity, head_dim)
        self._value_buffer = value_states.new_zeros(batch, kv_heads, self._capacity, value_states.shape[-1])
        self._length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,  # [batch, kv_heads, new, head_dim]
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._key_buffer[:, :, self._length: end] = key_states
        self._value_buffer[:, :, self._length: end] = value_states
        self._length = end
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        capacity = _rounded(max(needed, 2 * self.capacity))
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self._length] = old[:, :, : self._length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers 5.x: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self._length = max(0, self._length + tokens_to_remove)

    def reset(self) -> None:
        self._length = 0


class PreallocatedCache(Cache):
    """A transformers ``Cache`` of :class:`PreallocatedLayer` (one per decoder layer).

    Args:
        num_layers: decoder layers of the model.
        capacity: positions to preallocate per layer (the session's prompt plus its token
            budget keeps the buffers in place; grown by doubling past it).
    """

    def __init__(self, num_layers: int, capacity: int = CAPACITY_STEP) -> None:
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int = CAPACITY_STEP) -> "PreallocatedCache":
        return cls(DecoderShape.of(model).layers, capacity)
