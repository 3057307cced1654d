"""Keeps the children of ``disco serve`` running (:class:`Supervisor`).

A service that exits is started again on the port it had, after a backoff that doubles
with each recent restart (:class:`RestartPolicy`), while the others keep serving: the
orchestrator goes on target-only while the draft is away and re-prefills its sessions on
a restarted target from its own token list (:mod:`orchestrator.failover`). Each exit is
logged with its code. A service that exits more than ``max_restarts`` times within
``window_s`` is crash-looping: :meth:`Supervisor.poll` raises, and ``disco serve`` stops,
saying which service and why.

NOTE: children are spawned by :meth:`Supervisor.poll`, i.e. on the thread that polls (the
main thread of ``disco serve``): a child gets SIGTERM when the thread that forked it exits
(Linux's parent-death signal, :func:`disco_cli.launcher._terminate_with_parent`), so a
short-lived restart thread would kill the child it started. Only the wait for the
restarted child to serve runs in a thread.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from disco.errors import DiscoError
from disco_cli.launcher import LocalServices

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a child that exited.

    Args:
        max_restarts: restarts allowed per ``window_s``; one more exit within the window stops ``disco serve``.
        window_s: the window, in seconds.
        initial_backoff_s: wait before the first restart of a window; doubled for each recent restart.
        max_backoff_s: the longest wait.
    """

    max_restarts: int = 5
    window_s: float = 600.0
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def backoff_s(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** recent_restarts)


class CrashLoop(DiscoError):
    """A service kept exiting past the restart cap."""


class Supervisor:
    """Restarts the children of ``services`` that exit (see the module docstring).

    Args:
        services: the running children.
        policy: backoff and cap.
        spawn: starts child ``name`` again, returning its process (default
            :meth:`LocalServices.respawn`: the same command, the same port).
        await_started: waits until a restarted child serves, raising if it does not
            (default :meth:`LocalServices.await_started`); runs in a thread.
        clock: monotonic seconds (injected by tests).
    """

    def __init__(self, services: LocalServices, policy: RestartPolicy = RestartPolicy(),
                 spawn: Callable[[str], subprocess.Popen] | None = None,
                 await_started: Callable[[str, subprocess.Popen], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.services = services
        self.policy = policy
        self._spawn = spawn or services.respawn
        self._await_started = await_started or services.await_started
        self._clock = clock
        self._exits: dict[str, list[float]] = {}  # recent exit times per service
        self._due: dict[str, float] = {}  # services waiting out their backoff: when to start them
        self._starting: dict[str, threading.Thread] = {}  # restarted, not serving yet
        self.restarted: dict[str, int] = {}  # successful restarts per service

    def poll(self) -> None:
        """Notice exits, start the children whose backoff is over (on this thread).

        Raises:
            CrashLoop: a child exited more than ``max_restarts`` times within ``window_s``.
        """
        now = self._clock()
        for name, process in list(self.services.processes.items()):
            if name in self._starting and self._starting[name].is_alive():
                continue
            self._starting.pop(name, None)
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    self._restart(name)
                continue
            code = process.poll()
            if code is None:
                continue
            recent = [t for t in self._exits.get(name, []) if now - t < self.policy.window_s]
            if len(recent) >= self.policy.max_restarts:
                raise CrashLoop(f"the {name} service keeps crashing: it exited {len(recent) + 1} times within "
                                f"{self.policy.window_s:.0f} s (last exit code {code}); stopping (see its log above)")
            self._exits[name] = [*recent, now]
            delay = self.policy.backoff_s(len(recent))
            self._due[name] = now + delay
            logger.warning("the %s service exited with code %s; restarting it in %.1f s (restart %d of at most %d "
                           "per %.0f s)", name, code, delay, len(recent) + 1, self.policy.max_restarts,
                           self.policy.window_s)

    def pending(self) -> set[str]:
        """Services waiting for their restart or restarted and not serving yet."""
        return set(self._due) | {name for name, thread in self._starting.items() if thread.is_alive()}

    def close(self) -> None:
        """Drop the restarts still waiting out their backoff (``disco serve`` is stopping)."""
        self._due.clear()

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the restarted children to serve (tests)."""
        for thread in list(self._starting.values()):
            thread.join(timeout_s)

    def _restart(self, name: str) -> None:
        try:
            process = self._spawn(name)
        except Exception as error:  # noqa: BLE001 - counted as an exit at the next poll (the old process is dead)
            logger.error("restarting the %s service failed: %s", name, error)
            return
        thread = threading.Thread(target=self._started, args=(name, process), name=f"restart-{name}", daemon=True)
        self._starting[name] = thread
        thread.start()

    def _started(self, name: str, process: subprocess.Popen) -> None:
        try:
            self._await_started(name, process)
            self.restarted[name] = self.restarted.get(name, 0) + 1
            logger.info("the %s service is back on %s", name, self.services.addresses.get(name, "its port"))
        except Exception as error:  # noqa: BLE001 - the next poll sees the child dead and counts it
            logger.error("the restarted %s service did not start: %s", name, error)
            if process.poll() is None:
                process.kill()  # e.g. it never announced its address: dead, so the next poll counts it
                process.wait()
