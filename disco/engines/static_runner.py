"""Sessions on the static path: the slots (issue 40 item 2; issue 49 item 3).

A :class:`StaticRunner` hands out the slots of one model's
:class:`~disco.engines.static_step.StaticCaches` (a chunk of the model's KV pool). A session that
takes a slot (:meth:`StaticRunner.acquire`) gets, as its :class:`~disco.engines.kv.CachedSequence`'s
cache, a :class:`~disco.engines.kv_pool.PoolCache` over *its slot's run*. So the packed forward (prefills, batches with a prefill in them) and the static step
write the same storage, and a session may take either path from one forward to the next: both
attend in the one-call plan, in which they give the same bits (``tests/test_static_step.py``). A
batch of decoding/verification steps of slotted sessions (:meth:`StaticRunner.run`) goes to the
steps' runner (:class:`~disco.engines.step_runner.StepRunner`: the smallest bucket holding them,
eager or a replayed CUDA graph, captured at service start after the model's row plans are settled),
and the runner advances the sessions' caches.

The batcher (:mod:`disco.engines.batching`) hands a batch to the runner when every request in
it is such a step (:meth:`StaticRunner.can_run`); anything else (a prefill, hidden states
asked for, a session without a slot) takes the packed forward as before. The static step
batches rows as a packed forward does, so it runs only where the packing verdict allows
batching (:meth:`StaticRunner.gate`, by the batcher), and only after its own start-up proof
through the steps that serve (graphs included) gave the packed path's bits
(:mod:`disco.engines.static_proof`); else no session gets a slot. It runs only
the model's current lean decoder: an eager runner rebuilds its steps over a new one, a graphed
runner turns itself off (its graphs replay the old one; capturing again would overwrite live
sessions' slots).

A slot comes back when its session's sequence is freed, by a ``weakref.finalize`` callback that
may run inside any allocation (a garbage collection), also while this runner's lock is held: it
never waits for the lock (:class:`~disco.engines.deferred_release.DeferredRelease`).
"""

from __future__ import annotations

import heapq
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Sequence

import torch

from disco.engines.batch_layout import SessionRows
from disco.engines.deferred_release import DeferredRelease
from disco.engines.kv_pool import PoolCache
from disco.engines.static_proof import prove_static
from disco.engines.static_step import BLOCK_BUCKETS, SESSION_BUCKETS, Bucket, StaticCaches
from disco.engines.step_runner import StepRunner
from disco.engines.varlen_attention import AttentionPlan

if TYPE_CHECKING:
    from disco.engines.kv import CachedSequence

logger = logging.getLogger(__name__)

#: Why a runner is off before the batcher gave it the packing verdict (:meth:`StaticRunner.gate`).
_UNGATED = "no packing verdict yet"


