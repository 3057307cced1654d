"""Start the three services locally as child processes (``disco serve``, ``disco bench-transport``).

Each service runs in its own process, as Kubernetes or Ray would run it: the target and
draft servers start in parallel on free ports, then the orchestrator is pointed at them.
Every child announces its bound address as one JSON line on stdout (``--json``); its
logs go to the parent's stderr.

Only the orchestrator binds the requested host: the backends always listen on
127.0.0.1 and accept only the launch's own backend token (a fresh random one per launch,
handed to the three children through their environment, never a command line), so the
public token, or no token at all, is refused by them (docs/security.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from disco.config import ModelConfig, PairConfig
from disco.errors import DiscoError
from protos.runtime.auth import AUTH_TOKEN_ENV, BACKEND_TOKEN_ENV, new_token

#: Where the backends of a local launch listen: loopback only, whatever the orchestrator binds.
BACKEND_HOST = "127.0.0.1"
#: Preparing the default pair on first use downloads and converts ~1.6 GB.
STARTUP_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class ServiceOptions:
    """Security and operations flags passed on to the children (docs/operations.md).

    ``metrics_port``: the orchestrator's ``/metrics`` port; the draft gets the next port
    and the target the one after (0: each a free port; ``None``: no ``/metrics``). The
    public token reaches the orchestrator through its environment (``auth_token``) or as
    the path of a file of tokens (``auth_token_file``), never on its command line; the
    backend token reaches all three through their environment.
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    auth_token: str | None = None
    auth_token_file: str | None = None
    backend_token: str = field(default_factory=new_token)  # one per launch: only this launch's orchestrator calls its backends
    metrics_port: int | None = None
    max_prompt_tokens: int = 0
    log_format: str = "text"
    artifact_dirs: tuple[str, ...] = ()  # the draft's --artifact-dir folders (default: its own)
    max_kv_bytes: int = 0  # the draft's and the target's --max-kv-bytes (0: each derives its own)
    max_new_tokens_limit: int | None = None  # the orchestrator's --max-new-tokens-limit (None: its default)
    max_sessions: int | None = None  # the orchestrator's --max-sessions (None: its default)

    def args(self, role: str) -> list[str]:
        argv = [flag for flag, value in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                                         ("--tls-ca", self.tls_ca)) if value for flag in (flag, str(value))]
        if role == "orchestrator" and self.tls_server_name:
            argv += ["--tls-server-name", self.tls_server_name]
        if self.metrics_port is not None:
            offset = {"orchestrator": 0, "draft": 1, "target": 2}[role] if self.metrics_port else 0
            argv += ["--metrics-port", str(self.metrics_port + offset)]
        if self.auth_token_file and role == "orchestrator":
            argv += ["--auth-token-file", str(self.auth_token_file)]
        if role == "orchestrator" and self.max_new_tokens_limit is not None:
            argv += ["--max-new-tokens-limit", str(self.max_new_tokens_limit)]
        if role == "orchestrator" and self.max_sessions is not None:
            argv += ["--max-sessions", str(self.max_sessions)]
        if self.max_prompt_tokens and role == "orchestrator":
            argv += ["--max-prompt-tokens", str(self.max_prompt_tokens)]
        if self.max_kv_bytes and role in ("draft", "target"):
            argv += ["--max-kv-bytes", str(self.max_kv_bytes)]
        if role == "draft":
            argv += [arg for folder in self.artifact_dirs for arg in ("--artifact-dir", str(folder))]
        return argv + ["--log-format", self.log_format]

    def env(self, role: str) -> dict[str, str]:
        env = os.environ.copy()
        env.pop(AUTH_TOKEN_ENV, None)  # only the orchestrator checks the public token
        if role == "orchestrator" and self.auth_token:
            env[AUTH_TOKEN_ENV] = self.auth_token
        env[BACKEND_TOKEN_ENV] = self.backend_token  # backends accept it, the orchestrator presents it
        return env


