"""``disco up`` on a real local Ray runtime (CPU, the tiny pair from its HF folders):
generation through the orchestrator actor is token-identical to in-process; two target
replicas share concurrent sessions; the draft or a target actor killed mid-generation
is restarted by Ray while the request completes, exact; ``disco down`` leaves nothing.
The deployment runs as a secured one would: TLS everywhere, mutual TLS between the
orchestrator and its backends, a bearer token on the public API, ``/metrics`` served.

One deployment serves the whole module (a Ray head plus four actor processes take about
a minute to start on a busy 2-core machine); the tests run in file order and the last
one takes it down.
"""

import json
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from deploy.ray_head import use_token_auth  # noqa: E402 - imports no ray

use_token_auth(generate=True)  # before `import ray`: the local head uses Ray's token auth
ray = pytest.importorskip("ray")

from deploy.ray_launcher import UpConfig, down, status, up  # noqa: E402
from disco_cli.main import main  # noqa: E402
from orchestrator.client import DiscoClient, DiscoRpcError  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import PROMPTS, target_only_tokens  # noqa: E402
from tests.pki import Authority  # noqa: E402

pytestmark = pytest.mark.ray

TOKEN = "ray-s3cret"
SERVER_NAME = "localhost"  # the test certificates name localhost; the actors listen on the node's IP
NEW_TOKENS = 32
LONG_TOKENS = 300  # static:1: one Draft and one Verify round trip per token, long enough to interrupt
RESTART_TIMEOUT_S = 180.0
CLIENT_TIMEOUT_S = 180.0


@dataclass
class Deployment:
    info: dict
    home: Path
    namespace: str
    pids: dict
    ca: Path

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
    info = up(UpConfig(target=str(tiny_pair_dirs["target"]), draft=str(tiny_pair_dirs["draft"]), dtype="float32",
                       namespace=namespace, target_replicas=2, port=0, tls_cert=str(services.cert),
                       tls_key=str(services.key), tls_ca=str(authority.ca), tls_server_name=SERVER_NAME,
                       metrics=True, http_port=0, max_kv_bytes=KV_BUDGET), home, auth_token=TOKEN)
    deployment = Deployment(info, home, namespace, {}, authority.ca)
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
    deployment.pids.update({name: actor["pid"] for name, actor in actors.items()})


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
    """Stream a long request, kill an actor after the first chunk, return the result."""
    with deployment.client() as client:
        stream = client.stream(prompt, policy="static:1", max_new_tokens=LONG_TOKENS, ignore_eos=True)
        chunks = iter(stream)
        first = next(chunks)
        name = name_of()
        ray.kill(deployment.actor(name), no_restart=False)
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
    return actor


def test_draft_killed_mid_generation_is_restarted_and_the_request_stays_exact(deployment, reference):
    name, result = kill_mid_generation(deployment, lambda: "draft-0", PROMPTS[1])
    assert result.token_ids == reference(PROMPTS[1], LONG_TOKENS)
    # No other draft replica: the request went on target-only (exact: the target decides every token).
    assert result.stats["draft_fallbacks"] == 1
    assert next(r for r in deployment.routing()["draft"] if r["name"] == name)["failures"] == 1
    restarted = wait_restarted(deployment, name)
    assert restarted["address"] not in deployment.info["draft"]  # a new process, a new port
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
