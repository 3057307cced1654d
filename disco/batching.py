"""Cross-session batching: the forwards of concurrent sessions run as one padded batch.

Each session keeps its own :class:`~disco.kv.CachedSequence`. When several sessions ask
for a forward at the same time (concurrent verifications in the target service,
concurrent drafting steps in the draft service), :class:`ForwardBatcher` runs them as
one forward pass: the session caches are left-padded to a common length, the pending
tokens right-padded, an attention mask hides the padding and explicit position ids keep
each session's RoPE positions; afterwards each session gets back exactly its own cache
entries. A lone request takes the unbatched path, so a single stream computes exactly
what it computes without the batcher. Prefills go through the same batcher (a prefill
feeds all prompt tokens but the last and asks for no logits), so sessions that start
together are prefilled together; the LM head runs once over every row asked for.

Batching window: the sessions of a batch come back for their next step at slightly
different times (each has a network round trip and some bookkeeping in between).
Without waiting, the first one back would run alone and the rest as a second batch —
two forwards per step instead of one. So the leader waits, at most ``max_wait_s`` and
at most ``wait_fraction`` of the last forward's duration, for as many requests as there
were live sessions in the last *round* (the sessions served between two forwards of the
same session). A lone stream never waits (its round has one session); a session that
ended drops out of the round as soon as its sequence is freed.

NOTE: the padded caches are copied in and out of the batch (tens of MB per step for the
default pair at long contexts) — simple and exact; a paged KV cache would avoid the copy.
In float32 a padded batch rounds like an unbatched forward to ~1e-5; the tests check
every session's greedy tokens equal its run alone.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from disco.kv import CachedSequence


@dataclass
class _Request:
    sequence: CachedSequence
    num_logits: int  # 0: a prefill (feed all tokens but the last, no logits)
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

    def __init__(self, model: torch.nn.Module, max_batch: int = 16, max_wait_s: float = 0.02,
                 wait_fraction: float = 0.05) -> None:
        self.model = model
        self.max_batch = max(1, max_batch)
        self.max_wait_s = max_wait_s
        self.wait_fraction = wait_fraction
        self.model_lock = threading.Lock()  # one forward on the model at a time
        self._queue = threading.Condition(threading.Lock())
        self._pending: list[_Request] = []
        self._leading = False
        # Sequences served in the current and in the last complete round (weak: an ended
        # session's sequence is freed and leaves them); their count is the batch to wait for.
        self._round: weakref.WeakSet[CachedSequence] = weakref.WeakSet()
        self._last_round: weakref.WeakSet[CachedSequence] = weakref.WeakSet()
        self._last_forward_s = 0.0
        self.batch_sizes: list[int] = []  # observability: size of every batch run (bounded)

    def prefill(self, sequence: CachedSequence) -> None:
        """:meth:`CachedSequence.prefill`, batched with concurrent prefills and forwards."""
        if len(sequence.tokens) - 1 > sequence.cache_len:
            self.forward(sequence, 0)

    def forward(self, sequence: CachedSequence, num_logits: int,
                want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as :meth:`CachedSequence.forward` (logits ``[num_logits, vocab]``);
        ``num_logits=0`` prefills instead (see :meth:`prefill`) and returns empty logits."""
        request = _Request(sequence, num_logits, want_hidden)
        with self._queue:
            self._pending.append(request)
            lead = not self._leading
            self._leading = self._leading or lead
            self._queue.notify_all()
        if lead:
            self._lead()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _lead(self) -> None:
        while True:
            with self._queue:
                self._await_peers()
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
                if not batch:
                    self._leading = False
                    return
            self._run(batch)

    def _await_peers(self) -> None:
        """Wait (queue lock held) for as many requests as the last batch had, bounded."""
        expected = min(len(self._last_round | self._round), self.max_batch)
        window_s = min(self.max_wait_s, self.wait_fraction * self._last_forward_s)
        if not self._pending or len(self._pending) >= expected or window_s <= 0:
            return
        deadline = time.monotonic() + window_s
        while len(self._pending) < expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._queue.wait(remaining)

    def _count_round(self, served: list[CachedSequence]) -> None:
        with self._queue:
            if any(sequence in self._round for sequence in served):  # one is back: the round is complete
                self._last_round, self._round = self._round, weakref.WeakSet(served)
            else:
                self._round.update(served)

    def _run(self, batch: list[_Request]) -> None:
        try:
            started = time.perf_counter()
            with self.model_lock:
                if len(batch) == 1:
                    _forward_alone(batch[0])
                else:
                    for request, result in zip(batch, _padded_forward(self.model, batch)):
                        request.result = result
            self._last_forward_s = time.perf_counter() - started
            self._count_round([request.sequence for request in batch])
            self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
        except BaseException as error:  # noqa: BLE001 - handed to every waiting caller
            for request in batch:
                request.error = error
        finally:
            for request in batch:
                request.done.set()


