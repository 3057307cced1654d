"""Tiny, seeded, random models and a download-free tokenizer for hermetic tests.

``initializer_range=0.3`` makes random models produce varied greedy output; with HF's
default 0.02 they repeat one token forever and exactness tests pass on broken code.
"""

from __future__ import annotations

import copy
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE = 512
EOS = "<|endoftext|>"


def build_tokenizer(vocab_size: int = VOCAB_SIZE, files: tuple[str, ...] = ("textwrap.py", "string.py")) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few standard-library modules."""
    stdlib = os.path.dirname(os.__file__)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([os.path.join(stdlib, name) for name in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


def qwen2(seed: int, vocab_size: int = VOCAB_SIZE, hidden: int = 64, layers: int = 2, heads: int = 4,
          kv_heads: int = 2, max_positions: int = 512) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, initializer_range=0.3, eos_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().eval()


def llama(seed: int, vocab_size: int = VOCAB_SIZE, hidden: int = 48, layers: int = 3) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512, initializer_range=0.3, eos_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """The target with small Gaussian noise on every weight: mixed acceptance."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return noisy.eval()
