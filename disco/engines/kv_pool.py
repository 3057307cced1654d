"""One KV pool per model: every session's keys and values, and the one record of its length.

Storage comes in *chunks*: per layer one key and one value tensor ``[kv_heads, positions,
head_dim]`` in the model's activation dtype on its device, zeroed once (padding keys a masked
attention reads must be finite). A chunk's positions are pages of :data:`PAGE`. A session owns
a :class:`KVRun`: a contiguous run of pages of one chunk, seen per layer as the views
``[1, kv_heads, capacity, head_dim]`` every attention of the engines reads in place, and its
``length`` (positions the cache holds): the only record of it. Writing a forward's keys and
rolling back a rejected block (setting the length) copy nothing.

* **Why runs and not vLLM's scattered blocks**: an attention over scattered blocks must gather
  them first on a CPU (no paged kernel): 0.9 / 2.1 / 4.4 ms a forward at 256 / 1k / 4k positions
  alone, 7 / 17 / 186 ms for 8 sessions, against a ~38 ms target forward
  (``docs/analysis/paged_gather.py``). A run is one strided view: no gather.
* **Chunks come and go**: a run is placed first-fit in a chunk with room, else in a new chunk of
  :data:`CHUNK_POSITIONS` positions (or of the run's size, if larger); a chunk whose last run is
  released is dropped (one empty chunk is kept for the next session), so memory follows the
  sessions. A run that must grow (a write past its capacity) extends in place where the pages
  after it are free, else moves (its positions copied) to a run of twice its capacity.
* **The static path's slots** (:class:`~disco.engines.static_step.StaticCaches`): one chunk of
  ``slots x capacity`` positions, each slot a fixed run (never grown, never released), so the
  chunk is also ``[slots, kv_heads, capacity, head_dim]`` per layer: the static step reads and
  writes a slot by its number; a session on the packed path and on the static path reads the
  same storage.
* :class:`PoolCache` is the transformers ``Cache`` over one run: the HF decoder forward, its mask
  builders and the prefills write through it. Models the packed forward cannot run keep
  transformers' ``DynamicCache`` (:mod:`disco.engines.kv`).

Runs are released when their cache is garbage collected (``weakref.finalize``), which may happen
inside any allocation, also while this pool's lock is held: the finalizer never waits for the lock
(:class:`~disco.engines.deferred_release.DeferredRelease`).
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from disco.engines.decoder_shape import DecoderShape
from disco.engines.deferred_release import DeferredRelease
from disco.engines.engine_state import engine_state
from disco.errors import ResourceExhausted, first_line

#: Positions per page: runs are whole pages.
PAGE = 64
#: Positions of a chunk (a run larger than that gets a chunk of its own size).
CHUNK_POSITIONS = 4096


class KVPoolExhausted(ResourceExhausted):
    """The device could not hold another chunk of the pool (the allocator ran out of memory)."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error: ``torch.OutOfMemoryError``
    (``torch.cuda.OutOfMemoryError`` is one), the CPU allocator's ``RuntimeError``, or the pool's
    :class:`KVPoolExhausted` (a chunk that could not be allocated)."""
    if isinstance(error, (torch.OutOfMemoryError, KVPoolExhausted)):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in message or "DefaultCPUAllocator: can't allocate" in message)


def _pages(positions: int) -> int:
    return max(1, -(-positions // PAGE))


class _Chunk:
    """Per layer ``[kv_heads, pages * PAGE, head_dim]`` keys and values; which pages runs hold."""

    def __init__(self, shape: DecoderShape, pages: int, dtype: torch.dtype, device: torch.device,
                 slots: bool = False) -> None:
        size = (shape.kv_heads, pages * PAGE, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.taken = bytearray(pages)  # 1: the page is in a run
        self.runs = 0
        self.slots = slots  # the static path's chunk: its runs are fixed

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (*self.keys, *self.values))

    def first_fit(self, pages: int) -> int | None:
        """The first page of ``pages`` free pages in a row, or ``None``."""
        free = 0
        for index, taken in enumerate(self.taken):
            free = 0 if taken else free + 1
            if free == pages:
                return index - pages + 1
        return None

    def mark(self, first: int, pages: int, taken: int) -> None:
        self.taken[first: first + pages] = bytes([taken]) * pages


class KVRun:
    """A session's positions in the pool (module doc).

    Attributes:
        length: positions its cache holds (the only record of a session's length).
        keys, values: per layer ``[1, kv_heads, capacity, head_dim]`` views of its chunk.
        slot: its slot number on the static path, else ``None`` (a fixed run: never grown or released).
    """

    def __init__(self, chunk: _Chunk, first: int, pages: int, slot: int | None = None) -> None:
        self.length = 0
        self.slot = slot
        self._place(chunk, first, pages)

    def _place(self, chunk: _Chunk, first: int, pages: int) -> None:
        start, end = first * PAGE, (first + pages) * PAGE
        self.chunk, self.first, self.pages = chunk, first, pages
        self.keys = [keys[:, start:end].unsqueeze(0) for keys in chunk.keys]  # each [1, kv_heads, capacity, head_dim]
        self.values = [values[:, start:end].unsqueeze(0) for values in chunk.values]

    @property
    def capacity(self) -> int:
        return self.pages * PAGE

    @property
    def dtype(self) -> torch.dtype:
        return self.chunk.keys[0].dtype


class KVPool:
    """The KV storage of one model (module doc): :meth:`of` gives the model's pool."""

    def __init__(self, shape: DecoderShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        # runs whose caches were freed, not yet back (finalizers never wait for the lock)
        self._released: DeferredRelease[KVRun] = DeferredRelease(
            self._lock, lambda run: self._free(run.chunk, run.first, run.pages))

    def __deepcopy__(self, memo: dict) -> "KVPool":
        """A copied model's pool starts empty (its state is settled anew: engine_state)."""
        return KVPool(self.shape, self.dtype, self.device)

    @staticmethod
    def of(model: torch.nn.Module) -> "KVPool":
        """``model``'s pool (kept in its engine state), made anew where the model's activation
        dtype or device changed since (a cast model's old runs keep their own chunks)."""
        state = engine_state(model)
        weight = model.get_input_embeddings().weight
        pool = state.kv_pool
        if pool is None or pool.dtype != weight.dtype or pool.device != weight.device:
            pool = state.kv_pool = KVPool(DecoderShape.of(model), weight.dtype, weight.device)
        return pool

    @property
    def nbytes(self) -> int:
        """Bytes of every chunk (what the pool holds of the device's memory)."""
        with self._lock:
            return sum(chunk.nbytes for chunk in self._chunks)

    def allocate(self, positions: int) -> KVRun:
        """A run of at least ``positions`` positions (length 0)."""
        pages = _pages(positions)
        with self._lock:
            self._released.drain()
            chunk, first = self._find(pages)
            chunk.mark(first, pages, 1)
            chunk.runs += 1
            return KVRun(chunk, first, pages)

    def grow(self, run: KVRun, positions: int) -> None:
        """Make ``run`` hold at least ``positions`` positions, its first ``length`` kept: in place
        where the pages after it are free, else moved to a run of twice its capacity."""
        if positions <= run.capacity:
            return
        if run.slot is not None:
            raise ResourceExhausted(f"a session's cache slot holds {run.capacity} positions; {positions} were asked for")
        pages = _pages(max(positions, 2 * run.capacity))
        with self._lock:
            self._released.drain()
            chunk, end = run.chunk, run.first + run.pages
            extra = pages - run.pages
            if end + extra <= len(chunk.taken) and not any(chunk.taken[end: end + extra]):
                chunk.mark(end, extra, 1)
                run._place(chunk, run.first, pages)
                return
            new_chunk, first = self._find(pages)
            new_chunk.mark(first, pages, 1)
            new_chunk.runs += 1
            old_keys, old_values, old = run.keys, run.values, (run.chunk, run.first, run.pages)
            run._place(new_chunk, first, pages)
            for layer, (keys, values) in enumerate(zip(old_keys, old_values)):
                run.keys[layer][:, :, : run.length] = keys[:, :, : run.length]
                run.values[layer][:, :, : run.length] = values[:, :, : run.length]
            self._free(*old)

    def slot_runs(self, slots: int, capacity: int) -> list[KVRun]:
        """The static path's slots: one chunk of ``slots`` fixed runs of ``capacity`` positions
        (a multiple of :data:`PAGE`), run ``i`` in slot ``i``."""
        assert capacity % PAGE == 0, capacity
        pages = capacity // PAGE
        with self._lock:
            chunk = _Chunk(self.shape, slots * pages, self.dtype, self.device, slots=True)
            self._chunks.append(chunk)
            chunk.mark(0, slots * pages, 1)
            return [KVRun(chunk, slot * pages, pages, slot=slot) for slot in range(slots)]

    def release(self, run: KVRun) -> None:
        """``run`` is free again (its cache was freed). Safe in a finalizer (module doc)."""
        self._released.put(run)

    def _free(self, chunk: _Chunk, first: int, pages: int) -> None:
        """Give pages back (lock held); drop a chunk whose last run left, keeping one empty chunk."""
        chunk.mark(first, pages, 0)
        chunk.runs -= 1
        if chunk.runs == 0 and any(other is not chunk and other.runs == 0 and not other.slots
                                   for other in self._chunks):
            self._chunks.remove(chunk)

    def _find(self, pages: int) -> tuple[_Chunk, int]:
        """Room for ``pages`` pages (lock held): the first chunk that has it, else a new chunk."""
        for chunk in self._chunks:
            if not chunk.slots:
                first = chunk.first_fit(pages)
                if first is not None:
                    return chunk, first
        pages = max(pages, CHUNK_POSITIONS // PAGE)
        try:
            chunk = _Chunk(self.shape, pages, self.dtype, self.device)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            per_position = 2 * self.shape.layers * self.shape.kv_heads * self.shape.head_dim * self.dtype.itemsize
            raise KVPoolExhausted(f"out of memory for the KV pool: a chunk of {pages * PAGE} positions "
                                  f"({pages * PAGE * per_position} bytes) on {self.device}: {first_line(error)}") from error
        self._chunks.append(chunk)
        return chunk, 0


class PoolLayer(DynamicLayer):
    """One layer of a :class:`PoolCache`: ``keys``/``values`` are its run's views up to the run's length."""

    is_croppable = True

    def __init__(self, run: KVRun, layer: int) -> None:
        self.run, self.layer = run, layer
        super().__init__()
        self.is_initialized, self.device = True, run.chunk.keys[0].device

    @property
    def keys(self) -> torch.Tensor:  # [1, kv_heads, length, head_dim]
        return self.run.keys[self.layer][:, :, : self.run.length]

    @keys.setter
    def keys(self, states: None) -> None:  # transformers' base class initializes it to None
        if states is not None:
            raise TypeError("a pool cache layer's keys live in its run")

    @property
    def values(self) -> torch.Tensor:  # [1, kv_heads, length, head_dim]
        return self.run.values[self.layer][:, :, : self.run.length]

    @values.setter
    def values(self, states: None) -> None:
        if states is not None:
            raise TypeError("a pool cache layer's values live in its run")

    @property
    def capacity(self) -> int:
        return self.run.capacity

    def get_seq_length(self) -> int:
        return self.run.length

    def crop(self, tokens_to_remove: int) -> None:
        raise TypeError("crop a pool cache as a whole (PoolCache.crop): its layers share one length")

    def reset(self) -> None:
        raise TypeError("reset a pool cache as a whole: its layers share one length")


class PoolCache(Cache):
    """A session's transformers ``Cache`` over one :class:`KVRun` of ``pool`` (module doc).

    A forward's ``update`` of layer ``i`` writes the new keys and values at the run's length and
    returns the views up to past them; the last layer's ``update`` moves the length (every layer
    then holds the new positions). A forward that fails midway leaves the length as it was."""

    def __init__(self, pool: KVPool, run: KVRun) -> None:
        super().__init__(layers=[PoolLayer(run, layer) for layer in range(pool.shape.layers)])
        self.pool, self.run = pool, run
        if run.slot is None:
            weakref.finalize(self, pool.release, run)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int = PAGE) -> "PoolCache":
        """A cache of ``model`` holding ``capacity`` positions before it grows (the session's prompt
        plus its token budget keeps it in place)."""
        pool = KVPool.of(model)
        return cls(pool, pool.allocate(capacity))

    @property
    def capacity(self) -> int:
        return self.run.capacity

    @property
    def slot(self) -> int | None:
        """The static path's slot this cache is in, else ``None``."""
        return self.run.slot

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,  # [1, kv_heads, new, head_dim]
               layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        run = self.run
        start = run.length
        end = start + key_states.shape[-2]
        if key_states.dtype != run.dtype:
            raise TypeError(f"keys in {key_states.dtype} for a cache in {run.dtype}")
        if end > run.capacity:
            self.pool.grow(run, end)  # at the first layer: every layer holds `start` positions
        keys, values = run.keys[layer_idx], run.values[layer_idx]
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        if layer_idx == len(self.layers) - 1:
            run.length = end
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.run.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers 5.x: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.run.length = max(0, self.run.length + tokens_to_remove)

    def set_length(self, length: int) -> None:
        """The positions the cache holds (a rollback, or a forward that wrote them outside ``update``)."""
        if not 0 <= length <= self.run.capacity:
            raise ValueError(f"a length of {length} in a run of {self.run.capacity} positions")
        self.run.length = length

    def fork(self, length: int) -> "PoolCache":
        """A new cache holding a copy of this one's first ``length`` positions."""
        fork = PoolCache(self.pool, self.pool.allocate(max(length + 1, self.run.length)))
        for layer in range(len(self.layers)):
            fork.run.keys[layer][:, :, :length] = self.run.keys[layer][:, :, :length]
            fork.run.values[layer][:, :, :length] = self.run.values[layer][:, :, :length]
        fork.run.length = length
        return fork
