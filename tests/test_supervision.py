"""``disco serve`` survives the loss of a service: the child is restarted on its port while
the others keep serving, requests in flight complete exactly, health says who is missing.

The restart policy and the backend watch are tested with injected clocks and health
answers; the end-to-end test kills real children of a real ``disco serve`` (tiny models).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from disco_cli.launcher import LocalServices
from disco_cli.supervisor import CrashLoop, RestartPolicy, Supervisor
from orchestrator.backend_health import SERVICE_NAMES, BackendWatch
from orchestrator.client import DiscoClient
from protos.runtime.metrics import sample_value
from tests.helpers import PROMPTS

REPO = Path(__file__).resolve().parent.parent
LONG = dict(policy="static:1", max_new_tokens=300, ignore_eos=True)


class FakeProcess:
    def __init__(self, code: int | None = None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def test_a_child_that_exits_is_restarted_after_a_doubling_backoff_until_the_cap():
    now = [0.0]
    services = LocalServices(processes={"draft": FakeProcess(-9), "target": FakeProcess()})
    spawned: list[tuple[str, float]] = []

    def spawn(name: str) -> FakeProcess:
        spawned.append((name, now[0]))
        services.processes[name] = FakeProcess()
        return services.processes[name]

    supervisor = Supervisor(services, RestartPolicy(max_restarts=3, window_s=100, initial_backoff_s=1,
                                                    max_backoff_s=3),
                            spawn=spawn, await_started=lambda name, process: None, clock=lambda: now[0])
    for exit_at, backoff in ((0, 1), (10, 2), (20, 3)):  # doubled, capped at 3
        now[0] = exit_at
        supervisor.poll()  # the exit is noticed: the restart is due after the backoff
        assert supervisor.pending() == {"draft"}
        before = len(spawned)
        now[0] = exit_at + backoff - 0.1
        supervisor.poll()
        assert len(spawned) == before  # not before the backoff is over
        now[0] = exit_at + backoff
        supervisor.poll()
        assert spawned[-1] == ("draft", exit_at + backoff)
        supervisor.wait(5)
        services.processes["draft"] = FakeProcess(1)  # crashes again at once
    assert [name for name, _ in spawned] == ["draft"] * 3
    assert services.processes["target"].poll() is None  # the other one untouched
    now[0] = 30
    with pytest.raises(CrashLoop, match="the draft service keeps crashing: it exited 4 times within 100 s"):
        supervisor.poll()
    now[0] = 130  # the window moved on: restarts are allowed again, backoff from the start
    supervisor.poll()
    now[0] = 131
    supervisor.poll()
    assert spawned[-1] == ("draft", 131)


def test_a_restart_that_never_serves_is_counted_like_an_exit():
    now = [0.0]
    services = LocalServices(processes={"target": FakeProcess(-9)})

    def never_serves(name: str, process: FakeProcess) -> None:
        process.returncode = 1
        raise RuntimeError("model file missing")

    supervisor = Supervisor(services, RestartPolicy(max_restarts=2, window_s=100, initial_backoff_s=1),
                            spawn=lambda name: services.processes.setdefault(name, FakeProcess()),
                            await_started=never_serves, clock=lambda: now[0])
    for _ in range(2):
        supervisor.poll()
        now[0] += 5
        supervisor.poll()
        supervisor.wait(5)
    with pytest.raises(CrashLoop, match="target"):
        supervisor.poll()


class FakeReplicas:
    def __init__(self, channels: list) -> None:
        self.channels = channels

    def probe_channels(self) -> list:
        return self.channels


def test_the_watch_says_not_serving_for_the_missing_role_and_counts_its_return():
    up = {"draft-0": True, "target-0": True}
    servicer, registry = health.HealthServicer(), CollectorRegistry()
    watch = BackendWatch({"draft": FakeReplicas(["draft-0"]), "target": FakeReplicas(["target-0"])}, servicer,
                         registry, serves=lambda channel: up[channel])

    def status(role: str) -> int:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAMES[role])
        return servicer.Check(request, None).status

    assert watch.check_once() == {"draft": True, "target": True}
    up["draft-0"] = False
    assert watch.check_once() == {"draft": False, "target": True}
    assert status("draft") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert status("target") == health_pb2.HealthCheckResponse.SERVING
    up["draft-0"] = True
    watch.check_once()
    assert status("draft") == health_pb2.HealthCheckResponse.SERVING
    from prometheus_client import generate_latest
    text = generate_latest(registry).decode()
    assert sample_value(text, "disco_backend_restarts_total", {"role": "draft"}) == 1
    assert sample_value(text, "disco_backend_restarts_total", {"role": "target"}) == 0
    assert sample_value(text, "disco_backend_serving", {"role": "draft"}) == 1


def child(serve_pid: int, role: str) -> psutil.Process:
    return next(process for process in psutil.Process(serve_pid).children(recursive=True)
                if f"{role}-server" in process.cmdline())


def role_status(channel: grpc.Channel, role: str) -> int:
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAMES[role])
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def restarts(metrics_address: str, role: str) -> float | None:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        return sample_value(response.read().decode(), "disco_backend_restarts_total", {"role": role})


def wait_for(condition, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_disco_serve_survives_a_killed_draft_and_a_killed_target(tiny_pair_dirs, tmp_path):
    command = [sys.executable, "-m", "disco_cli.main", "serve", "--target", str(tiny_pair_dirs["target"]),
               "--draft", str(tiny_pair_dirs["draft"]), "--dtype", "float32", "--port", "0", "--json",
               "--metrics-port", "0"]
    env = {**os.environ, "DISCO_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("DISCO_AUTH_TOKEN", None)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        announced = json.loads(process.stdout.readline())
        address, metrics = announced["orchestrator"], announced["metrics"]["orchestrator"]
        channel = grpc.insecure_channel(address)
        with DiscoClient(address, timeout=180) as client:
            reference = client.generate(PROMPTS[1], **{**LONG, "policy": "none"}).token_ids
            for role in ("draft", "target"):
                # 1. The child dies while a request streams: the request completes, token for token.
                stream = client.stream(PROMPTS[1], **LONG)
                chunks = iter(stream)
                tokens = list(next(chunks).token_ids)
                child(process.pid, role).kill()
                tokens += [token for chunk in chunks for token in chunk.token_ids]
                assert tokens == stream.result.token_ids == reference
                # 2. disco serve keeps running; health names the missing role until it is back.
                assert process.poll() is None
                wait_for(lambda: role_status(channel, role) == health_pb2.HealthCheckResponse.SERVING,
                         f"the {role} service to serve again")
                # The watch saw it missing, then back (NOT_SERVING in between: counted as a restart).
                wait_for(lambda: restarts(metrics, role) == 1, f"the {role} restart to be counted", 10)
                # 3. Requests draft again once the draft is back (at once, or after the replica's recovery check).
                wait_for(lambda: client.generate(PROMPTS[2], policy="static:3", max_new_tokens=8,
                                                 ignore_eos=True).stats["draft_fallbacks"] == 0,
                         "requests to draft again", 60)
            assert process.poll() is None
    finally:
        process.terminate()
        process.wait(30)