class StaticRunner:
    """Slots and bucketed static steps of one model (module doc).

    Args:
        lean: the model's lean decoder.
        slots: sessions on the static path at once (at most the largest session bucket).
        capacity: positions per slot; a session takes a slot only if its reservation plus the
            largest block fits.
        plan: the one-call attention plan (the packed forwards of slotted sessions must use it too).
    """

    def __init__(self, lean, slots: int, capacity: int, plan: AttentionPlan) -> None:
        self.lean, self.plan = lean, plan
        self.caches = StaticCaches(lean.model, min(slots, SESSION_BUCKETS[-1]), capacity)
        self.steps = StepRunner(lean, self.caches, plan)  # the buckets' steps, eager or graphed
        self._free_heap = list(range(self.caches.slots))
        self._owners: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        # slots whose sequences were freed, not yet back (finalizers never wait for the lock)
        self._released: DeferredRelease[tuple[int, weakref.ref]] = DeferredRelease(self._lock, self._release_queued)
        self.verdict = None  # the batcher's PackingVerdict (gate); no slot is handed out before it allows
        self.refused: str | None = _UNGATED  # why the path is off; None: on
        self.proof = None  # the start-up proof's StaticProof (gate)

    @property
    def graphed(self) -> bool:
        """Whether the steps replay captured CUDA graphs."""
        return self.steps.graphed

    @graphed.setter
    def graphed(self, value: bool) -> None:
        self.steps.graphed = value

    def describe(self) -> str:
        """One line for the log, ``Info.batching`` and ``/metrics``: how the path runs, whether it
        is on (and proven) or off and why, its slots."""
        how = "CUDA graphs" if self.graphed else "eager"
        if self.refused not in (None, _UNGATED):
            state = f"off: {self.refused}; "
        else:
            state = f"{self.proof.detail}; " if self.proof is not None else ""
        return (f"static path ({how}): {state}{self.caches.slots} slots of {self.caches.capacity} positions, "
                f"{self.caches.nbytes / 2**20:.0f} MiB of caches")

    def gate(self, verdict) -> None:
        """Take the engine's :class:`~disco.engines.packing_proof.PackingVerdict` (the batcher's):
        the static step batches rows (and pads them) as a packed forward does, so it runs only
        where that verdict allows batching; then it proves itself as it serves
        (:func:`~disco.engines.static_proof.prove_static`, through the graphs where captured) and
        stays off where that fails. Else no session takes a slot."""
        self.verdict = verdict
        if not verdict.packed:
            self.refused = f"batching is not proven exact here ({verdict.detail})"
            logger.warning("%s", self.describe())
            return
        self.refused = None  # the proof takes slots
        self.proof = prove_static(self)
        if not self.proof.batching_exact:
            self.refused = f"its start-up proof failed: {self.proof.detail}"
            logger.warning("%s", self.describe())
        else:
            logger.info("%s", self.describe())

    @property
    def _free(self) -> list[int]:
        """The free slots (a heap), with the slots of freed sequences taken back first."""
        with self._lock:
            self._released.drain()
            return self._free_heap

    def acquire(self, sequence: "CachedSequence", reserved_tokens: int) -> bool:
        """Give ``sequence`` a slot (its cache becomes the slot's, empty); ``False`` when the path
        is off, none is free or its reservation does not fit a slot (it stays on the packed path)."""
        if (self.refused is not None or reserved_tokens + BLOCK_BUCKETS[-1] > self.caches.capacity
                or sequence.cache_len or (self.graphed and not self._decoder_ready())):
            return False
        owner = weakref.ref(sequence)
        with self._lock:
            self._released.drain()
            if not self._free_heap:
                return False
            slot = heapq.heappop(self._free_heap)
            self._owners[slot] = owner
        sequence.cache = self.caches.cache(slot)  # its packed-path run goes back to the pool
        sequence.plan = self.plan
        weakref.finalize(sequence, self._freed, slot, owner)
        return True

    def _freed(self, slot: int, owner: weakref.ref) -> None:
        """The finalizer of a slotted sequence: may run inside a garbage collection anywhere, this
        runner's lock held or not (module doc), so it never waits for the lock."""
        self._released.put((slot, owner))

    def _release_queued(self, item: tuple[int, weakref.ref]) -> None:
        """Free a queued slot (lock held); a slot taken by another sequence since stays taken."""
        slot, owner = item
        if self._owners.get(slot) is owner:
            self._give_back(slot)

    def _give_back(self, slot: int) -> None:
        del self._owners[slot]
        self.caches.runs[slot].length = 0
        heapq.heappush(self._free_heap, slot)

    def release(self, slot: int) -> None:
        """The slot is free again (the session ended). Not for finalizers: it takes the lock."""
        with self._lock:
            self._released.drain()
            if slot in self._owners:
                self._give_back(slot)

    def _decoder_ready(self) -> bool:
        """Whether the steps run the model's current lean decoder (one whose modules, fused
        weights and row plans are the model's). An eager runner rebuilds its steps over a new one;
        a graphed runner turns itself off: its graphs replay the old decoder, and capturing again
        would write into live sessions' slots."""
        if self.lean.is_current():
            return True
        from disco.engines.packed_forward import lean_decoder_for  # noqa: PLC0415 - the engines' forward

        lean = lean_decoder_for(self.lean.model)
        if lean is None or self.graphed:
            self.refused = ("the model's lean decoder changed after its CUDA graphs were captured" if self.graphed
                            else "the model has no lean decoder any more")
            logger.warning("%s", self.describe())
            return False
        self.lean = lean
        self.steps.rebuilt(lean)
        return True

    def can_run(self, sequences: Sequence["CachedSequence"], num_logits: Sequence[int],
                want_hidden: Sequence[bool]) -> bool:
        """Whether this batch is steps the runner takes: the path on (:meth:`gate`) over the
        model's current lean decoder, slotted sessions, logits asked for (no prefill), no hidden
        states, blocks within the largest bucket."""
        return (self.refused is None
                and all(isinstance(sequence.cache, PoolCache) and sequence.cache.run.slot is not None
                        and count > 0 and not hidden and sequence.num_pending <= BLOCK_BUCKETS[-1]
                        and self._owners.get(sequence.cache.run.slot, lambda: None)() is sequence
                        for sequence, count, hidden in zip(sequences, num_logits, want_hidden))
                and self._decoder_ready())

    def run(self, sequences: Sequence["CachedSequence"], num_logits: Sequence[int]
            ) -> list[tuple[torch.Tensor, None]]:
        """One bucketed step over the sequences' pending tokens (a batch :meth:`can_run` took);
        returns per sequence its logits ``[num_logits, vocab]`` (float32, tensors of their own)
        and advances its cache, as the packed forward does."""
        with self._lock:
            self._released.drain()  # a freed sequence's slot back at length 0: padding rows may write past it
        rows = [SessionRows(sequence.cache, sequence.cache.run.length, sequence._fed(len(sequence.tokens)), count)
                for sequence, count in zip(sequences, num_logits)]
        logits = self.steps.run(rows)  # the smallest bucket by sessions, not slot numbers
        for row in rows:
            row.cache.run.length += len(row.tokens)  # the slot's length: the one record
        return [(slot_logits, None) for slot_logits in logits]

    def capture(self, buckets: Sequence[Bucket] | None = None) -> str:
        """Capture the CUDA graphs of ``buckets`` (default: every bucket the slots allow; largest
        first, into one pool, :meth:`~disco.engines.step_runner.StepRunner.capture`), before any
        session holds a slot and after the model's row plans are settled; returns the report's line."""
        if self._owners:
            raise RuntimeError("CUDA graphs are captured before any session holds a slot")
        if not self.lean.is_current():
            raise RuntimeError("the lean decoder is not the model's current one: capture after the row plans")
        return self.steps.capture(buckets).describe()


