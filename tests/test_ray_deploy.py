"""``disco up`` on a real local Ray runtime (CPU, the tiny pair from its HF folders):
generation through the orchestrator actor is token-identical to in-process; two target
replicas share concurrent sessions; the draft or a target actor killed mid-generation
is restarted by Ray while the request completes, exact; ``disco down`` leaves nothing.
The deployment runs as a secured one would: TLS everywhere, mutual TLS between the
orchestrator and its backends plus the deployment's backend token (fresh per ``up``), a
bearer token on the public API, ``/metrics`` served; the local Ray head and every service
on 127.0.0.1 only, and no credential in Ray's readable state, a command line or a log.

One deployment serves the whole module (a Ray head plus four actor processes take about
a minute to start on a busy 2-core machine); the tests run in file order and the last
one takes it down.
"""

import json
import os
import re
import signal
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest

from deploy.ray_head import use_token_auth  # noqa: E402 - imports no ray

use_token_auth(generate=True)  # before `import ray`: the local head uses Ray's token auth
ray = pytest.importorskip("ray")

from deploy import ray_launcher  # noqa: E402
from deploy.ray_launcher import UpConfig, down, status, up  # noqa: E402
from disco_cli.commands.ray import up_report  # noqa: E402
from disco_cli.main import main  # noqa: E402
from orchestrator.client import DiscoClient, DiscoRpcError  # noqa: E402
from protos.disco.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc  # noqa: E402
from protos.runtime.auth import auth_metadata  # noqa: E402
from protos.runtime.tls import TlsFiles, secure_channel  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import PROMPTS, target_only_tokens  # noqa: E402
from tests.pki import Authority  # noqa: E402

pytestmark = pytest.mark.ray

TOKEN = "ray-public-s3cret-0123456789"
SERVER_NAME = "localhost"  # the test certificates name localhost (and 127.0.0.1)
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
NEW_TOKENS = 32
LONG_TOKENS = 300  # static:1: one Draft and one Verify round trip per token, long enough to interrupt
MAX_TOKENS_LIMIT = 400  # `disco up --max-tokens-limit`: the gateway's and the orchestrator's
RESTART_TIMEOUT_S = 180.0
CLIENT_TIMEOUT_S = 180.0


@dataclass
class Deployment:
    info: dict
    home: Path
    namespace: str
    pids: dict
    ca: Path
    services: object  # the services' certificate (tests.pki.Issued): a client that passes mTLS
    backend_token: str  # the one `up` generated for this deployment
    names: dict = field(default_factory=dict)

    def actor(self, name: str):
        return ray.get_actor(name, namespace=self.namespace)

    def routing(self) -> dict:
        return ray.get(self.actor("orchestrator").routing.remote(), timeout=30)

    def client(self, **options) -> DiscoClient:
        return DiscoClient(self.info["orchestrator"], timeout=CLIENT_TIMEOUT_S, **{
            "tls_ca": str(self.ca), "tls_server_name": SERVER_NAME, "auth_token": TOKEN, **options})


KV_BUDGET = 1 << 30


@pytest.fixture(scope="module")
def deployment(tiny_pair_dirs, tmp_path_factory):
    home = tmp_path_factory.mktemp("ray_home")
    authority = Authority(tmp_path_factory.mktemp("pki"))
    services = authority.issue("services")
    namespace = f"disco-test-{uuid.uuid4().hex[:8]}"
    generated, original = [], ray_launcher.new_token  # the backend token `up` makes (nobody is told it)

    def new_token() -> str:
        generated.append(original())
        return generated[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray_launcher, "new_token", new_token)
        info = up(UpConfig(target=str(tiny_pair_dirs["target"]), draft=str(tiny_pair_dirs["draft"]),
                           dtype="float32", namespace=namespace, target_replicas=2, port=0,
                           tls_cert=str(services.cert), tls_key=str(services.key), tls_ca=str(authority.ca),
                           tls_server_name=SERVER_NAME, metrics=True, http_port=0, max_kv_bytes=KV_BUDGET,
                           http_limits={"max_tokens_limit": MAX_TOKENS_LIMIT}),
                  home, (TOKEN,))
    (backend_token,) = generated
    deployment = Deployment(info, home, namespace, {}, authority.ca, services, backend_token)
    # Every actor's process and address as `disco status` reports them at start: the kill tests
    # read them, so each test runs alone too (not only after the status test).
    actors = {actor["name"]: actor for actor in status(None, namespace, home)["actors"]}
    deployment.pids.update({name: actor["pid"] for name, actor in actors.items()})
    deployment.names.update({name: actor["address"] for name, actor in actors.items()})
    yield deployment
    if ray.is_initialized():  # a test failed before test_down_removes_everything
        down(None, namespace, home)


