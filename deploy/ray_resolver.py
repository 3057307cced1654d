"""Finding the draft and target replicas through Ray: they are the named actors
``draft-<i>`` and ``target-<i>`` of one Ray namespace (see :mod:`deploy.ray_actors`).

Used by the orchestrator, whether it runs as a Ray actor (``disco up``) or as a plain
process connected to the cluster (``disco ray-orchestrator``, e.g. a Kubernetes
Deployment next to a KubeRay cluster).
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from deploy.ray_head import is_loopback_address, use_loopback
from disco.errors import Unavailable

logger = logging.getLogger(__name__)

ROLES = ("draft", "target")
ORCHESTRATOR_NAME = "orchestrator"
#: How long one registry lookup may take before the caller sees UNAVAILABLE.
LOOKUP_TIMEOUT_S = 30.0
_RETRY_PAUSE_S = 0.5


def replica_name(role: str, index: int) -> str:
    return f"{role}-{index}"


def actor_names(namespace: str) -> list[str]:
    """Names of the live named actors of ``namespace``, sorted."""
    return sorted(entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                  if entry["namespace"] == namespace)


def role_of(name: str) -> str | None:
    """``"draft"``, ``"target"``, ``"orchestrator"`` or ``None`` for an actor name."""
    if name == ORCHESTRATOR_NAME:
        return name
    prefix, _, index = name.rpartition("-")
    return prefix if prefix in ROLES and index.isdigit() else None


class RayResolver:
    """:class:`~orchestrator.routing.Resolver` over the named actors of a Ray namespace.

    Args:
        namespace: the Ray namespace ``disco up`` used.
        address: the cluster :meth:`connect` connects to (``"auto"``, ``ray://HOST:PORT``);
            ``None`` inside a Ray actor, which is connected already.
    """

    def __init__(self, namespace: str, address: str | None = None) -> None:
        self.namespace = namespace
        self.address = address
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Connect this process to Ray (call it from the main thread).

        Raises:
            Unavailable: the cluster cannot be reached.
        """
        with self._lock:
            if ray.is_initialized():
                return
            if is_loopback_address(self.address):
                use_loopback()  # a Ray runtime on this machine's 127.0.0.1 (deploy.ray_head)
            try:
                ray.init(address=self.address, namespace=self.namespace, log_to_driver=False)
            except Exception as error:  # noqa: BLE001 - ray.init raises many kinds; all mean "not reachable"
                raise Unavailable(f"cannot reach the Ray cluster at {self.address}: {error}") from None

    def _require_connection(self) -> None:
        if not ray.is_initialized():
            raise Unavailable(f"not connected to the Ray cluster at {self.address} yet")

    def replicas(self, role: str) -> dict[str, str]:
        self._require_connection()
        names = [name for name in actor_names(self.namespace) if role_of(name) == role]
        return {name: self.wait_address(role, name, LOOKUP_TIMEOUT_S) for name in names}

    def wait_address(self, role: str, name: str, timeout_s: float) -> str:
        """Ask the actor for its address; while Ray restarts it, calls fail or wait, so
        retry until it answers. Its ``__init__`` (model load, server start) has run by then."""
        self._require_connection()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"the {role} service {name!r} did not come back within {timeout_s:.0f} s")
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
                return ray.get(handle.address.remote(), timeout=remaining)
            except ValueError:
                raise Unavailable(f"the {role} service {name!r} no longer exists in Ray namespace "
                                  f"{self.namespace!r}") from None
            except (RayActorError, GetTimeoutError):
                # NOTE: a call in flight when the actor died fails even if Ray restarts it; the
                # next call waits for the new instance. An actor dead for good loses its name,
                # which the lookup above reports.
                time.sleep(_RETRY_PAUSE_S)
