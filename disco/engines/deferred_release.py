"""Releases a finalizer hands in, applied under a lock it never waits for.

A ``weakref.finalize`` callback may run inside any allocation (a garbage collection), also on a
thread that already holds the lock guarding what it frees (the KV pool's pages, the static path's
slots): waiting for that lock there would deadlock. :meth:`DeferredRelease.put` only queues the
item and applies it at once where the lock is free; the owner calls :meth:`DeferredRelease.drain`
with the lock held before it reads what the items free.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, TypeVar

Item = TypeVar("Item")


class DeferredRelease(Generic[Item]):
    """Args:
        lock: the owner's lock (not reentrant).
        apply: frees one item; called with the lock held.
    """

    def __init__(self, lock: threading.Lock, apply: Callable[[Item], None]) -> None:
        self._lock, self._apply = lock, apply
        self._queued: deque[Item] = deque()  # a deque: appends and pops need no lock

    def __contains__(self, item: Item) -> bool:
        return item in self._queued

    def __len__(self) -> int:
        return len(self._queued)

    def put(self, item: Item) -> None:
        """Queue ``item`` (safe in a finalizer) and apply the queue at once if the lock is free."""
        self._queued.append(item)
        if self._lock.acquire(blocking=False):
            try:
                self.drain()
            finally:
                self._lock.release()

    def drain(self) -> None:
        """Apply every queued item (the lock held)."""
        while self._queued:
            self._apply(self._queued.popleft())
