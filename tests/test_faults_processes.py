"""Faults with real processes: the draft and target services run as `disco *-server`
processes (the tiny pair from its HF folders), the orchestrator in this process.

* a client process killed mid-stream: every session is freed in both services;
* a frozen backend (SIGSTOP): the call in flight fails within seconds (keepalive pings);
* the draft killed (SIGKILL) mid-stream: the request completes, token for token as target-only;
* the target killed: a request with a short deadline gives up within it, the request in
  flight waits for the target and completes, exact, once it is back on its port;
* both back on their ports: the next request works, exact, and uses the draft again.

NOTE: the replacements listen in this process (same models, same ports): what is under
test is the orchestrator finding a new server behind an address it saw die, and a
third `python -m disco_cli.main` start would add ~15 s of torch imports on a busy CI
machine for nothing more.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.config import ModelConfig, SamplingParams, SpeculationConfig
from disco.errors import Unavailable
from disco.models.loading import load_model
from orchestrator.client import DiscoClient, DiscoRpcError
from orchestrator.remote import CallScope, RemoteDrafter
from orchestrator.server import load_tokenizer
from protos.runtime.server import CHANNEL_OPTIONS, KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from protos.runtime.tls import secure_channel
from tests.helpers import PROMPTS, local_generator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 120.0
FAST_S = 5.0  # "fast": UNAVAILABLE well within any sensible deadline, never a hang
# static:1 makes one Draft and one Verify round trip per token: a long request on the tiny pair.
LONG = dict(policy="static:1", max_new_tokens=300, ignore_eos=True)


def spawn(role: str, folder, home, port: int = 0) -> subprocess.Popen:
    """A service process in a session of its own: a process SIGSTOPped below stays stopped until
    this test continues it (in this process's group a job-control SIGCONT could wake it: a
    suite run beside busy processes once saw the "frozen" draft answer, issue 46)."""
    env = {**os.environ, "DISCO_HOME": str(home), "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-m", "disco_cli.main", f"{role}-server", "--model", str(folder),
                             "--dtype", "float32", "--threads", "1", "--port", str(port), "--json"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def announced_address(process: subprocess.Popen) -> str:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(process.stdout.readline()), daemon=True).start()
    line = lines.get(timeout=STARTUP_TIMEOUT_S)
    assert line, f"the server exited with {process.wait()}"
    return json.loads(line)["address"]


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.fixture(scope="module")
def deployment(tiny_pair_dirs, tmp_path_factory, tokenizer):
    home = tmp_path_factory.mktemp("home")
    processes = {role: spawn(role, tiny_pair_dirs[role], home) for role in ("target", "draft")}  # in parallel
    try:
        addresses = {role: announced_address(process) for role, process in processes.items()}
        orch = orchestrator.server.serve(load_tokenizer(str(tiny_pair_dirs["target"]), home), addresses["draft"],
                                         addresses["target"])
        yield {"processes": processes, "addresses": addresses, "orchestrator": orch, "home": home,
               "dirs": tiny_pair_dirs}
        orch.stop(0)
    finally:
        for process in processes.values():
            stop(process)


@pytest.fixture(scope="module")
def reference(target_model, tokenizer):
    def generate(prompt: str, max_new_tokens: int) -> list[int]:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        return local_generator(target_model, None, tokenizer).generate(
            tokenizer(prompt)["input_ids"], params, SpeculationConfig("none")).token_ids
    return generate


def wait_idle(client: DiscoClient, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        active = client.info()["active_sessions"]
        if not any(active.values()) or time.monotonic() > deadline:
            return active
        time.sleep(0.05)


def test_a_client_that_dies_mid_stream_frees_every_session(deployment):
    code = ("import sys\nfrom orchestrator.client import DiscoClient\n"
            f"stream = DiscoClient({deployment['orchestrator'].address!r}, timeout=60).stream("
            f"{PROMPTS[0]!r}, policy='static:1', max_new_tokens=400, ignore_eos=True)\n"
            "for chunk in stream:\n    print('chunk', flush=True)\n")
    client_process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                                      stdout=subprocess.PIPE, text=True)
    try:
        assert client_process.stdout.readline() == "chunk\n"
        client_process.kill()  # no cancel, no goodbye: the connection just drops
    finally:
        stop(client_process)
    with DiscoClient(deployment["orchestrator"].address, timeout=30) as client:
        assert wait_idle(client) == {"orchestrator": 0, "draft": 0, "target": 0}


def test_a_frozen_backend_fails_calls_within_seconds(deployment):
    """A process that stops answering (SIGSTOP: its kernel still holds the connection) is
    detected by keepalive pings: the call in flight fails with UNAVAILABLE, no hang."""
    address, process = deployment["addresses"]["draft"], deployment["processes"]["draft"]
    channel = secure_channel(address, None, CHANNEL_OPTIONS)
    drafter = RemoteDrafter(channel, address, CallScope())  # no request deadline: only the 300 s cap
    drafter.start_session("frozen", [5, 6, 7], SamplingParams(max_new_tokens=8), "static:2")
    process.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + FAST_S
        while process_state(process.pid) != "T":  # the stop has reached every thread
            assert time.monotonic() < deadline, "the draft service did not stop"
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(Unavailable, match="ping timeout|unavailable"):
            list(drafter.draft("frozen", None, 2))
        assert time.monotonic() - started < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + FAST_S
        assert process_state(process.pid) == "T", "something else continued the stopped service"
    finally:
        process.send_signal(signal.SIGCONT)
    drafter.end_session("frozen")
    channel.close()


def test_killed_backends_then_back_on_their_ports(deployment, reference):
    processes, addresses = deployment["processes"], deployment["addresses"]
    client = DiscoClient(deployment["orchestrator"].address, timeout=60)

    # 1. The draft dies mid-stream: the request goes on target-only, exactly.
    stream = client.stream(PROMPTS[1], **LONG)
    chunks = iter(stream)
    tokens = list(next(chunks).token_ids)
    processes["draft"].kill()
    tokens += [token for chunk in chunks for token in chunk.token_ids]
    assert tokens == stream.result.token_ids == reference(PROMPTS[1], LONG["max_new_tokens"])
    assert stream.result.stats["draft_fallbacks"] == 1
    lookaheads = stream.result.stats["lookaheads"]
    assert lookaheads[0] == 1 and lookaheads[-1] == 0  # drafted before the kill, target-only after

    # 2. The target dies mid-stream: the request waits for it (there is no going on without
    # the target), a request with a short deadline gives up within it...
    stream = client.stream(PROMPTS[0], **LONG)
    chunks = iter(stream)
    tokens = list(next(chunks).token_ids)
    processes["target"].kill()
    processes["target"].wait()
    started = time.monotonic()
    with pytest.raises(DiscoRpcError) as raised, DiscoClient(deployment["orchestrator"].address, timeout=2) as hasty:
        hasty.generate(PROMPTS[0], policy="none", max_new_tokens=4)
    assert raised.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - started < 2 + FAST_S

    # 3. ... and both come back on the same ports: the request in flight completes, exactly
    # (its target session re-prefilled from the orchestrator's tokens), and the next one
    # works, exactly, with the draft.
    for process in processes.values():
        process.wait()
    servers = []
    try:
        for role, module in (("target", target_service.server), ("draft", draft_service.server)):
            model = load_model(ModelConfig(str(deployment["dirs"][role]), "float32"), role, deployment["home"])
            servers.append(module.serve(model, port=int(addresses[role].rpartition(":")[2])))
            assert servers[-1].address == addresses[role]
        tokens += [token for chunk in chunks for token in chunk.token_ids]
        assert tokens == stream.result.token_ids == reference(PROMPTS[0], LONG["max_new_tokens"])
        result = client.generate(PROMPTS[2], policy="static:3", max_new_tokens=24, ignore_eos=True)
        assert result.token_ids == reference(PROMPTS[2], 24)
        # The draft is used again once the orchestrator has seen it healthy (at once, or
        # after its replica's recovery check); meanwhile requests go on target-only.
        deadline = time.monotonic() + 15
        while result.stats["draft_fallbacks"] and time.monotonic() < deadline:
            time.sleep(0.2)
            result = client.generate(PROMPTS[2], policy="static:3", max_new_tokens=24, ignore_eos=True)
            assert result.token_ids == reference(PROMPTS[2], 24)
        assert result.stats["draft_fallbacks"] == 0 and result.stats["draft_tokens"] > 0
        assert wait_idle(client) == {"orchestrator": 0, "draft": 0, "target": 0}
    finally:
        client.close()
        for server in servers:
            server.stop(0)
