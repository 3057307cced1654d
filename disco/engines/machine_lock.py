"""One measurement at a time per machine: the file lock engine costs are measured under, and
services hold while they load a model (:mod:`disco.engines.engine_costs`)."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def machine_lock(home: Path) -> Iterator[None]:
    """One measurement at a time per machine (a second process waits, then reads the cache).

    NOTE: the lock is machine-wide, not per model: two models measured at once on a
    small CPU would slow each other down and cache the slowed numbers. A service holds it
    while it loads its model too (quantizing is CPU-heavy), so a measurement never runs
    next to another service's model load. Not reentrant within one process.
    """
    locks = home / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        handle = (locks / "engine_costs.lock").open("w")
    except OSError:  # read-only home: measure without the lock
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