@pytest.fixture(scope="module")
def reference(target_model, tokenizer):
    """Target-only greedy output per prompt and length: what every run must produce."""
    return target_only_tokens(target_model, tokenizer)


def wait_until(condition, timeout_s: float = RESTART_TIMEOUT_S, what: str = "condition"):
    return helpers.wait_until(condition, timeout_s, what)


def describe(deployment: Deployment, name: str) -> dict | None:
    try:
        return ray.get(deployment.actor(name).describe.remote(), timeout=10)
    except (ray.exceptions.RayError, ValueError):
        return None  # restarting


def test_up_starts_every_actor_and_status_lists_them(deployment):
    info = deployment.info
    assert len(info["target"]) == 2 and len(info["draft"]) == 1 and info["orchestrator"]
    assert info["placement"] == "SPREAD"  # one node: STRICT_SPREAD is impossible
    report = status(None, deployment.namespace, deployment.home)
    actors = {actor["name"]: actor for actor in report["actors"]}
    assert set(actors) == {"draft-0", "target-0", "target-1", "orchestrator"}
    for name, actor in actors.items():
        assert actor["health"] == "SERVING" and actor["node_ip"] and not actor["restarted"], actor
        assert actor["tls"] and actor["metrics"], actor  # health checked over (m)TLS; /metrics served
        with urllib.request.urlopen(f"http://{actor['metrics']}/metrics", timeout=10) as page:
            assert b"disco_" in page.read()
        if name != "orchestrator":
            assert actor["resources"] == {"CPU": 1.0} and actor["model"]["dtype"] == "float32"
            assert actor["limits"] == {"max_sessions": 64, "max_kv_bytes": KV_BUDGET}  # `disco up --max-kv-bytes`
    assert sorted(actors[n]["address"] for n in ("target-0", "target-1")) == sorted(info["target"])
    assert report["orchestrator"] == info["orchestrator"]
    assert report["placement_group"]["strategy"] == "SPREAD" and report["placement_group"]["state"] == "CREATED"
    assert {name: actor["pid"] for name, actor in actors.items()} == deployment.pids  # no actor restarted yet


def test_a_local_head_and_every_service_are_on_loopback_only(deployment):
    """``disco up`` without ``--address``: the Ray node is 127.0.0.1, every address it
    prints is 127.0.0.1, and no process of the Ray runtime (head daemons, the actors'
    gRPC, HTTP and metrics servers) listens on any other address."""
    info = deployment.info
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    printed = up_report(info) + json.dumps(info)
    addresses = set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", printed))
    assert addresses == {"127.0.0.1"}, printed
    for actor in status(None, deployment.namespace, deployment.home)["actors"]:
        assert actor["node_ip"] == "127.0.0.1" and actor["address"].startswith("127.0.0.1:"), actor
        assert actor["metrics"].startswith("127.0.0.1:"), actor
    head = psutil.Process(info["ray_head_pid"])
    listening = {(process.name(), c.laddr.ip, c.laddr.port) for process in [head, *head.children(recursive=True)]
                 for c in _connections(process) if c.status == psutil.CONN_LISTEN}
    assert listening and {ip for _, ip, _ in listening} <= LOOPBACK, sorted(listening)
    ports = {port for _, _, port in listening}
    for address in (info["orchestrator"], *info["target"], *info["draft"]):  # the actors' servers are among them
        assert int(address.rsplit(":", 1)[1]) in ports, address


