"""Bounded, thread-safe session registry shared by both engines."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from disco.errors import InvalidRequest, ResourceExhausted, SessionNotFound

SessionT = TypeVar("SessionT")


@dataclass(frozen=True)
class SessionLimits:
    """Per-service limits (see the README's "Limits" section)."""

    max_sessions: int = 64
    idle_ttl_s: float = 600.0  # a session unused this long is freed


class SessionStore(Generic[SessionT]):
    def __init__(self, limits: SessionLimits, clock=time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._sessions: dict[str, tuple[SessionT, float]] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, session: SessionT) -> None:
        if not session_id:
            raise InvalidRequest("session id is empty")
        with self._lock:
            self._expire_locked()
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} already exists")
            self._check_capacity_locked()
            self._sessions[session_id] = (session, self._clock())

    def check_capacity(self) -> None:
        """Raise :class:`ResourceExhausted` now if :meth:`add` would (cheap pre-check
        before expensive work; :meth:`add` checks again)."""
        with self._lock:
            self._expire_locked()
            self._check_capacity_locked()

    def _check_capacity_locked(self) -> None:
        if len(self._sessions) >= self._limits.max_sessions:
            raise ResourceExhausted(f"too many active sessions ({self._limits.max_sessions}); retry later")

    def get(self, session_id: str) -> SessionT:
        with self._lock:
            self._expire_locked()
            entry = self._sessions.get(session_id)
            if entry is None:
                raise SessionNotFound(f"unknown or expired session {session_id!r}")
            self._sessions[session_id] = (entry[0], self._clock())
            return entry[0]

    def remove(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._sessions)

    def _expire_locked(self) -> None:
        deadline = self._clock() - self._limits.idle_ttl_s
        for session_id in [sid for sid, (_, used) in self._sessions.items() if used < deadline]:
            del self._sessions[session_id]
