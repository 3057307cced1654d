"""Fixed-shape decoding and verification over static per-slot KV caches: the forward a CUDA
graph can capture (issue 40, items 1 and 6; eager on the CPU, the same buffers and buckets).

A CUDA graph replays fixed kernels on fixed addresses: no tensor may move, no shape may
depend on the data, nothing may read a value back to the host. The packed forward
(:mod:`disco.engines.packed_forward`) breaks all three (per-session caches of their own
lengths, a row of ``sum(k_i)`` tokens, Python loops over sessions). Here:

* **Static caches** (:class:`StaticCaches`): the slots of the model's KV pool
  (:meth:`~disco.engines.kv_pool.KVPool.slot_runs`), one chunk seen per layer as one key and
  one value buffer ``[slots, kv_heads, capacity, head_dim]``; a session owns a *slot*, a fixed
  run of the pool whose length is a host integer (rolling back a rejected block is setting it).
  Prefills of slotted sessions run on the packed path over the same storage.
* **Buckets** (:class:`Bucket`): a step runs ``sessions`` rows of ``block`` query tokens each,
  both rounded up to :data:`SESSION_BUCKETS` / :data:`BLOCK_BUCKETS` (vLLM and SGLang pad a
  batch to the next captured size the same way). A bucket counts sessions, not slot numbers:
  row ``i`` of a step reads and writes the slot its ``slots`` input names (gathered on the
  device), so sessions in slots 0 and 15 run in the 2-row bucket. The rows past the batch's
  sessions are padding, each in a distinct slot outside the batch (the shortest first), and so
  are the tokens past a session's own block: their keys and values land past their slot's
  length (never read, overwritten by the next real write) and their logits are dropped.
* **One attention call per layer**: the packed forward's one call
  (:func:`~disco.engines.varlen_attention.one_call_attention`) over the step's
  :class:`~disco.engines.batch_layout.BatchLayout` (:func:`~disco.engines.batch_layout.slot_layout`:
  keys read by slot id) — a slot's queries ride in the head dimension, each attends its slot's keys
  up to its own position, over the whole capacity (masked keys add exact zeros) — built from the
  lengths tensor on the device, so the step reads nothing back. A step's rows are
  :class:`~disco.engines.batch_layout.SessionRows` whose caches are slots
  (:meth:`StaticCaches.session_rows`), as the packed forward's are sessions' runs.
* **The lean decoder's layers** (:mod:`disco.engines.lean_decoder`): the same projections,
  norms and rotary, over ``sessions x block`` rows.

Exactness is the packed forward's under the one-call plan: a query's bits depend on its own
row and its own keys only (the row plans of the linears; the attention's items and heads are
independent; key padding adds exact zeros), so a session gets the same logits in any bucket,
alone or with others, and a verified block gives decoding's logits (``tests/test_static_step.py``
compares with the packed forward bit for bit on a CPU). NOTE: on CUDA this path has not run yet;
the one-call plan there repeats the keys per query head (the memory-efficient kernel takes no
GQA with a mask), which over a whole capacity is ``block x group`` copies per layer: the GPU
session measures it and may choose queries in rows instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from disco.engines.batch_layout import BatchLayout, SessionRows, slot_layout
from disco.engines.decoder_shape import DecoderShape
from disco.engines.lean_decoder import LeanDecoder
from disco.engines.kv_pool import PAGE, KVPool, PoolCache
from disco.engines.varlen_attention import KEY_GRANULE, AttentionPlan, one_call_attention
from disco.errors import InvalidRequest

#: Batch sizes a step is padded to (CUDA graphs are captured per size).
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32)
#: Tokens per slot a step is padded to: 1 (decoding) up to the default lookahead cap's block of 21.
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 24)


@dataclass(frozen=True)
class Bucket:
    """The shape of one step: ``sessions`` rows (each in a slot of its own), ``block`` tokens each."""

    sessions: int
    block: int

    @property
    def rows(self) -> int:
        return self.sessions * self.block


def bucket_for(sessions: int, block: int) -> Bucket:
    """The smallest bucket holding ``sessions`` sessions (whatever their slots) and blocks of
    ``block`` tokens."""
    rows = next((size for size in SESSION_BUCKETS if size >= sessions), None)
    width = next((size for size in BLOCK_BUCKETS if size >= block), None)
    if rows is None or width is None:
        raise InvalidRequest(f"no bucket holds {sessions} sessions and blocks of {block} tokens "
                             f"(at most {SESSION_BUCKETS[-1]} and {BLOCK_BUCKETS[-1]})")
    return Bucket(rows, width)


class StaticCaches:
    """Every slot's keys and values: a chunk of the model's KV pool (module doc).

    Args:
        model: the model whose layers fill the caches (its pool, device and dtype).
        slots: sessions the caches hold at once (rounded up to a session bucket).
        capacity: positions per slot (rounded up to :data:`KEY_GRANULE` and the pool's page); a
            slot's length plus the step's block must fit.

    Attributes:
        keys, values: per layer ``[slots, kv_heads, capacity, head_dim]`` views of the chunk.
        runs: the slots' runs (run ``i`` in slot ``i``): each slot's length is its run's.
    """

    def __init__(self, model: torch.nn.Module, slots: int, capacity: int) -> None:
        decoder = DecoderShape.of(model)
        granule = max(KEY_GRANULE, PAGE)
        assert granule % KEY_GRANULE == 0 and granule % PAGE == 0, (KEY_GRANULE, PAGE)
        self.capacity = -(-capacity // granule) * granule
        slots = next((size for size in SESSION_BUCKETS if size >= slots), slots)  # every bucket up to it fits
        self.pool = KVPool.of(model)
        self.runs = self.pool.slot_runs(slots, self.capacity)
        chunk = self.runs[0].chunk
        shape = (decoder.kv_heads, slots, self.capacity, decoder.head_dim)
        self.keys = [keys.view(shape).transpose(0, 1) for keys in chunk.keys]
        self.values = [values.view(shape).transpose(0, 1) for values in chunk.values]
        self.nbytes = chunk.nbytes  # device bytes of all slots (what the KV budget must count)

    @property
    def slots(self) -> int:
        return len(self.runs)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Positions each slot's cache holds (its run's length: the one record; set it there)."""
        return tuple(run.length for run in self.runs)

    def cache(self, slot: int) -> PoolCache:
        """A session's cache in ``slot`` (the slot's run, as its length stands)."""
        return PoolCache(self.pool, self.runs[slot])

    def load(self, slot: int, cache: PoolCache, length: int) -> None:
        """Copy the first ``length`` positions of a (prefilled) packed-path cache into ``slot``."""
        if length > self.capacity:
            raise InvalidRequest(f"{length} positions do not fit a slot of {self.capacity}")
        run = self.runs[slot]
        for layer in range(len(self.keys)):
            run.keys[layer][:, :, :length] = cache.layers[layer].keys[:, :, :length]
            run.values[layer][:, :, :length] = cache.layers[layer].values[:, :, :length]
        run.length = length

    def session_rows(self, slot: int, tokens: Sequence[int]) -> SessionRows:
        """A step's rows for the session in ``slot``: ``tokens`` after the slot's positions, logits for each."""
        return SessionRows(self.cache(slot), self.runs[slot].length, tokens, len(tokens))


class StepInputs:
    """The static step's input buffers, allocated once at the largest bucket: a bucket's step reads
    views of their first entries (a CUDA graph captures those addresses), so every bucket shares
    them (one step runs at a time on a model).

    Attributes:
        tokens: ``[sessions * block]``: a bucket's ``[sessions, block]`` tokens are its first rows.
        slots: ``[sessions]``: each row's slot.
        lengths: ``[sessions]``: the positions its slot holds before the step.
    """

    def __init__(self, largest: "Bucket", device: torch.device) -> None:
        self.largest = largest
        self.tokens = torch.zeros(largest.rows, dtype=torch.long, device=device)
        self.slots = torch.arange(largest.sessions, dtype=torch.long, device=device)
        self.lengths = torch.zeros(largest.sessions, dtype=torch.long, device=device)

    def fits(self, bucket: "Bucket") -> bool:
        return bucket.sessions <= self.largest.sessions and bucket.rows <= self.largest.rows


class StaticStep:
    """The fixed-shape forward of one bucket over :class:`StaticCaches`: its inputs are views of
    :class:`StepInputs` (``tokens``, ``slots``, ``lengths``; default: buffers of its own),
    :meth:`compute` reads only those (what a CUDA graph captures), :meth:`forward` fills them and
    returns each session's logits.

    ``plan``: how the one attention call runs (:data:`~disco.engines.varlen_attention.ONE_CALL_CPU`
    on a CPU, :data:`~disco.engines.varlen_attention.ONE_CALL_CUDA` on CUDA); must be a one-call plan.
    """

    def __init__(self, lean: LeanDecoder, caches: StaticCaches, bucket: Bucket, plan: AttentionPlan,
                 inputs: StepInputs | None = None) -> None:
        if not plan.one_call:
            raise InvalidRequest("the static step attends in one call per layer: a one-call plan is needed")
        if bucket.sessions > caches.slots:
            raise InvalidRequest(f"a bucket of {bucket.sessions} sessions over {caches.slots} slots")
        self.lean, self.caches, self.bucket, self.plan = lean, caches, bucket, plan
        device = caches.keys[0].device
        inputs = inputs or StepInputs(bucket, device)
        if not inputs.fits(bucket):
            raise InvalidRequest(f"the bucket {bucket} does not fit inputs allocated for {inputs.largest}")
        self.tokens = inputs.tokens[: bucket.rows].view(bucket.sessions, bucket.block)  # [sessions, block]
        self.slots = inputs.slots[: bucket.sessions]  # [sessions]: each row's slot
        self.lengths = inputs.lengths[: bucket.sessions]  # [sessions]: its slot's length
        self._offsets = torch.arange(bucket.block, device=device)  # [block]

    @torch.inference_mode()
    def forward(self, rows: Sequence[SessionRows]) -> list[torch.Tensor]:
        """Feed each session's tokens (at most ``bucket.sessions`` sessions, each a slot's cache of its
        own, at most ``block`` tokens each); returns per row the logits of its last ``num_logits`` tokens
        ``[num_logits, vocab]`` (float32, a tensor of its own). The slots' lengths are not advanced:
        the caller commits what it keeps (``caches.runs[slot].length``)."""
        self.fill(rows)
        return self.read(self.compute(), rows)

    def fill(self, rows: Sequence[SessionRows]) -> None:
        """Check the rows and copy them, each row's slot and every row's slot length into the
        input buffers; the rows past ``rows`` are padding in other slots (module doc)."""
        block, lengths, sessions = self.bucket.block, self.caches.lengths, self.bucket.sessions
        slots = [row.cache.slot for row in rows]
        if None in slots:
            raise InvalidRequest("rows name a cache that is not this step's slot (a session off the static path)")
        if len(rows) > sessions or len(set(slots)) != len(rows):
            raise InvalidRequest(f"{len(rows)} sessions in slots {slots} do not fit the bucket {self.bucket} "
                                 f"(one row per slot)")
        tokens = [[0] * block for _ in range(sessions)]
        for index, (slot, row) in enumerate(zip(slots, rows)):
            if (not 0 <= slot < self.caches.slots or not 1 <= len(row.tokens) <= block
                    or not 1 <= row.num_logits <= len(row.tokens) or row.want_hidden):
                raise InvalidRequest(f"slot {slot} with {len(row.tokens)} tokens and {row.num_logits} logits"
                                     f"{' and hidden states' if row.want_hidden else ''} does not fit the bucket "
                                     f"{self.bucket}")
            if row.cache.run is not self.caches.runs[slot]:
                raise InvalidRequest(f"the rows of slot {slot} name a cache that is not this step's slot")
            if row.cache_len != lengths[slot]:
                raise InvalidRequest(f"slot {slot} holds {lengths[slot]} positions, not the {row.cache_len} "
                                     f"its rows say")
            tokens[index][: len(row.tokens)] = row.tokens
        used = set(slots)
        padding = sorted((slot for slot in range(self.caches.slots) if slot not in used),
                         key=lambda slot: (lengths[slot], slot))[: sessions - len(rows)]
        slots += padding
        needed = max(lengths[slot] for slot in slots) + block
        if needed > self.caches.capacity:
            raise InvalidRequest(f"a step of {block} tokens after {needed - block} positions passes the slots' "
                                 f"capacity of {self.caches.capacity}")
        self.tokens.copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.slots.copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.lengths.copy_(torch.tensor([lengths[slot] for slot in slots], dtype=torch.long), non_blocking=True)

    @staticmethod
    def read(logits: torch.Tensor,  # [sessions, block, vocab]: row i holds rows[i]
             rows: Sequence[SessionRows]) -> list[torch.Tensor]:
        """Each row's logits as a float32 tensor of its own: never a view of ``logits``, which a
        CUDA graph's next replay overwrites while the caller may still be reading."""
        return [logits[index, len(row.tokens) - row.num_logits: len(row.tokens)].to(torch.float32, copy=True)
                for index, row in enumerate(rows)]

    def compute(self) -> torch.Tensor:  # [sessions, block, vocab] in the head's dtype
        """The step from the input buffers alone (no host value read, fixed shapes)."""
        lean, plan = self.lean, self.plan
        layout = slot_layout(self.slots, self.lengths, self._offsets, self.caches.capacity, lean.kv_heads,
                             lean.heads // lean.kv_heads,
                             (plan.compute_dtype or self.caches.keys[0].dtype) if plan.memory_efficient else None)
        hidden = lean.forward(self.tokens.reshape(1, -1), layout.positions,
                              lambda module, query, key, value: self._attend(module, query, key, value, layout))
        logits = lean.model.get_output_embeddings()(hidden[0])  # [rows, vocab]
        return logits.view(self.bucket.sessions, self.bucket.block, -1)

    def _attend(self, module: torch.nn.Module, query: torch.Tensor,  # [1, heads, rows, dim]
                key: torch.Tensor, value: torch.Tensor,  # [1, kv_heads, rows, dim]
                layout: BatchLayout) -> torch.Tensor:  # [1, rows, heads, dim]
        """Store the step's keys and values at their positions in the rows' slots, then the one call,
        reading each row's slot by its id."""
        sessions, block, kv_heads, dim = self.bucket.sessions, self.bucket.block, self.lean.kv_heads, self.lean.head_dim
        layer = module.layer_idx
        slot_keys, slot_values = self.caches.keys[layer], self.caches.values[layer]
        slot_of_row = self.slots[:, None].expand(-1, block)  # [sessions, block]
        positions = layout.positions.view(sessions, block)
        # [1, kv_heads, rows, dim] -> [sessions, block, kv_heads, dim], written at [slot, :, position]
        slot_keys[slot_of_row, :, positions] = key[0].transpose(0, 1).reshape(sessions, block, kv_heads, dim)
        slot_values[slot_of_row, :, positions] = value[0].transpose(0, 1).reshape(sessions, block, kv_heads, dim)
        return one_call_attention(query, slot_keys, slot_values, layout, module.scaling, self.plan)