def static_runner_for(model: torch.nn.Module, slots: int, capacity: int, role: str) -> StaticRunner | None:
    """The static path of an engine (``slots`` > 0; its lean decoder needed), its CUDA graphs
    captured on a GPU; ``None`` where it is off or cannot run (the log says why). Off until the
    batcher's packing verdict allows it (:meth:`StaticRunner.gate`).

    The model's exactness is settled first (:func:`~disco.engines.packing_proof.exactness_for`
    may give its linears row plans, which makes a new lean decoder): the decoder and the graphs
    are built over the row plans that serve."""
    if slots <= 0:
        return None
    from disco.engines.packed_forward import lean_decoder_for  # noqa: PLC0415 - the engines' forward
    from disco.engines.packing_proof import exactness_for  # noqa: PLC0415
    from disco.engines.varlen_attention import ONE_CALL_CPU, ONE_CALL_CUDA  # noqa: PLC0415

    exactness_for(model)  # row plans first (cached on the model: the batcher's verdict reuses it)
    lean = lean_decoder_for(model)
    if lean is None:
        logger.warning("%s: no static path (the model has no lean decoder)", role)
        return None
    device = next(model.parameters()).device
    runner = StaticRunner(lean, slots, capacity, ONE_CALL_CPU if device.type == "cpu" else ONE_CALL_CUDA)
    if device.type == "cuda":
        logger.info("%s: %s", role, runner.capture())
    logger.info("%s: %s", role, runner.describe())
    return runner
