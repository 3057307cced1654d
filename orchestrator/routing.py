"""Replicas of a backend role and the choice of one per session (sticky, least-loaded).

A :class:`ReplicaSet` holds the replicas of one role (``"draft"`` or ``"target"``): each
one's address, a channel, and how many of this orchestrator's sessions it holds. A
:class:`Resolver` says where the replicas are: :class:`StaticResolver` for fixed
addresses (``disco orchestrator --draft ... --target ...``), ``deploy.ray_resolver.RayResolver``
for services running as named Ray actors.

When a call to a replica fails (see :mod:`orchestrator.failover`), the replica is taken
out of rotation and the resolver is asked, in a background thread, where it is now: a
Ray actor that Ray restarted has a new address (the resolver waits for the restart), a
static one keeps its own. It is back in rotation once its health check answers SERVING.
Sessions move meanwhile to the least-loaded healthy replica, or wait for that recovery.
While no replica is healthy, every placement asks again about the down ones, so a
static replica whose process was restarted is picked up by the next request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disco.errors import Unavailable
from protos.runtime.server import CHANNEL_OPTIONS
from protos.runtime.tls import TlsFiles, secure_channel

logger = logging.getLogger(__name__)

#: How long a failed replica may take to come back (a restarted Ray actor reloads its model).
RECOVERY_TIMEOUT_S = 300.0
#: A replica is back when its health check answers SERVING within this time.
HEALTH_TIMEOUT_S = 2.0
#: A recovering replica's health is asked again after this long.
RECOVERY_POLL_S = 0.5


class Resolver(Protocol):
    """Where the replicas of each role are."""

    def replicas(self, role: str) -> dict[str, str]:
        """``{replica name: HOST:PORT}`` of every replica of ``role`` (possibly empty).

        Raises:
            Unavailable: the registry cannot be reached.
        """

    def wait_address(self, role: str, name: str, timeout_s: float) -> str:
        """The address of replica ``name`` once it serves again (after a failure).

        Raises:
            Unavailable: it is gone for good, or did not come back within ``timeout_s``.
        """


class StaticResolver:
    """Fixed addresses; a failed replica is retried at the same address (a restarted
    process that binds the same port is picked up, with its sessions re-prefilled)."""

    def __init__(self, addresses: dict[str, Sequence[str]]) -> None:
        self._addresses = {role: {f"{role}-{i}": address for i, address in enumerate(values)}
                           for role, values in addresses.items()}

    def replicas(self, role: str) -> dict[str, str]:
        return dict(self._addresses.get(role, {}))

    def wait_address(self, role: str, name: str, timeout_s: float) -> str:
        return self._addresses[role][name]


@dataclass(eq=False)
class Replica:
    """One backend replica as this orchestrator sees it."""

    name: str
    address: str
    channel: grpc.Channel
    generation: int = 0  # bumped when the replica comes back after a failure
    healthy: bool = True
    recovering: bool = False
    active: int = 0  # sessions of this orchestrator on it now
    sessions: int = 0  # sessions ever placed on it
    failures: int = 0
    extra: dict = field(default_factory=dict)


class ReplicaSet:
    """The replicas of one role; thread-safe.

    Args:
        role: ``"draft"`` or ``"target"``.
        resolver: where the replicas are. Discovery is lazy (the first request, or any
            request while none is known), so the orchestrator may start before its backends.
        recovery_timeout_s: how long a failed replica may take to come back.
    """

    #: TLS material of the channels to the replicas (``None``: plaintext); set before the first request.
    tls: TlsFiles | None = None
    #: Client interceptors on every call to a replica (none by default; a benchmark adds
    #: latency with one, the deployment could trace); set before the first request.
    interceptors: tuple[grpc.UnaryUnaryClientInterceptor, ...] = ()

    def __init__(self, role: str, resolver: Resolver, recovery_timeout_s: float = RECOVERY_TIMEOUT_S) -> None:
        self.role = role
        self.resolver = resolver
        self.recovery_timeout_s = recovery_timeout_s
        self._replicas: dict[str, Replica] = {}
        self._cond = threading.Condition()

    @classmethod
    def static(cls, role: str, addresses: str | Sequence[str]) -> "ReplicaSet":
        """Replicas at fixed addresses (a comma-separated string or a list)."""
        values = [a.strip() for a in addresses.split(",")] if isinstance(addresses, str) else list(addresses)
        return cls(role, StaticResolver({role: [a for a in values if a]}))

    def addresses(self) -> list[str]:
        """Known replica addresses; static ones are known without discovery."""
        with self._cond:
            if not self._replicas and isinstance(self.resolver, StaticResolver):
                self._discover_locked()
            return [replica.address for replica in self._replicas.values()]

    def peek(self) -> Replica:
        """A healthy replica, without placing a session on it (for ``Info``); waits at
        most a health check's time for one that is down to be back.

        Raises:
            Unavailable: none is known or healthy.
        """
        with self._cond:
            self._discover_locked()
            if not any(r.healthy for r in self._replicas.values()):
                self._probe_down_locked()  # one that came back is found within a health check
                deadline = time.monotonic() + HEALTH_TIMEOUT_S + 0.5
                while (not any(r.healthy for r in self._replicas.values())
                       and any(r.recovering for r in self._replicas.values()) and time.monotonic() < deadline):
                    self._cond.wait(0.1)
            healthy = [r for r in self._replicas.values() if r.healthy]
            if not healthy:
                raise Unavailable(self._none_message())
            return healthy[0]

    def acquire(self, deadline: float | None = None, wait: bool = True) -> tuple[Replica, int]:
        """Place a session on the least-loaded healthy replica (ties: fewest sessions so
        far, then name), waiting for a recovering one if none is healthy.

        Args:
            deadline: :func:`time.monotonic` time to give up at (``None``: the recovery timeout).
            wait: wait for a recovering replica when none is healthy (the target: there is
                no going on without one); ``False`` fails at once (the draft: the request
                goes on target-only meanwhile).

        Returns:
            The replica and its generation (pass both to :meth:`report_failure`).

        Raises:
            Unavailable: no replica is healthy, or none recovered before the deadline.
        """
        deadline = time.monotonic() + self.recovery_timeout_s if deadline is None else deadline
        with self._cond:
            self._discover_locked()
            if not any(r.healthy for r in self._replicas.values()):
                self._probe_down_locked()
            while True:
                healthy = [r for r in self._replicas.values() if r.healthy]
                if healthy:
                    replica = min(healthy, key=lambda r: (r.active, r.sessions, r.name))
                    replica.active += 1
                    replica.sessions += 1
                    return replica, replica.generation
                remaining = deadline - time.monotonic()
                if not wait or remaining <= 0 or not any(r.recovering for r in self._replicas.values()):
                    raise Unavailable(self._none_message())
                self._cond.wait(min(remaining, 1.0))

    def release(self, replica: Replica) -> None:
        """The session placed by :meth:`acquire` ended or moved away."""
        with self._cond:
            replica.active = max(0, replica.active - 1)

    def report_failure(self, replica: Replica, generation: int) -> None:
        """A call failed as if ``replica`` were down: take it out of rotation and find
        out, in the background, where it is now. Reports about an older generation of
        the replica (it already came back) are ignored."""
        with self._cond:
            if replica.generation != generation or not replica.healthy:
                return
            replica.healthy = False
            replica.failures += 1
            logger.warning("%s replica %s at %s failed; waiting for it to come back", self.role, replica.name,
                           replica.address)
            self._start_recovery_locked(replica)

    def _probe_down_locked(self) -> None:
        """No replica is healthy: find out again whether the down ones are back (a static
        replica whose process restarted, a Ray actor that was restarting last time)."""
        for replica in self._replicas.values():
            if not replica.healthy and not replica.recovering:
                self._start_recovery_locked(replica)

    def _start_recovery_locked(self, replica: Replica) -> None:
        replica.recovering = True
        threading.Thread(target=self._recover, args=(replica,), name=f"recover-{replica.name}", daemon=True).start()

    def probe_channels(self) -> list[grpc.Channel]:
        """The channel of every known replica (discovering them first; none while the
        registry cannot be reached), for health checks."""
        with self._cond:
            try:
                self._discover_locked()
            except Unavailable:
                return []
            return [replica.channel for replica in self._replicas.values()]

    def snapshot(self) -> list[dict]:
        """Per-replica routing state (for status output and tests)."""
        with self._cond:
            return [{"name": r.name, "address": r.address, "healthy": r.healthy, "active": r.active,
                     "sessions": r.sessions, "failures": r.failures, "generation": r.generation}
                    for r in sorted(self._replicas.values(), key=lambda r: r.name)]

    def close(self) -> None:
        with self._cond:
            for replica in self._replicas.values():
                replica.channel.close()

    def _recover(self, replica: Replica) -> None:
        """Ask the resolver where the replica is now, then check that it serves there."""
        channel = None
        deadline = time.monotonic() + self.recovery_timeout_s
        try:
            address = self.resolver.wait_address(self.role, replica.name, self.recovery_timeout_s)
            # NOTE: always a fresh channel: the old one may sit in reconnect backoff.
            channel = self._channel(address)
            # A restarted process (``disco serve`` restarts a child on its port) serves once its
            # model is loaded: ask until then, or until the recovery timeout.
            while True:
                try:
                    _check_serving(channel)
                    break
                except (grpc.RpcError, Unavailable):
                    if time.monotonic() + RECOVERY_POLL_S >= deadline:
                        raise
                    time.sleep(RECOVERY_POLL_S)
        except Exception as error:  # noqa: BLE001 - any failure leaves the replica out of rotation
            logger.warning("%s replica %s is not back: %s", self.role, replica.name, error)
            if channel is not None:
                channel.close()
            channel = None
        with self._cond:
            replica.recovering = False
            if channel is not None:
                # NOTE: the old channel is not closed here: other sessions may still have a
                # call in flight on it (a replica reported down by one session can be serving
                # the others); it closes when the last stub using it is dropped.
                replica.channel, replica.address = channel, address
                replica.generation += 1
                replica.healthy = True
                logger.info("%s replica %s is back at %s", self.role, replica.name, address)
            self._cond.notify_all()

    def _discover_locked(self) -> None:
        """Learn the replicas if none is known yet (new names are added, known ones kept)."""
        if self._replicas:
            return
        for name, address in sorted(self.resolver.replicas(self.role).items()):
            self._replicas[name] = Replica(name, address, self._channel(address))

    def _channel(self, address: str) -> grpc.Channel:
        channel = secure_channel(address, self.tls, CHANNEL_OPTIONS)
        return grpc.intercept_channel(channel, *self.interceptors) if self.interceptors else channel

    def _none_message(self) -> str:
        if not self._replicas:
            return f"no {self.role} service replica is registered"
        states = ", ".join(f"{r.name} at {r.address} ({'recovering' if r.recovering else 'down'})"
                           for r in self._replicas.values())
        return f"no {self.role} service replica is available: {states}"


def replica_serves(channel: grpc.Channel, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether the server behind ``channel`` answers its health check with SERVING."""
    try:
        _check_serving(channel, timeout_s)
        return True
    except (grpc.RpcError, Unavailable):
        return False


def _check_serving(channel: grpc.Channel, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Raise unless the server behind ``channel`` answers its health check with SERVING."""
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        raise Unavailable(f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
