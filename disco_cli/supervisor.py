"""Keeps the children of ``disco serve`` running (:class:`Supervisor`).

A service that exits is started again on the port it had, after a backoff that doubles
with each recent restart (:class:`RestartPolicy`), while the others keep serving: the
orchestrator goes on target-only while the draft is away and re-prefills its sessions on
a restarted target from its own token list (:mod:`orchestrator.failover`). Each exit is
logged with its code. A service that exits more than ``max_restarts`` times within
``window_s`` is crash-looping: :meth:`Supervisor.poll` raises, and ``disco serve`` stops,
saying which service and why.
"""

from __future__ import annotations

import logging
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
        restart: starts child ``name`` again and waits until it serves (default
            :meth:`LocalServices.respawn`: the same command, the same port).
        clock: monotonic seconds (injected by tests).
        sleep: waits that many seconds, returning early when :meth:`close` is called
            (injected by tests).
    """

    def __init__(self, services: LocalServices, policy: RestartPolicy = RestartPolicy(),
                 restart: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.services = services
        self.policy = policy
        self._restart_child = restart or services.respawn
        self._clock = clock
        self._closed = threading.Event()
        self._sleep = sleep or self._closed.wait
        self._restarts: dict[str, list[float]] = {}
        self._restarting: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self.restarted: dict[str, int] = {}  # successful restarts per service

    def poll(self) -> None:
        """Schedule a restart for every child that exited (each in its own thread).

        Raises:
            CrashLoop: a child exited more than ``max_restarts`` times within ``window_s``.
        """
        for name, process in list(self.services.processes.items()):
            with self._lock:
                if name in self._restarting:
                    continue
                code = process.poll()
                if code is None:
                    continue
                now = self._clock()
                recent = [t for t in self._restarts.get(name, []) if now - t < self.policy.window_s]
                if len(recent) >= self.policy.max_restarts:
                    raise CrashLoop(f"the {name} service keeps crashing: it exited {len(recent) + 1} times within "
                                    f"{self.policy.window_s:.0f} s (last exit code {code}); stopping (see its log "
                                    "above)")
                self._restarts[name] = [*recent, now]
                delay = self.policy.backoff_s(len(recent))
                logger.warning("the %s service exited with code %s; restarting it in %.1f s (restart %d of at most "
                               "%d per %.0f s)", name, code, delay, len(recent) + 1, self.policy.max_restarts,
                               self.policy.window_s)
                thread = threading.Thread(target=self._restart, args=(name, delay), name=f"restart-{name}",
                                          daemon=True)
                self._restarting[name] = thread
            thread.start()

    def restarting(self) -> set[str]:
        """Services being restarted now."""
        with self._lock:
            return set(self._restarting)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the restarts in progress (tests)."""
        for thread in list(self._restarting.values()):
            thread.join(timeout_s)

    def close(self) -> None:
        """Cancel the restarts that are still waiting out their backoff."""
        self._closed.set()

    def _restart(self, name: str, delay_s: float) -> None:
        try:
            self._sleep(delay_s)
            if self._closed.is_set():
                return
            self._restart_child(name)
            self.restarted[name] = self.restarted.get(name, 0) + 1
            logger.info("the %s service is back on %s", name, self.services.addresses.get(name, "its port"))
        except Exception as error:  # noqa: BLE001 - the next poll sees the child dead and counts it
            logger.error("restarting the %s service failed: %s", name, error)
            process = self.services.processes.get(name)
            if process is not None and process.poll() is None:
                process.kill()  # e.g. it never announced its address: dead, so the next poll counts it
                process.wait()
        finally:
            with self._lock:
                self._restarting.pop(name, None)
