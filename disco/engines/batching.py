"""Cross-session batching: the forwards of concurrent sessions run as one forward pass.

Each session keeps its own :class:`~disco.engines.kv.CachedSequence`. When several sessions ask
for a forward at the same time (concurrent verifications in the target service,
concurrent drafting steps in the draft service), :class:`ForwardBatcher` runs them as
one *packed* forward: the pending tokens of all sessions form one row, each with its own
position ids, and attention runs per session over the session's own cache
(:mod:`disco.engines.packed_forward`). Every session gets exactly the numbers its own forward
would give — in bf16 too, bit for bit — so batching never changes a token; a lone
request is a packed forward of one. Prefills go through the same batcher (a prefill feeds
all prompt tokens but the last and asks for no logits), so sessions that start together
are prefilled together; the LM head runs once over every row asked for.

Batching window: the sessions of a batch come back for their next step at slightly
different times (each has a network round trip and some bookkeeping in between).
Without waiting, the first one back would run alone and the rest as a second batch —
two forwards per step instead of one. So the leader waits, at most ``max_wait_s`` and
at most ``wait_fraction`` of the last forward's duration, for as many requests as there
were live sessions in the last *round* (the sessions served between two forwards of the
same session). A lone stream never waits (its round has one session); a session that
ended drops out of the round as soon as its sequence is freed.

Out of memory: a packed forward needs more memory than any of its sessions alone. When it
raises an out-of-memory error (:func:`is_out_of_memory`), every session's cache is rolled
back to where it was before the forward (layers the forward reached were extended in
place), cached device memory is freed, and each session is run alone; its result is then
exactly its solo forward. Only a session that runs out of memory alone gets the error, as
:class:`~disco.errors.ResourceExhausted`. Any other error fails the batch's sessions as
before, their caches rolled back too, so a caller may retry. The forward timer reads
:func:`disco.engines.device_clock.now` (synchronised on CUDA); the batching window's
deadline is a plain monotonic wait, no device time.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from disco.engines.device_clock import now
from disco.engines.kv import CachedSequence
from disco.engines.kv_pool import PoolCache, is_out_of_memory
from disco.engines.live_costs import LiveCosts
from disco.engines.packing_proof import verdict_for
from disco.engines.static_runner import StaticRunner
from disco.errors import ResourceExhausted, first_line

#: Sessions one packed forward holds at most (the engines' default; the load-time proof's size).
DEFAULT_MAX_BATCH = 16


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

    def __init__(self, model: torch.nn.Module, max_batch: int = DEFAULT_MAX_BATCH, max_wait_s: float = 0.02,
                 wait_fraction: float = 0.05, static: StaticRunner | None = None) -> None:
        """``static``: the model's static path; batches of steps of its slotted sessions run there."""
        self.model = model
        self.static = static
        # Packed only where the model supports it and this machine proves it exact; else one by one.
        self.verdict = verdict_for(model, max(1, max_batch))
        self.packed = self.verdict.packed
        if static is not None:  # the static step batches rows too: the same verdict gates it
            static.gate(self.verdict)
        self.max_batch = max(1, max_batch) if self.packed else 1
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
        self.live_costs = LiveCosts()  # seconds of the decoding/verification forwards run, by rows

    def describe(self) -> str:
        """How concurrent sessions' forwards run (``Info.batching``, ``/metrics``): the packing
        verdict and, where the engine has one, the static path's line (on and proven, or off and why)."""
        if self.static is None:
            return self.verdict.detail
        return f"{self.verdict.detail}; {self.static.describe()}"

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
            rows = sum(request.sequence.num_pending for request in batch)
            steps_only = all(request.num_logits > 0 for request in batch)  # no prefill in it
            device = batch[0].sequence.device
            started = now(device)
            with self.model_lock:
                outcomes, packed_ok = self._forward(batch)
            for request, outcome in zip(batch, outcomes):
                if isinstance(outcome, BaseException):
                    request.error = outcome
                else:
                    request.result = outcome
            self._last_forward_s = now(device) - started
            if steps_only and packed_ok:  # a forward that ran out of memory times nothing useful
                self.live_costs.observe(rows, self._last_forward_s)
            self._count_round([request.sequence for request in batch])
            self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
        except BaseException as error:  # noqa: BLE001 - handed to every waiting caller
            for request in batch:
                if request.result is None and request.error is None:
                    request.error = error
        finally:
            for request in batch:
                request.done.set()

    def _forward(self, batch: list[_Request]
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None] | BaseException], bool]:
        """The batch's forward (model lock held): per request its result or its error, and
        whether the forward ran as planned (no out-of-memory retry, no error)."""
        marks = [request.sequence.cache_len for request in batch]
        if self.static is not None:
            sequences = [request.sequence for request in batch]
            if self.static.can_run(sequences, [r.num_logits for r in batch], [r.want_hidden for r in batch]):
                try:
                    return self.static.run(sequences, [r.num_logits for r in batch]), True
                except BaseException:
                    for request, mark in zip(batch, marks):
                        roll_back(request.sequence, mark)
                    raise
            by_plan: dict[int, list[int]] = {}  # slotted sessions attend in the static path's plan: apart
            for index, request in enumerate(batch):
                by_plan.setdefault(id(request.sequence.plan), []).append(index)
            if len(by_plan) > 1:
                outcomes: list = [None] * len(batch)
                planned = True
                for indices in by_plan.values():
                    part, ok = self._forward([batch[i] for i in indices])
                    planned = planned and ok
                    for index, outcome in zip(indices, part):
                        outcomes[index] = outcome
                return outcomes, planned
        if not self.packed or len(batch) == 1:  # one by one: each request succeeds or fails alone
            outcomes = [self._solo(request, mark) for request, mark in zip(batch, marks)]
            return outcomes, not any(isinstance(outcome, BaseException) for outcome in outcomes)
        try:
            return CachedSequence.forward_batch([r.sequence for r in batch], [r.num_logits for r in batch],
                                                [r.want_hidden for r in batch]), True
        except BaseException as error:
            for request, mark in zip(batch, marks):
                roll_back(request.sequence, mark)
            if not is_out_of_memory(error):
                raise
        # NOTE: out of memory in the packed forward: each session alone, so only a session
        # that does not fit by itself fails (its solo forward is what a batch gives it anyway).
        free_cached_memory(batch[0].sequence.device)
        return [self._solo(request, mark) for request, mark in zip(batch, marks)], False

    @staticmethod
    def _solo(request: _Request, mark: int) -> tuple[torch.Tensor, torch.Tensor | None] | BaseException:
        try:
            return request.sequence.step(request.num_logits, request.want_hidden)
        except BaseException as error:  # noqa: BLE001 - this request's own error
            roll_back(request.sequence, mark)
            if is_out_of_memory(error):
                free_cached_memory(request.sequence.device)
                return ResourceExhausted(
                    f"out of memory in a forward of {request.sequence.num_pending} tokens over a cache of {mark} "
                    f"(this session alone): {first_line(error)}")
            return error


def free_cached_memory(device: torch.device) -> None:
    """Hand the CUDA caching allocator's free blocks back (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def roll_back(sequence: CachedSequence, cache_len: int) -> None:
    """Undo what a failed forward did to ``sequence``'s cache: back to ``cache_len``'s positions.
    A pool cache moves its length only when every layer was written (a forward that failed
    midway left it as it was) and is set back as a whole; a ``DynamicCache`` that failed at
    layer i has extended layers < i only, so each layer is cut back on its own.
    The tokens are kept: the pending ones are fed again by the next forward.
    """
    positions = sequence.kv_positions(cache_len)
    if isinstance(sequence.cache, PoolCache):
        sequence.cache.set_length(min(positions, sequence.cache.get_seq_length()))
        return
    for layer in getattr(sequence.cache, "layers", ()):
        extra = layer.get_seq_length() - positions if getattr(layer, "is_initialized", True) else 0
        if extra > 0:
            layer.crop(-extra)