def _forward_alone(request: _Request) -> None:
    sequence = request.sequence
    if request.num_logits == 0:
        sequence.prefill()
        request.result = (torch.empty(0), None)
    else:
        request.result = sequence.forward(request.num_logits, request.want_hidden)


def _pending_tokens(request: _Request) -> list[int]:
    """What the forward feeds: every pending token, or all but the last for a prefill."""
    sequence = request.sequence
    end = len(sequence.tokens) - 1 if request.num_logits == 0 else len(sequence.tokens)
    return sequence.tokens[sequence.cache_len: end]


@torch.inference_mode()
def _padded_forward(model: torch.nn.Module, batch: list[_Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    sequences = [r.sequence for r in batch]
    device = sequences[0].device
    cache_lens = [s.cache_len for s in sequences]
    pending = [_pending_tokens(r) for r in batch]
    max_cache, max_new = max(cache_lens), max(len(p) for p in pending)
    size = len(batch)

    # 1. Left-pad every session's cache to max_cache (an empty cache is all padding).
    batched_cache = DynamicCache(config=model.config)
    if max_cache:
        filled = next(s for s in sequences if s.cache_len)
        for layer_index, template in enumerate(filled.cache.layers):
            keys, values = [], []
            for sequence in sequences:
                if sequence.cache_len:
                    layer_keys = sequence.cache.layers[layer_index].keys
                    layer_values = sequence.cache.layers[layer_index].values
                else:
                    layer_keys = layer_values = template.keys[:, :, :0]  # [1, kv_heads, 0, head_dim]
                pad = max_cache - sequence.cache_len
                keys.append(torch.nn.functional.pad(layer_keys, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(layer_values, (0, 0, pad, 0)))
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
    # One LM-head matmul for every row asked for: the head is the largest weight matrix,
    # reading it once per session would cost as much as a forward of a small model.
    wanted = [hidden[row, len(tokens) - request.num_logits: len(tokens)]  # [num_logits, hidden]
              for row, (request, tokens) in enumerate(zip(batch, pending))]
    results: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.empty(0), None)] * size  # prefills
    if any(request.num_logits for request in batch):
        all_logits = model.get_output_embeddings()(torch.cat(wanted)).float()  # [Σ num_logits, vocab]
        for row, (request, rows, logits) in enumerate(zip(batch, wanted, all_logits.split([len(w) for w in wanted]))):
            if request.num_logits:
                results[row] = (logits, rows.float() if request.want_hidden else None)

    # 4. Give every session back exactly its own cache entries: its padded cache ends at
    # max_cache and its new tokens follow, so they are one contiguous span of the batch.
    for row, (sequence, cache_len, tokens) in enumerate(zip(sequences, cache_lens, pending)):
        start, end = max_cache - cache_len, max_cache + len(tokens)
        own = DynamicCache(config=model.config)
        for layer_index, layer in enumerate(batched_cache.layers):
            own.update(layer.keys[row: row + 1, :, start:end].clone(),
                       layer.values[row: row + 1, :, start:end].clone(), layer_index)
        sequence.cache = own
        sequence.cache_len = cache_len + len(tokens)
    return results