@dataclass(frozen=True)
class ChildCommand:
    """How one child was started (what :meth:`LocalServices.respawn` runs again)."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cores: frozenset[int] | None = None
    program: tuple[str, ...] | None = None


@dataclass
class LocalServices:
    """The running children; ``addresses`` maps service name to ``HOST:PORT`` and
    ``metrics`` to its ``/metrics`` address (when served)."""

    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    commands: dict[str, ChildCommand] = field(default_factory=dict)

    def dead(self) -> str | None:
        """Name of a child that has exited, if any."""
        return next((name for name, process in self.processes.items() if process.poll() is not None), None)

    def start(self, name: str, command: ChildCommand) -> subprocess.Popen:
        """Spawn child ``name`` (remembering how, for :meth:`respawn`)."""
        self.commands[name] = command
        self.processes[name] = _spawn(list(command.argv), command.env, set(command.cores or ()) or None,
                                      list(command.program) if command.program else None)
        return self.processes[name]

    def respawn(self, name: str) -> subprocess.Popen:
        """Start child ``name`` again, on the port it had (so the others find it where it
        was); :meth:`await_started` waits for it to serve.

        NOTE: call it from a thread that lives as long as the child should: Linux delivers the
        child's parent-death signal (:func:`_terminate_with_parent`) when the *thread* that
        forked it exits."""
        port = self.addresses[name].rpartition(":")[2]
        argv = list(self.commands[name].argv)
        argv[argv.index("--port") + 1] = port
        return self.start(name, dataclasses.replace(self.commands[name], argv=tuple(argv)))

    def await_started(self, name: str, process: subprocess.Popen,
                      startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait for a (re)started child's announcement and record its address.

        Raises:
            DiscoError: it exited or did not announce its address in time.
        """
        _record(self, name, _await_announcement(name, process, startup_timeout_s))

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every child (graceful shutdown), then SIGKILL what is left after ``timeout_s``."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def launch(pair: PairConfig, host: str = "127.0.0.1", port: int = 0, threads: int | None = None,
           startup_timeout_s: float = STARTUP_TIMEOUT_S, options: ServiceOptions = ServiceOptions(),
           overlap: bool = False, pin_cores: bool = False, added_rtt_ms: float = 0.0) -> LocalServices:
    """Start target, draft and orchestrator; returns once all three listen.

    Args:
        pair: the models (``spec=None``: the default pair, prepared on first use).
        host: interface the orchestrator binds (the backends bind 127.0.0.1 whatever it is).
        port: the orchestrator's port (0: a free one); the backends always take free ports.
        threads: torch CPU threads of each model process (``None``: torch's default).
        startup_timeout_s: how long model loading may take.
        options: TLS, token, metrics and log flags of the children.
        overlap: the draft service pre-drafts each next block while the target verifies
            (``disco draft-server --overlap on``, :mod:`disco.engines.predraft`).
        pin_cores: run the target and the draft on disjoint halves of this process's CPUs
            (:func:`split_cores`; threads set to match): two devices on one machine. The
            orchestrator keeps every CPU.
        added_rtt_ms: the orchestrator delays every call to the backends by this much
            (benchmarks: it runs through :mod:`disco_cli.bench.latency`): services on different nodes.

    Raises:
        DiscoError: a child exited or did not announce its address in time (all are stopped).
    """
    services = LocalServices()
    cores = split_cores(sorted(os.sched_getaffinity(0))) if pin_cores else {}
    try:
        for role, config in (("target", pair.target), ("draft", pair.draft)):
            role_threads = len(cores[role]) if role in cores else threads
            threads_args = ["--threads", str(role_threads)] if role_threads else []
            overlap_args = ["--overlap", "on"] if role == "draft" and overlap else []
            services.start(role, ChildCommand(
                (f"{role}-server", *_model_args(config), *threads_args, *overlap_args, "--host", BACKEND_HOST,
                 "--port", "0", *options.args(role)), options.env(role), frozenset(cores.get(role, ())) or None))
        for role in ("target", "draft"):
            _record(services, role, _await_announcement(role, services.processes[role], startup_timeout_s))
        tokenizer_args = ["--model", pair.target.spec] if pair.target.spec else []
        delayed = ["-m", "disco_cli.bench.latency", "--added-rtt-ms", str(added_rtt_ms)] if added_rtt_ms else []
        services.start("orchestrator", ChildCommand(
            ("orchestrator", "--target", services.addresses["target"], "--draft", services.addresses["draft"],
             *tokenizer_args, "--host", host, "--port", str(port), *options.args("orchestrator")),
            options.env("orchestrator"), program=tuple(delayed) or None))
        _record(services, "orchestrator", _await_announcement("orchestrator", services.processes["orchestrator"],
                                                              startup_timeout_s))
    except BaseException:
        services.stop()
        raise
    return services


def _model_args(config: ModelConfig) -> list[str]:
    return [*(["--model", config.spec] if config.spec else []), "--dtype", config.dtype, "--device", config.device,
            *(["--vocab-subset", str(config.vocab_subset)] if config.vocab_subset else []),
            *(["--prefill-window", str(config.prefill_window)] if config.prefill_window else [])]


def split_cores(cores: list[int]) -> dict[str, set[int]]:
    """The target gets the first half of ``cores`` (the larger half), the draft the rest
    (both the one core when there is only one)."""
    half = max(1, (len(cores) + 1) // 2)
    return {"target": set(cores[:half]), "draft": set(cores[half:] or cores[:1])}


def _spawn(argv: list[str], env: dict[str, str] | None = None, cores: set[int] | None = None,
           program: list[str] | None = None) -> subprocess.Popen:
    """``python -m disco_cli.main ARGV --json`` (or ``python PROGRAM ARGV --json``) as a child."""
    # NOTE: children do not get the terminal's Ctrl-C (start_new_session): the parent
    # stops them with SIGTERM, and on Linux they get SIGTERM too if the parent dies.
    def before_exec() -> None:
        _terminate_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return subprocess.Popen([sys.executable, *(program or ["-m", "disco_cli.main"]), *argv, "--json"], stdout=subprocess.PIPE,
                            stderr=None, text=True, env=env if env is not None else os.environ.copy(),
                            start_new_session=True, preexec_fn=before_exec)


def _record(services: LocalServices, name: str, announcement: dict) -> None:
    services.addresses[name] = announcement["address"]
    if announcement.get("metrics"):
        services.metrics[name] = announcement["metrics"]


def _terminate_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent exits (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the parent's stop() is the only way
        pass


def _await_announcement(name: str, process: subprocess.Popen, timeout_s: float) -> dict:
    """Read the child's announcement line (``{"service": ..., "address": ..., "metrics": ...}``)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(process.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise DiscoError(f"the {name} service did not start within {timeout_s:.0f} s") from None
    if not line:
        raise DiscoError(f"the {name} service exited with code {process.wait()} during startup (see its log above)")
    return json.loads(line)