def _connections(process: psutil.Process) -> list:
    try:
        return process.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def backend_stub(deployment: Deployment, name: str, with_client_certificate: bool = True):
    tls = TlsFiles.from_paths(deployment.services.cert if with_client_certificate else None,
                              deployment.services.key if with_client_certificate else None,
                              deployment.ca, SERVER_NAME)
    channel = secure_channel(deployment.names[name], tls)
    stub = (draft_pb2_grpc.DraftServiceStub if name.startswith("draft") else target_pb2_grpc.TargetServiceStub)
    return channel, stub(channel)


def info_code(stub, metadata=()) -> grpc.StatusCode:
    try:
        stub.Info(common_pb2.ServiceInfoRequest(), metadata=metadata, timeout=30)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_backends_answer_only_the_deployments_orchestrator(deployment, reference):
    """A direct call to a draft or target replica, even with a client certificate the CA
    signed (mTLS passes), is refused without the deployment's backend token, and the public
    token is not it; the orchestrator (which holds it) serves."""
    for name in ("draft-0", "target-0", "target-1"):
        channel, stub = backend_stub(deployment, name)
        with channel:
            assert info_code(stub) == grpc.StatusCode.UNAUTHENTICATED, name
            assert info_code(stub, auth_metadata(TOKEN)) == grpc.StatusCode.UNAUTHENTICATED, name
            assert info_code(stub, auth_metadata(deployment.backend_token)) == grpc.StatusCode.OK, name
            info = stub.Info(common_pb2.ServiceInfoRequest(), metadata=auth_metadata(deployment.backend_token),
                             timeout=30)
            assert info.security == "authenticated (mTLS + backend token) on loopback", info.security
        channel, stub = backend_stub(deployment, name, with_client_certificate=False)
        with channel:  # no client certificate: the TLS handshake fails, whatever the token
            assert info_code(stub, auth_metadata(deployment.backend_token)) != grpc.StatusCode.OK, name
    with deployment.client() as client:
        result = client.generate(PROMPTS[0], policy="static:3", max_new_tokens=8, ignore_eos=True)
    assert result.token_ids == reference(PROMPTS[0], 8) and result.stats["draft_tokens"] > 0


def test_no_credential_shows_in_ray_state_runtime_environments_command_lines_or_logs(deployment):
    """The backend and public tokens reach the actors as constructor arguments: not in their
    runtime environments (which Ray's state API and dashboard show), not in the GCS actor
    table as Ray's tools read it, not on a command line, not in a log."""
    secrets = (deployment.backend_token, TOKEN)
    for name in ("orchestrator", "draft-0", "target-0", "target-1"):
        runtime_env = ray.get(deployment.actor(name).__ray_call__.remote(
            lambda self: ray.get_runtime_context().runtime_env), timeout=30)
        assert not any(secret in json.dumps(runtime_env) for secret in secrets), (name, runtime_env)
    table = json.dumps(ray._private.state.actors(), default=str)  # the GCS actor table, as Ray reads it
    assert "OrchestratorService" in table and not any(secret in table for secret in secrets)
    head = psutil.Process(deployment.info["ray_head_pid"])
    for process in [head, *head.children(recursive=True)]:
        try:
            command_line = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        assert not any(secret in command_line for secret in secrets), command_line
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [path for folder in (logs, deployment.home / "ray") for path in folder.rglob("*") if path.is_file()]
    assert len(files) > 5 and any(path.name.startswith("worker-") for path in files)
    for path in files:
        text = path.read_text(errors="replace")
        assert not any(secret in text for secret in secrets), path


