"""Cross-session batching: the forwards of concurrent sessions run as one padded batch.

Each session keeps its own :class:`~disco.kv.CachedSequence`. When several sessions ask
for a forward at the same time (concurrent verifications in the target service,
concurrent drafting steps in the draft service), :class:`ForwardBatcher` runs them as
one forward pass: the session caches are left-padded to a common length, the pending
tokens right-padded, an attention mask hides the padding and explicit position ids keep
each session's RoPE positions; afterwards each session gets back exactly its own cache
entries. A lone request takes the unbatched path, so a single stream computes exactly
what it computes without the batcher.

NOTE: the padded caches are copied in and out of the batch (tens of MB per step for the
default pair at long contexts) — simple and exact; a paged KV cache would avoid the copy.
In float32 a padded batch rounds like an unbatched forward to ~1e-5; the tests check
every session's greedy tokens equal its run alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from disco.kv import CachedSequence


@dataclass
class _Request:
    sequence: CachedSequence
    num_logits: int
    want_hidden: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[torch.Tensor, torch.Tensor | None] | None = None
    error: BaseException | None = None


class ForwardBatcher:
    """Coalesces concurrent :meth:`CachedSequence.forward` calls on one model.

    Leader/follower: the first caller to find no batch running becomes the leader and
    runs batches until the queue is empty; the others wait for their result. No thread
    of its own, so nothing to start or stop.
    """

    def __init__(self, model: torch.nn.Module, max_batch: int = 16) -> None:
        self.model = model
        self.max_batch = max(1, max_batch)
        self.model_lock = threading.Lock()  # one forward on the model at a time (prefill too)
        self._queue_lock = threading.Lock()
        self._pending: list[_Request] = []
        self._leading = False
        self.batch_sizes: list[int] = []  # observability: size of every batch run (bounded)

    def forward(self, sequence: CachedSequence, num_logits: int,
                want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as :meth:`CachedSequence.forward` (logits ``[num_logits, vocab]``)."""
        request = _Request(sequence, num_logits, want_hidden)
        with self._queue_lock:
            self._pending.append(request)
            lead = not self._leading
            self._leading = self._leading or lead
        if lead:
            self._lead()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _lead(self) -> None:
        while True:
            with self._queue_lock:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
                if not batch:
                    self._leading = False
                    return
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        try:
            with self.model_lock:
                if len(batch) == 1 or any(r.sequence.cache_len == 0 for r in batch):
                    for request in batch:  # NOTE: empty caches (1-token prompts) are rare: run alone
                        request.result = request.sequence.forward(request.num_logits, request.want_hidden)
                else:
                    for request, result in zip(batch, _padded_forward(self.model, batch)):
                        request.result = result
            self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
        except BaseException as error:  # noqa: BLE001 - handed to every waiting caller
            for request in batch:
                request.error = error
        finally:
            for request in batch:
                request.done.set()


@torch.inference_mode()
def _padded_forward(model: torch.nn.Module, batch: list[_Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    sequences = [r.sequence for r in batch]
    device = sequences[0].device
    cache_lens = [s.cache_len for s in sequences]
    pending = [s.tokens[s.cache_len:] for s in sequences]
    max_cache, max_new = max(cache_lens), max(len(p) for p in pending)
    size = len(batch)

    # 1. Left-pad every session's cache to max_cache.
    batched_cache = DynamicCache(config=model.config)
    for layer_index in range(len(sequences[0].cache.layers)):
        keys, values = [], []
        for sequence in sequences:
            layer = sequence.cache.layers[layer_index]
            pad = max_cache - sequence.cache_len
            keys.append(torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(layer.values, (0, 0, pad, 0)))
        batched_cache.update(torch.cat(keys), torch.cat(values), layer_index)

    # 2. Right-pad the pending tokens; mask both paddings; per-session positions.
    input_ids = torch.zeros(size, max_new, dtype=torch.long, device=device)
    attention_mask = torch.zeros(size, max_cache + max_new, dtype=torch.long, device=device)
    position_ids = torch.zeros(size, max_new, dtype=torch.long, device=device)
    for row, (cache_len, tokens) in enumerate(zip(cache_lens, pending)):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, device=device)
        attention_mask[row, max_cache - cache_len: max_cache + len(tokens)] = 1
        position_ids[row] = torch.arange(cache_len, cache_len + max_new, device=device)

    # 3. One forward of the decoder; the LM head only on the positions asked for.
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 cache=batched_cache, use_cache=True).last_hidden_state  # [B, max_new, hidden]
    head = model.get_output_embeddings()
    results = []
    for row, (request, tokens) in enumerate(zip(batch, pending)):
        rows = hidden[row, len(tokens) - request.num_logits: len(tokens)]  # [num_logits, hidden]
        logits = head(rows).float()
        results.append((logits, rows.float() if request.want_hidden else None))

    # 4. Give every session back exactly its own cache entries.
    for row, (sequence, cache_len, tokens) in enumerate(zip(sequences, cache_lens, pending)):
        own = DynamicCache(config=model.config)
        for layer_index, layer in enumerate(batched_cache.layers):
            keep = torch.cat([torch.arange(max_cache - cache_len, max_cache),
                              torch.arange(max_cache, max_cache + len(tokens))]).to(device)
            own.update(layer.keys[row: row + 1].index_select(2, keep),
                       layer.values[row: row + 1].index_select(2, keep), layer_index)
        sequence.cache = own
        sequence.cache_len = len(sequence.tokens)
    return results
