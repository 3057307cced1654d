"""The default pair's architectures as data, so a machine with no network can build
random-weight models of the same shapes (``disco doctor`` without model arguments).

The figures are those of the prepared default pair's ``config.json``
(``<home>/converted/qwen2.5-coder-{1.5b,0.5b}-instruct-*/config.json``, converted from the
GGUF files of :mod:`disco.models.default_pair`): Qwen2.5-Coder-1.5B-Instruct (target) and
Qwen2.5-Coder-0.5B-Instruct (draft). NOTE: upstream Qwen2.5-0.5B ties its LM head to the
embedding; the GGUF carries its own ``output.weight``, so the converted draft (what the
engines run) is untied, and so is its architecture here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

#: ``initializer_range`` of the random-weight models. NOTE: HF's default 0.02 makes a
#: random model repeat one token (every draft agrees with it, exactness checks pass on
#: broken code: docs/exactness.md); 0.3 is what the tests' tiny models use, and with it the
#: random default-pair shapes produce varied greedy output (checked by ``disco doctor``,
#: which reports the distinct tokens of its reference output).
RANDOM_INITIALIZER_RANGE = 0.3


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen2 causal LM (what ``Qwen2Config`` needs to build it)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    def config(self, eos_token_id: int | None = None,
               initializer_range: float = RANDOM_INITIALIZER_RANGE) -> Qwen2Config:
        """A ``Qwen2Config`` of this shape (``eos_token_id``: the tokenizer's EOS)."""
        return Qwen2Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            tie_word_embeddings=self.tie_word_embeddings, initializer_range=initializer_range,
            eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=eos_token_id,
            use_sliding_window=False)

    def random_model(self, seed: int, dtype: torch.dtype = torch.bfloat16, eos_token_id: int | None = None,
                     initializer_range: float = RANDOM_INITIALIZER_RANGE) -> PreTrainedModel:
        """A model of this shape with seeded random weights (same seed, same weights), in eval mode."""
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(self.config(eos_token_id, initializer_range), dtype=dtype)
        return model.eval()


def default_pair_architectures() -> dict[str, Architecture]:
    """``{"target": ..., "draft": ...}``: the default pair's shapes (module docstring)."""
    return {
        "target": Architecture(name="Qwen2.5-Coder-1.5B-Instruct (random weights)", hidden_size=1536,
                               intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, vocab_size=151936, rope_theta=1_000_000.0,
                               tie_word_embeddings=False),
        "draft": Architecture(name="Qwen2.5-Coder-0.5B-Instruct (random weights)", hidden_size=896,
                              intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, vocab_size=151936, rope_theta=1_000_000.0,
                              tie_word_embeddings=False),
    }