def test_generation_through_the_orchestrator_is_token_identical(deployment, reference, capsys):
    with deployment.client() as client:
        for prompt, policy in zip(PROMPTS, ("static:3", "heuristic:2", "confidence:0.4")):
            result = client.generate(prompt, policy=policy, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert result.token_ids == reference(prompt, NEW_TOKENS), policy
            assert result.stats["draft_tokens"] > 0
    # `disco generate --server ADDR` against the Ray deployment
    code = main(["generate", "--server", deployment.info["orchestrator"], "--prompt", PROMPTS[0],
                 "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json", "--tls-ca", str(deployment.ca),
                 "--tls-server-name", SERVER_NAME, "--auth-token", TOKEN])
    assert code == 0 and json.loads(capsys.readouterr().out)["token_ids"] == reference(PROMPTS[0], NEW_TOKENS)
    with deployment.client(auth_token=None) as client, pytest.raises(DiscoRpcError) as refused:
        client.generate(PROMPTS[0], max_new_tokens=4)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with DiscoClient(deployment.info["orchestrator"], timeout=10) as plaintext, pytest.raises(DiscoRpcError):
        plaintext.generate(PROMPTS[0], max_new_tokens=4)  # the public API speaks TLS only


def test_the_orchestrator_actor_serves_the_openai_api(deployment):
    """``disco up --http-port``: HTTPS with the deployment's certificate, the same token,
    the same text as the gRPC API (docs/http.md)."""
    import ssl  # noqa: PLC0415

    url = deployment.info["http"]
    assert url and url.startswith("https://"), deployment.info
    context = ssl.create_default_context(cafile=str(deployment.ca))
    context.check_hostname = False  # the certificate names localhost; the actor listens on the node's IP
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True, "policy": "static:3"}).encode()
    request = urllib.request.Request(f"{url}/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60, context=context) as response:
        text = json.loads(response.read())["choices"][0]["text"]
    with deployment.client() as client:
        assert text == client.generate(PROMPTS[0], policy="static:3", max_new_tokens=8, ignore_eos=True).text
    request = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60, context=context)
    assert refused.value.code == 401
    # `disco up --max-tokens-limit`: the gateway's limit, and the orchestrator's.
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS_LIMIT + 1}).encode()
    request = urllib.request.Request(f"{url}/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60, context=context)
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["param"] == "max_tokens"
    with deployment.client() as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(PROMPTS[0], max_new_tokens=MAX_TOKENS_LIMIT + 1)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_new_tokens must be <= {MAX_TOKENS_LIMIT}" in refused.value.details()


def test_concurrent_sessions_spread_over_both_target_replicas(deployment, reference):
    from concurrent.futures import ThreadPoolExecutor

    before = [replica["sessions"] for replica in deployment.routing()["target"]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]

    def run(prompt):
        with deployment.client() as client:
            return client.generate(prompt, policy="static:2", max_new_tokens=NEW_TOKENS, ignore_eos=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(prompt, NEW_TOKENS)
    after = [replica["sessions"] for replica in deployment.routing()["target"]]
    placed = [a - b for a, b in zip(after, before)]
    assert sum(placed) == 4 and min(placed) >= 1, placed  # least-loaded: both replicas serve


def kill_mid_generation(deployment: Deployment, name_of, prompt: str):
    """Stream a long request, SIGKILL an actor's process after the first chunk (a crash, not
    a Ray-initiated stop), return the result."""
    with deployment.client() as client:
        stream = client.stream(prompt, policy="static:1", max_new_tokens=LONG_TOKENS, ignore_eos=True)
        chunks = iter(stream)
        first = next(chunks)
        name = name_of()
        os.kill(deployment.pids[name], signal.SIGKILL)
        rest = [chunk for chunk in chunks]
    tokens = first.token_ids + [t for chunk in rest for t in chunk.token_ids]
    assert tokens == stream.result.token_ids
    return name, stream.result


def wait_restarted(deployment: Deployment, name: str) -> dict:
    """Ray restarted ``name`` (new process) and the orchestrator routes to it again."""
    actor = wait_until(lambda: (d := describe(deployment, name)) and d["restarted"] and d, what=f"{name} restart")
    assert actor["pid"] != deployment.pids[name] and actor["health"] == "SERVING"
    role = name.split("-")[0]
    wait_until(lambda: next(r for r in deployment.routing()[role] if r["name"] == name)["healthy"],
               what=f"the orchestrator to route to {name} again")
    deployment.pids[name] = actor["pid"]
    deployment.names[name] = actor["address"]
    return actor


def test_draft_killed_mid_generation_is_restarted_and_the_request_stays_exact(deployment, reference):
    name, result = kill_mid_generation(deployment, lambda: "draft-0", PROMPTS[1])
    assert result.token_ids == reference(PROMPTS[1], LONG_TOKENS)
    # No other draft replica: the request went on target-only (exact: the target decides every token).
    assert result.stats["draft_fallbacks"] == 1
    assert next(r for r in deployment.routing()["draft"] if r["name"] == name)["failures"] == 1
    restarted = wait_restarted(deployment, name)
    assert restarted["address"] not in deployment.info["draft"]  # a new process, a new port
    channel, stub = backend_stub(deployment, name)
    with channel:  # Ray replayed the constructor arguments: the same backend token, still required
        assert info_code(stub) == grpc.StatusCode.UNAUTHENTICATED
        assert info_code(stub, auth_metadata(deployment.backend_token)) == grpc.StatusCode.OK
    with deployment.client() as client:  # the next request drafts on the restarted replica
        again = client.generate(PROMPTS[1], policy="static:3", max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert again.token_ids == reference(PROMPTS[1], NEW_TOKENS)
    assert again.stats["draft_tokens"] > 0 and again.stats["draft_fallbacks"] == 0


def test_target_killed_mid_generation_moves_the_session_and_stays_exact(deployment, reference):
    def busy_target() -> str:
        return next(r["name"] for r in deployment.routing()["target"] if r["active"] == 1)

    before = {r["name"]: r for r in deployment.routing()["target"]}
    name, result = kill_mid_generation(deployment, busy_target, PROMPTS[0])
    assert result.token_ids == reference(PROMPTS[0], LONG_TOKENS)
    after = {r["name"]: r for r in deployment.routing()["target"]}
    (other,) = set(after) - {name}
    assert after[name]["failures"] == before[name]["failures"] + 1
    assert after[other]["sessions"] == before[other]["sessions"] + 1  # re-prefilled on the other replica
    wait_restarted(deployment, name)


def test_every_target_killed_the_session_waits_for_a_restart(deployment, reference):
    def kill_both() -> str:
        busy = next(r["name"] for r in deployment.routing()["target"] if r["active"] == 1)
        idle = next(n for n in ("target-0", "target-1") if n != busy)
        ray.kill(deployment.actor(idle), no_restart=False)  # no healthy replica to move to
        return busy

    name, result = kill_mid_generation(deployment, kill_both, PROMPTS[2])
    assert result.token_ids == reference(PROMPTS[2], LONG_TOKENS)  # re-prefilled on a restarted replica
    for target in ("target-0", "target-1"):
        wait_restarted(deployment, target)


def test_down_removes_everything(deployment):
    report = down(None, deployment.namespace, deployment.home)
    assert sorted(report["removed"]) == ["draft-0", "orchestrator", "target-0", "target-1"]
    assert report["remaining"] == [] and not report["placement_group_left"] and report["ray_head_stopped"]
    assert not ray.is_initialized()
    assert not (deployment.home / "ray" / f"{deployment.namespace}.json").exists()
    wait_until(lambda: not any(alive(pid) for pid in deployment.pids.values()), 60.0, "the actor processes to exit")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False
