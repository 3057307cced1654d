"""The orchestrator's view of its backends' health (:class:`BackendWatch`).

Every second the watch asks each replica of the draft and of the target service for its
``grpc.health.v1`` status and publishes, per role:

* in the orchestrator's own health service, under the role's service name
  (``disco.v1.DraftService``, ``disco.v1.TargetService``): SERVING while at least one
  replica serves, NOT_SERVING while none does (the overall ``""`` status stays the
  orchestrator's own: it serves, target-only while the draft is away);
* in ``/metrics``: ``disco_backend_serving{role}`` (1/0) and
  ``disco_backend_restarts_total{role}``, the times a role came back after being seen
  down (a restarted process, a Ray actor reloaded).

HTTP ``/health`` reads the same through ``Info`` (docs/operations.md, "Faults").
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge

from orchestrator.routing import ReplicaSet, replica_serves
from protos.disco.v1 import draft_pb2, target_pb2

logger = logging.getLogger(__name__)

#: Seconds between two rounds of health checks.
WATCH_INTERVAL_S = 1.0
SERVICE_NAMES = {"draft": draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
                 "target": target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name}


class BackendWatch:
    """Publishes the draft's and the target's health (see the module docstring).

    Args:
        replicas: the replica sets by role (``"draft"``, ``"target"``).
        health_servicer: the orchestrator's health service.
        registry: where the metrics go (the orchestrator's registry).
        serves: whether a replica serves (default: its health check answers SERVING); injected by tests.
    """

    def __init__(self, replicas: dict[str, ReplicaSet], health_servicer: health.HealthServicer,
                 registry: CollectorRegistry, serves: Callable | None = None) -> None:
        self.replicas = replicas
        self.health = health_servicer
        self._serves = serves or replica_serves
        self.serving_gauge = Gauge("disco_backend_serving", "1 while at least one replica of the role answers its "
                                   "health check with SERVING, as the orchestrator sees it", ["role"],
                                   registry=registry)
        self.restarts = Counter("disco_backend_restarts", "Times a role came back after the orchestrator saw none "
                                "of its replicas serve (a restarted process or Ray actor)", ["role"],
                                registry=registry)
        for role in replicas:
            self.restarts.labels(role)  # exported as 0 from the start
        self.serving: dict[str, bool] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> dict[str, bool]:
        """One round: ask every replica, publish each role's status; returns it."""
        for role, replicas in self.replicas.items():
            serving = any(self._serves(channel) for channel in replicas.probe_channels())
            was = self.serving.get(role)
            if was is False and serving:
                self.restarts.labels(role).inc()
                logger.info("the %s service serves again", role)
            elif was and not serving:
                logger.warning("the %s service does not serve (%s)", role,
                               "requests go on target-only" if role == "draft" else "requests wait for it")
            self.serving[role] = serving
            self.serving_gauge.labels(role).set(int(serving))
            self.health.set(SERVICE_NAMES[role], health_pb2.HealthCheckResponse.SERVING if serving
                            else health_pb2.HealthCheckResponse.NOT_SERVING)
        return dict(self.serving)

    def start(self, interval_s: float = WATCH_INTERVAL_S) -> "BackendWatch":
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.check_once()
                except Exception:  # noqa: BLE001 - the watch must outlive any one bad round
                    logger.exception("backend health round failed")
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=run, name="backend-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
