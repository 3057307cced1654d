"""Produce a server stream's messages on a worker thread, ahead of sending them.

A synchronous gRPC server sends one streamed message at a time and only asks the
handler for the next one once the previous send completed (a round through gRPC's
completion queue and a thread wake-up). Drafting inside that handler would therefore
pause after every draft token until it is on the wire. :func:`run_ahead` lets the
drafting loop run on its own thread and hands finished messages to the sending thread
through a queue: the next draft forward overlaps the send of the previous token, and
the per-token transport cost leaves the critical path (only the last token's send
remains on it).

The order of events, errors (re-raised on the sending thread, so the error interceptor
maps them as before) and cancellation (the producer stops after its current event and
closes the source, which releases the session) are those of iterating in place.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor
from contextlib import closing
from typing import Callable, Generator, Iterator, TypeVar

Event = TypeVar("Event")
Message = TypeVar("Message")

_ITEM, _ERROR, _DONE = "item", "error", "done"


def run_ahead(events: Generator[Event, None, None], convert: Callable[[Event], Message],
              executor: Executor) -> Iterator[Message]:
    """Yield ``convert(event)`` for every event of ``events``, produced on ``executor``.

    ``events`` is closed on the producing thread when it ends, fails or the consumer
    stops early; the consumer waits for that before returning, so a session the source
    held is released when this generator finishes.
    """
    handoff: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def produce() -> None:
        outcome: tuple[str, BaseException | None] = (_DONE, None)
        try:
            with closing(events):
                for event in events:
                    handoff.put((_ITEM, convert(event)))
                    if stop.is_set():
                        break
        except BaseException as error:  # noqa: BLE001 - re-raised on the consuming thread
            outcome = (_ERROR, error)
        handoff.put(outcome)

    producer = executor.submit(produce)
    try:
        while True:
            kind, value = handoff.get()
            if kind == _ITEM:
                yield value
            elif kind == _ERROR:
                raise value
            else:
                return
    finally:
        stop.set()
        producer.result()  # the source is closed (session released) before the call ends
