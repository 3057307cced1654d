"""A local Ray head that outlives ``disco up``, and the record that lets ``disco down``
and ``disco status`` (other processes) find the deployment again.

NOTE: ``ray.init()`` without an address starts a Ray runtime that dies with the
process that started it, detached actors included, so ``disco up`` could not return.
Instead it runs ``ray start --head --block`` (Ray's public CLI) as a child in its own
session: bound to 127.0.0.1 (:func:`use_loopback`), on free ports, with a reaper that
takes Ray's processes down with it. ``disco down`` sends that one process SIGTERM (by
pid, recorded in the state file); it never runs ``ray stop``, which stops every Ray
runtime of the machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from disco.errors import DiscoError

HEAD_START_TIMEOUT_S = 180.0
STATE_DIR = "ray"
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
HEAD_READY_LINE = "Ray runtime started"
LOOPBACK = "127.0.0.1"
#: NOTE: Ray (checked on 2.60) maps a loopback address it is given (``--node-ip-address``,
#: ``ray.init(address=...)``, ``_node_ip_address``) to the machine's network address, except
#: where "Ray clusters" are off: the switch Ray keeps for single-machine runtimes on macOS and
#: Windows. With it off, a node's IP is 127.0.0.1 and every Ray server of the node binds it.
LOOPBACK_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
OBJECT_STORE_BYTES = 256 * 1024 * 1024  # control messages only: tokens travel over gRPC, not Ray


@dataclass
class DeploymentState:
    """What ``disco up`` recorded under ``<DISCO_HOME>/ray/<namespace>.json``."""

    namespace: str
    ray_address: str
    head_pid: int | None = None  # the `ray start --block` process, when disco up started it
    head_log: str | None = None
    ray_client_address: str | None = None  # ray://HOST:PORT of a head disco up started
    orchestrator: str | None = None


def state_path(home: Path, namespace: str) -> Path:
    return home / STATE_DIR / f"{namespace}.json"


def load_state(home: Path, namespace: str) -> DeploymentState | None:
    path = state_path(home, namespace)
    if not path.is_file():
        return None
    return DeploymentState(**json.loads(path.read_text(encoding="utf-8")))


def save_state(home: Path, state: DeploymentState) -> None:
    path = state_path(home, state.namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")


def remove_state(home: Path, namespace: str) -> None:
    state_path(home, namespace).unlink(missing_ok=True)


def use_token_auth(generate: bool) -> bool:
    """Make this process (and the Ray head it starts) use Ray's token authentication
    when a token exists (``~/.ray/auth_token``, ``$RAY_AUTH_TOKEN`` or
    ``$RAY_AUTH_TOKEN_PATH``); with ``generate``, create the token first (``ray
    get-auth-token --generate``). Returns whether token auth is on.

    NOTE: Ray reads ``RAY_AUTH_MODE`` when it is imported, and enables token auth by
    itself only for ``address="auto"``; connecting to an explicit address (what ``disco
    down`` and ``disco status`` do, to reach exactly the head ``disco up`` started) needs
    the variable set before ``import ray``. A mode the user set is left alone.
    """
    has_token = token_available()
    if not has_token and generate:  # NOTE: a Ray without token auth has no such command: no token then
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                       check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        has_token = token_available()
    if AUTH_MODE_VARIABLE in os.environ:
        return os.environ[AUTH_MODE_VARIABLE].lower() == "token" and has_token
    if not has_token or "ray" in sys.modules:
        return False  # no token, or too late to change this process's mode
    os.environ[AUTH_MODE_VARIABLE] = "token"
    return True


def token_available() -> bool:
    """Whether a Ray auth token exists (a head started now would use token auth)."""
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or token_file.is_file()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class LocalHead:
    address: str  # GCS HOST:PORT
    client_address: str  # ray://HOST:PORT (the Ray Client server)
    process: subprocess.Popen
    log_path: Path


def start_local_head(home: Path, num_cpus: int, namespace: str) -> LocalHead:
    """Start ``ray start --head --block`` on this node (see :class:`LocalHead`), on
    127.0.0.1 only (GCS, raylet, Ray Client server, agents; no dashboard). Workers inherit
    this environment (call :func:`use_token_auth` first), plus the folder holding this
    package on ``PYTHONPATH`` (so a source checkout works without installing).
    """
    use_loopback()  # this process connects to it over 127.0.0.1 too
    port, client_port = free_port(), free_port()
    log_path = home / STATE_DIR / f"{namespace}-head.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env[LOOPBACK_VARIABLE] = "0"
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--node-ip-address={LOOPBACK}", f"--port={port}", f"--ray-client-server-port={client_port}",
               # NOTE: free ports: another Ray may run here
               f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               f"--num-cpus={num_cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}",
               "--include-dashboard=false", "--disable-usage-stats"]
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    return LocalHead(f"{LOOPBACK}:{port}", f"ray://{LOOPBACK}:{client_port}", process, log_path)


def use_loopback() -> None:
    """Make this process (and the Ray processes it starts) put Ray nodes on 127.0.0.1 and
    connect to a cluster there by 127.0.0.1 (see :data:`LOOPBACK_VARIABLE`).

    Call it only for a Ray runtime on this machine (a local head, the tests' clusters):
    such a process cannot join a cluster on other machines afterwards.
    NOTE: Ray reads the switch when it is imported; a process that imported it already
    gets the same setting on Ray's constants module.
    """
    os.environ[LOOPBACK_VARIABLE] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def is_loopback_address(address: str | None) -> bool:
    """Whether a Ray address (``HOST:PORT``, ``ray://HOST:PORT``) names this machine's loopback."""
    if not address or address in ("auto", "local"):
        return False
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def connect(address: str, namespace: str, head: subprocess.Popen | None = None,
            timeout_s: float = HEAD_START_TIMEOUT_S, log_path: Path | None = None) -> None:
    """``ray.init`` to ``address`` in ``namespace``, retrying while a head we started boots.

    Raises:
        DiscoError: the cluster cannot be reached (or the head we started exited).
    """
    if is_loopback_address(address):
        use_loopback()  # else Ray would dial the machine's network address instead
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        if ray.get_runtime_context().namespace != namespace:
            raise DiscoError(f"this process is connected to Ray in namespace "
                             f"{ray.get_runtime_context().namespace!r}, not {namespace!r}")
        return
    deadline = time.monotonic() + timeout_s
    while head is not None and log_path is not None and head.poll() is None and time.monotonic() < deadline:
        if HEAD_READY_LINE in log_path.read_text(encoding="utf-8", errors="replace"):
            break  # connecting earlier works too, but Ray logs a warning per attempt
        time.sleep(0.5)
    while True:
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
            return
        except (ConnectionError, RuntimeError) as error:
            if head is None or time.monotonic() > deadline:
                raise DiscoError(f"cannot connect to the Ray cluster at {address}: {error}") from None
            if head.poll() is not None:
                tail = log_path.read_text(encoding="utf-8")[-2000:] if log_path else ""
                raise DiscoError(f"the local Ray head exited with code {head.returncode}:\n{tail}") from None
            time.sleep(1.0)


def stop_local_head(pid: int, timeout_s: float = 60.0) -> bool:
    """SIGTERM the ``ray start --block`` process ``pid`` (its reaper stops Ray's daemons
    and workers) and wait for it; returns whether it was running."""
    if not head_running(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    _reap(pid)
    return True


def head_running(pid: int) -> bool:
    """Whether the ``ray start --head`` process ``pid`` still runs."""
    return _alive(pid) and _is_ray_head(pid)


def _is_ray_head(pid: int) -> bool:
    """Whether ``pid`` is still a ``ray ... start --head`` process (pids get reused)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return _alive(pid)  # no /proc (not Linux): trust the recorded pid
    return b"start" in argv and b"--head" in argv and any(b"ray" in arg for arg in argv)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
