"""A decoder's shape, derived once from its HF config: what caches, attention layouts and the
lean decoder size themselves by (layers, heads, key/value heads, head dim)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderShape:
    """Attributes:
        layers: decoder layers (each with its own keys and values).
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention: ``heads`` is a multiple).
        head_dim: channels per head.
    """

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, model: torch.nn.Module) -> "DecoderShape":
        """The shape of ``model``'s text decoder (HF config fields; ``head_dim`` and
        ``num_key_value_heads`` default as HF's Qwen2/Llama do)."""
        config = model.config
        config = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
        heads = int(config.num_attention_heads)
        return cls(layers=int(config.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads))
