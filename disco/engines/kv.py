"""A token sequence plus the KV cache that covers a prefix of it.

Both engines keep one :class:`CachedSequence` per session. Invariant: the cache holds
exactly ``tokens[:cache_len]`` (less the :attr:`~CachedSequence.skipped` prompt tokens, which
are never fed: a draft's bounded prefill window); the rest of ``tokens`` is *pending* and is
fed to the model by the next :meth:`CachedSequence.forward`. ``cache_len`` is read off the
cache's length (one record: the cache's), never kept beside it. Rolling back to an accepted
prefix is :meth:`truncate`, which crops the cache (transformers 5.x ``Cache.crop`` takes the
negative number of positions to remove).

Forwards go through :func:`disco.engines.packed_forward.packed_forward` (a batch of one), the
same code the cross-session batcher runs, so a session computes the same bits alone and
in a batch, and a verified block the same bits as decoding it token by token.

The cache of a packed model is a :class:`~disco.engines.kv_pool.PoolCache`: a run of the
model's KV pool, written in place, rolled back by its length. Measured on the 2-core AVX-512
Xeon, 28 layers, 2 KV heads x 128, bf16, one verification cycle (write 5 positions, roll back 2)
took 0.26 ms at 100, 300 and 600 cached positions in such fixed buffers against 0.47, 0.86 and
1.57 ms for ``DynamicCache``'s ``torch.cat`` (``docs/analysis/packed_attention.py``); on CUDA
fixed buffers are what CUDA graphs need. Models without a packed forward keep ``DynamicCache``.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from disco.engines.batch_layout import SessionRows
from disco.engines.packed_forward import packed_forward, supports_packing
from disco.engines.kv_pool import PoolCache
from disco.engines.varlen_attention import AttentionPlan


class CachedSequence:
    """Args:
        model: the draft or target model.
        token_ids: the session's tokens so far.
        capacity: KV positions to preallocate (the prompt plus the session's token budget
            keeps the buffers in place); default: the prompt rounded up, grown by doubling.
        plan: how packed forwards attend (default: the device's, :func:`attention_plan`).
        skipped: indices of prompt tokens never fed (the draft's prefill window,
            :func:`prefill_window_skip`): the cache holds the others at consecutive positions.
    """

    def __init__(self, model: torch.nn.Module, token_ids: Sequence[int], capacity: int | None = None,
                 plan: AttentionPlan | None = None, skipped: range = range(0)) -> None:
        self.model = model
        self.tokens: list[int] = list(token_ids)
        # the prefill passes the skipped tokens and feeds at least one after them (cache_len reads the cache)
        assert skipped.step == 1 and skipped.stop < len(self.tokens) - 1 or not skipped, (skipped, len(self.tokens))
        self.skipped = skipped
        self.device = next(model.parameters()).device
        self.packed = supports_packing(model)  # else: plain HF forwards (no batching)
        self.plan = plan
        self.cache: Cache = (PoolCache.for_model(model, capacity or len(self.tokens) + 1) if self.packed
                             else DynamicCache(config=model.config))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def cache_len(self) -> int:
        """Tokens the cache covers: fed into it, or skipped (the cache's length, the skipped
        tokens added once the forwards passed them)."""
        positions = self.cache.get_seq_length()
        return positions + len(self.skipped) if self.skipped and positions > self.skipped.start else positions

    @property
    def num_pending(self) -> int:
        """Tokens the next forward feeds."""
        return self.kv_positions(len(self.tokens)) - self.kv_len

    @property
    def kv_len(self) -> int:
        """Positions the cache holds."""
        return self.cache.get_seq_length()

    def kv_positions(self, covered: int) -> int:
        """Positions the cache holds once ``tokens[:covered]`` are covered (the skipped ones not fed)."""
        return covered - max(0, min(covered, self.skipped.stop) - self.skipped.start)

    def _fed(self, end: int) -> list[int]:
        """The tokens a forward up to ``tokens[:end]`` feeds: the pending ones, none skipped."""
        if self.skipped and self.cache_len < self.skipped.stop:
            return [token for index, token in enumerate(self.tokens[self.cache_len:end], self.cache_len)
                    if index not in self.skipped]
        return self.tokens[self.cache_len:end]

    @torch.inference_mode()
    def forward(
        self, num_logits: int, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed every pending token; return the logits of the last ``num_logits``
        positions ``[num_logits, vocab]`` (float32) and, if asked, their last hidden
        states ``[num_logits, hidden]``. Afterwards the cache covers all tokens."""
        assert 1 <= num_logits <= self.num_pending, (num_logits, self.num_pending)
        return self.step(num_logits, want_hidden)

    @torch.inference_mode()
    def prefill(self) -> None:
        """Feed all tokens but the last into the cache (the last stays pending, so the
        next forward yields the first new token's distribution)."""
        if len(self.tokens) - 1 > self.cache_len:
            self.step(0)

    @torch.inference_mode()
    def prefill_hidden(self) -> torch.Tensor:
        """:meth:`prefill`, returning the last hidden states (what the LM head reads, in the
        model's dtype) of every position it fed ``[fed, hidden]``: the prompt's log-probabilities
        are the LM head over them (:func:`disco.speculation.logprobs.prompt_logprobs`)."""
        if len(self.tokens) - 1 <= self.cache_len:
            return torch.empty(0, int(self.model.config.get_text_config().hidden_size), device=self.device)
        hidden = self.step(0, want_hidden=True)[1]
        assert hidden is not None
        return hidden

    @torch.inference_mode()
    def step(self, num_logits: int, want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This sequence's forward alone: :meth:`forward` for ``num_logits >= 1``, a
        :meth:`prefill` for 0 (then empty logits, and with ``want_hidden`` the hidden states of
        every fed position, as :meth:`prefill_hidden`). The one place an unpacked HF forward runs
        (models without a packed forward, :func:`supports_packing`)."""
        if self.packed:
            return self.forward_batch([self], [num_logits], [want_hidden])[0]
        end = len(self.tokens) - 1 if num_logits == 0 else len(self.tokens)
        input_ids = torch.tensor([self._fed(end)], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, cache=self.cache, use_cache=True,
                            logits_to_keep=max(1, num_logits), output_hidden_states=want_hidden)
        if num_logits == 0:
            return torch.empty(0), output.hidden_states[-1][0] if want_hidden else None
        hidden = output.hidden_states[-1][0, -num_logits:].float() if want_hidden else None
        return output.logits[0, -num_logits:].float(), hidden

    @staticmethod
    def forward_batch(sequences: Sequence["CachedSequence"], num_logits: Sequence[int], want_hidden: Sequence[bool]
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One packed forward over several sequences of one model (see :meth:`forward`);
        ``num_logits[i] == 0`` prefills sequence i (all tokens but the last, no logits)."""
        rows = []
        for sequence, count, hidden in zip(sequences, num_logits, want_hidden):
            assert 0 <= count <= sequence.num_pending, (count, sequence.num_pending)
            end = len(sequence.tokens) - 1 if count == 0 else len(sequence.tokens)
            rows.append(SessionRows(sequence.cache, sequence.kv_len, sequence._fed(end), count, hidden))
        return packed_forward(sequences[0].model, rows, sequences[0].plan)  # the caches' lengths move

    def truncate(self, length: int) -> None:
        """Keep ``tokens[:length]`` and drop cache entries beyond it (never into the skipped tokens)."""
        assert self.skipped.stop <= length <= len(self.tokens) or not self.skipped and 0 <= length <= len(self.tokens)
        del self.tokens[length:]
        if self.cache_len > length:
            self.cache.crop(-(self.kv_len - self.kv_positions(length)))

    def fork(self, length: int) -> "CachedSequence":
        """A new sequence of ``tokens[:length]`` whose cache is a copy of this one's up to there
        (``length`` at most ``cache_len``; nothing pending)."""
        assert self.skipped.stop <= length <= self.cache_len or not self.skipped and 0 <= length <= self.cache_len
        fork = CachedSequence.__new__(CachedSequence)
        fork.model, fork.tokens, fork.skipped, fork.device = self.model, self.tokens[:length], self.skipped, self.device
        fork.packed, fork.plan = self.packed, self.plan
        positions = self.kv_positions(length)
        if isinstance(self.cache, PoolCache):
            fork.cache = self.cache.fork(positions)
        else:
            fork.cache = copy.deepcopy(self.cache)
            fork.cache.crop(-(self.kv_len - positions))
        return fork


#: A bounded prefill window keeps the prompt's first tokens too: models put much attention on
#: them whatever the text (the "attention sinks" of StreamingLLM, arXiv 2309.17453).
SINK_TOKENS = 4


def prefill_window_skip(prompt_tokens: int, window: int) -> range:
    """The prompt tokens a draft with a prefill ``window`` skips: all but the first
    :data:`SINK_TOKENS` and the last ``window - SINK_TOKENS`` (``window`` 0: none)."""
    if window <= 0 or prompt_tokens <= window:
        return range(0)
    assert window > SINK_TOKENS, window
    return range(SINK_TOKENS, prompt_tokens - (window - SINK_TOKENS))
