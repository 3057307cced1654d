"""Starting the raylets of a test cluster (``ray.cluster_utils.Cluster``) on a loaded machine.

Beside two busy processes a node's start failed in 2 of ~6 full suites (issue 46: the head once,
a worker node once): Ray gave up with "The current node timed out during startup", the GCS had
seen no node register and the session's logs held no log of that raylet (the raylet opens its
own log files: it died before, e.g. on a pre-selected port taken meanwhile), while the same
start passed in every other run. A start
that fails leaves its processes behind (Ray keeps no handle to them when its ``Node`` raises),
so :func:`start_with_retries` kills the processes the failed start spawned, reports what the
session's logs say, and tries again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

#: Starts of one node before the failure is the test's.
START_ATTEMPTS = 3
#: Lines of each interesting log shown when a start fails.
LOG_TAIL_LINES = 5


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, by parent pid (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(parent, []).append(int(entry.name))
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``: its children first found, then theirs."""
    parents = children_by_parent()
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


def newest_session_logs(temp_dir: Path) -> Path | None:
    sessions = sorted(temp_dir.glob("session_2*"), key=lambda path: path.stat().st_mtime)
    return sessions[-1] / "logs" if sessions else None


def startup_report(logs: Path | None) -> str:
    """The session's log files (name: bytes) and the last lines of the raylet's and the
    GCS's, so that a failed start says how far it got."""
    if logs is None or not logs.is_dir():
        return "no session logs"
    files = sorted(path for path in logs.iterdir() if path.is_file())
    lines = [f"logs in {logs}: " + ", ".join(f"{path.name}: {path.stat().st_size}" for path in files)]
    for path in files:
        if path.name.startswith(("raylet", "gcs_server")) and path.stat().st_size:
            tail = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            lines.append(f"{path.name}: " + " | ".join(tail))
    return "\n".join(lines)


def start_with_retries(start: Callable[[], T], what: str, temp_dir: Path,
                       attempts: int = START_ATTEMPTS) -> T:
    """``start()`` (which spawns a node's processes as children of this process); when it
    raises, kill what it spawned (the new children and everything below them; the workers
    of nodes already running stay), print the session's logs and try again, up to
    ``attempts`` times in all."""
    for attempt in range(1, attempts + 1):
        before = set(children_by_parent().get(os.getpid(), []))
        try:
            return start()
        except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception on a start time-out
            new = [pid for pid in children_by_parent().get(os.getpid(), []) if pid not in before]
            spawned = [*new, *(below for pid in new for below in descendants(pid))]
            report = startup_report(newest_session_logs(temp_dir))
            for pid in spawned:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            message = f"{what}: start {attempt} of {attempts} failed ({error}); killed {len(spawned)} process(es)"
            print(f"{message}\n{report}", flush=True)
            if attempt == attempts:
                raise RuntimeError(f"{message}\n{report}") from error
    raise AssertionError("unreachable")
