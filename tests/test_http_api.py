"""The OpenAI-compatible HTTP API (docs/http.md) with the official ``openai`` client,
against real uvicorn gateways on loopback in front of real orchestrators (tiny float32
models): the text equals the gRPC client's, bad input gets a 4xx in the OpenAI error
shape and the server stays up, a client that leaves mid-stream frees its sessions."""

import copy
import json
import os
import signal
import ssl
import subprocess
import sys
import time

import openai

try:  # the HTTP client the installed openai package uses (httpx2 in recent releases, httpx before)
    import httpx2
except ImportError:  # pragma: no cover - depends on the openai release pip picked
    import httpx as httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

import draft_service.server
import orchestrator.server
import target_service.server
from disco_cli.bench.latency import AddedLatency
from orchestrator.client import DiscoClient
from orchestrator.http.config import HttpConfig
from orchestrator.http.server import start_in_thread
from protos.runtime.tls import TlsFiles
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, free_port, loaded
from tests.pki import Authority

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token"
MODEL = "tiny-target"
PROMPT = "def f(x):"
# Renders like a real template: role markers, the assistant turn opened.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class Stack:
    """Backends, orchestrators and gateways of this module."""

    def __init__(self, target_model, draft_model, tokenizer):
        chat_tokenizer = copy.deepcopy(tokenizer)
        chat_tokenizer.chat_template = CHAT_TEMPLATE
        self.target = target_service.server.serve(loaded(target_model, tokenizer, MODEL))
        self.draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-noisy"))
        serve = orchestrator.server.serve
        self.orch = serve(chat_tokenizer, self.draft.address, self.target.address)
        self.secure_orch = serve(chat_tokenizer, self.draft.address, self.target.address, auth_tokens=TOKEN)
        self.slow_orch = serve(chat_tokenizer, self.draft.address, self.target.address,
                               backend_interceptors=[AddedLatency(0.05)])
        self.http = start_in_thread(HttpConfig(self.orch.address, port=0))
        self.secure_http = start_in_thread(HttpConfig(self.secure_orch.address, port=0, auth_tokens=(TOKEN,)))
        self.tokenless_http = start_in_thread(HttpConfig(self.secure_orch.address, port=0))  # forwards no token
        self.slow_http = start_in_thread(HttpConfig(self.slow_orch.address, port=0))
        self.grpc = DiscoClient(self.orch.address, timeout=CLIENT_TIMEOUT_S)

    def close(self):
        self.grpc.close()
        for gateway in (self.http, self.secure_http, self.tokenless_http, self.slow_http):
            gateway.stop()
        for server in (self.orch, self.secure_orch, self.slow_orch, self.draft, self.target):
            server.stop(0)


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    running = Stack(target_model, drafts["noisy"], tokenizer)
    yield running
    running.close()


def client_of(gateway, api_key="unused"):
    return openai.OpenAI(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


def check_speculation(body, policy):
    spec = body["speculation"]
    assert spec["policy"] == policy and 0.0 <= spec["acceptance_rate"] <= 1.0
    assert spec["target_forwards"] >= 1 and spec["mean_lookahead"] >= 0


def test_completion_equals_the_grpc_result(stack):
    expected = stack.grpc.generate(PROMPT, policy="static:4", max_new_tokens=24, ignore_eos=True)
    response = client_of(stack.http).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"policy": "static:4",
                                                                              "ignore_eos": True})
    assert response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")
    (choice,) = response.choices
    assert choice.text == expected.text and choice.finish_reason == "length" == expected.finish_reason
    assert response.usage.completion_tokens == 24 == len(expected.token_ids)
    assert response.usage.prompt_tokens == expected.stats["prompt_tokens"]
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    check_speculation(response.model_dump(), "static:4")
    assert response.model_extra["speculation"]["policy"] == "static:4"
    # A prompt given as token ids goes through as GenerateRequest.prompt_ids.
    ids = [7, 42, 99, 5]
    by_ids = stack.grpc.generate(prompt_ids=ids, max_new_tokens=8, ignore_eos=True)
    response = client_of(stack.http).completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                                        extra_body={"ignore_eos": True})
    assert response.choices[0].text == by_ids.text and response.usage.prompt_tokens == 4


def test_streamed_completion_with_usage_equals_the_grpc_result(stack):
    expected = stack.grpc.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    chunks = list(client_of(stack.http).completions.create(
        model=MODEL, prompt=[PROMPT], max_tokens=20, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    *texts, final, usage = chunks
    assert len(texts) >= 2 and "".join(c.choices[0].text for c in texts) == expected.text
    assert final.choices[0].finish_reason == "length" and usage.choices == []
    assert usage.usage.completion_tokens == 20 and usage.usage.prompt_tokens == expected.stats["prompt_tokens"]
    check_speculation(usage.model_dump(), "auto")
    assert len({chunk.id for chunk in chunks}) == 1


def test_chat_equals_the_grpc_chat_result_whole_and_streamed(stack):
    message = "Write a function."
    expected = stack.grpc.generate(message, chat=True, policy="static:3", max_new_tokens=16, ignore_eos=True)
    client = client_of(stack.http)
    request = dict(model=MODEL, messages=[{"role": "user", "content": message}], max_completion_tokens=16,
                   extra_body={"policy": "static:3", "ignore_eos": True})
    response = client.chat.completions.create(**request)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text and response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == expected.stats["prompt_tokens"]
    check_speculation(response.model_dump(), "static:3")

    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    # The content of a list of text parts, and max_tokens instead of max_completion_tokens.
    parts = client.chat.completions.create(model=MODEL, max_tokens=16, extra_body={"policy": "static:3",
                                                                                   "ignore_eos": True},
                                           messages=[{"role": "user", "content": [{"type": "text", "text": message}]}])
    assert parts.choices[0].message.content == expected.text


def test_a_conversation_is_rendered_by_the_orchestrator_as_over_grpc(stack):
    """System, user and assistant turns go to the orchestrator as GenerateRequest.messages
    (``developer`` is OpenAI's newer name of ``system``)."""
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Write a function.")]
    expected = stack.grpc.generate(messages=turns, policy="static:3", max_new_tokens=16, ignore_eos=True)
    single = stack.grpc.generate(turns[-1][1], chat=True, policy="static:3", max_new_tokens=16, ignore_eos=True)
    assert expected.stats["prompt_tokens"] > single.stats["prompt_tokens"]  # the earlier turns are in the prompt
    messages = [{"role": "developer" if role == "system" else role, "content": text} for role, text in turns]
    response = client_of(stack.http).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, extra_body={"policy": "static:3", "ignore_eos": True})
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == expected.stats["prompt_tokens"]


def test_stop_strings_and_greedy_defaults_match_grpc(stack):
    expected = stack.grpc.generate(PROMPT, max_new_tokens=40)
    stop = expected.text[len(expected.text) // 2:][:3]
    assert stop.strip()
    cut = stack.grpc.generate(PROMPT, max_new_tokens=40, stop=[stop, "never-there"])
    response = client_of(stack.http).completions.create(model="anything", prompt=PROMPT, max_tokens=40,
                                                        stop=[stop, "never-there"])
    assert response.choices[0].text == cut.text and response.choices[0].finish_reason == "stop"
    assert response.model == "anything"  # any model name is accepted and echoed


BAD = [
    ("completions", dict(prompt=""), "prompt", "prompt is empty"),
    ("completions", dict(prompt=["a", ""]), "prompt", "prompt[1] is empty"),
    ("completions", dict(n=0), "n", "greater than or equal to 1"),
    ("completions", dict(max_tokens=-1), "max_tokens", "greater than or equal to 0"),  # 0: echo (prompt scoring)
    ("completions", dict(policy="bogus:1"), "policy", "unknown policy 'bogus'"),  # gRPC INVALID_ARGUMENT
    ("completions", dict(policy="bogus:1", stream=True), "policy", "unknown policy 'bogus'"),
    ("completions", dict(temperature=-0.5), "temperature", "greater than or equal to 0"),
    ("completions", dict(logprobs=21), "logprobs", "less than or equal to 20"),
    ("completions", dict(stream_options={"include_usage": True}), None, "only allowed with stream"),
    ("chat", dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]),
     "messages", "last message must have role 'user'"),
    ("chat", dict(messages=[{"role": "function", "content": "42"}, {"role": "user", "content": "Hi"}]),
     "messages", "not supported"),
    ("chat", dict(messages=[]), "messages", "messages is empty"),
    ("chat", dict(messages=[{"role": "user", "content": ""}]), "messages", "every message is empty"),
    ("chat", dict(messages=[{"role": "robot", "content": "Hi"}]), "messages[0].role", "Input should be"),
]


@pytest.mark.parametrize("route, fields, param, message", BAD)
def test_bad_input_gets_400_in_the_openai_shape_and_the_server_stays_up(stack, route, fields, param, message):
    client = client_of(stack.http)
    create = client.completions.create if route == "completions" else client.chat.completions.create
    base = (dict(prompt=PROMPT) if route == "completions" else
            dict(messages=[{"role": "user", "content": "Hi"}]))
    fields = dict(fields)
    custom = {key: fields.pop(key) for key in ("policy",) if key in fields}
    with pytest.raises(openai.BadRequestError) as raised:
        result = create(model=MODEL, **{"max_tokens": 4, **base, **fields}, extra_body=custom)
        list(result) if fields.get("stream") else None
    body = raised.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert message in body["error"]["message"]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_malformed_json_and_non_object_bodies_get_400(stack):
    with httpx2.Client(base_url=stack.http.url, timeout=CLIENT_TIMEOUT_S) as http:
        for content in (b'{"prompt": "x", ', b"[1, 2]", b"null"):
            response = http.post("/completions", content=content, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, content
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
        assert error["param"] is None
        bad = http.post("/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"})
        assert bad.json()["error"]["code"] == "invalid_json"
        assert http.post("/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_the_bearer_token_is_checked_and_forwarded(stack):
    with pytest.raises(openai.AuthenticationError) as raised:
        client_of(stack.secure_http, "wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert raised.value.status_code == 401 and raised.value.response.json()["error"]["code"] == "invalid_api_key"
    good = client_of(stack.secure_http, TOKEN).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert good.usage.completion_tokens == 2  # the orchestrator requires the token too: it was forwarded
    assert [m.id for m in client_of(stack.secure_http, TOKEN).models.list()] == [MODEL]
    # A gateway without the token in front of an orchestrator that requires one: gRPC UNAUTHENTICATED -> 401.
    with pytest.raises(openai.AuthenticationError) as raised:
        client_of(stack.tokenless_http, TOKEN).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert raised.value.response.json()["error"]["code"] == "unauthenticated"
    with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:  # health and metrics need no token
        assert http.get(stack.secure_http.url.removesuffix("/v1") + "/health").status_code == 200
        assert http.get(stack.secure_http.url.removesuffix("/v1") + "/metrics").status_code == 200


def test_models_health_and_metrics_by_route_and_status(stack):
    root = stack.http.url.removesuffix("/v1")
    client = client_of(stack.http)
    assert [(m.id, m.object) for m in client.models.list()] == [(MODEL, "model")]
    with httpx2.Client(base_url=root, timeout=CLIENT_TIMEOUT_S) as http:
        health = http.get("/health").json()
        assert health == {"status": "ok", "active_sessions": {"orchestrator": 0, "draft": 0, "target": 0},
                          "services": {"draft": "SERVING", "target": "SERVING"}}
        before = requests_by_label(http.get("/metrics").text)
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        http.post("/v1/completions", json={"prompt": PROMPT, "n": 0})
        http.get("/no/such/route")
        after = requests_by_label(http.get("/metrics").text)
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    assert delta[("/v1/completions", "POST", "200")] == 2 and delta[("/v1/completions", "POST", "400")] == 1
    assert delta[("unmatched", "GET", "404")] == 1 and delta[("/metrics", "GET", "200")] == 1


def requests_by_label(text):
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "disco_http_requests"]
    return {(s.labels["route"], s.labels["method"], s.labels["status"]): s.value
            for s in family.samples if s.name.endswith("_total")}


def wait_idle(info, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while (active := info.info()["active_sessions"]) != {"orchestrator": 0, "draft": 0, "target": 0}:
        assert time.monotonic() < deadline, f"sessions still held after the client left: {active}"
        time.sleep(0.05)


# Through the slowed orchestrator (50 ms per backend call) this runs ~25 s unless cancelled.
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "policy": "static:2"}


def test_a_client_leaving_mid_stream_cancels_the_grpc_call(stack):
    with DiscoClient(stack.slow_orch.address, timeout=CLIENT_TIMEOUT_S) as info:
        with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
            with http.stream("POST", stack.slow_http.url + "/completions", json={**LONG, "stream": True}) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                assert json.loads(first.removeprefix("data:"))["choices"][0]["text"]
                running = info.info()["active_sessions"]
                assert running["orchestrator"] == 1 and running["target"] == 1
        wait_idle(info)


def test_a_client_leaving_a_whole_request_cancels_the_grpc_call(stack):
    with DiscoClient(stack.slow_orch.address, timeout=CLIENT_TIMEOUT_S) as info:
        with httpx2.Client(timeout=1.0) as http, pytest.raises(httpx2.ReadTimeout):
            http.post(stack.slow_http.url + "/completions", json=LONG)
        wait_idle(info)


def test_a_request_past_the_gateways_deadline_is_504_and_frees_its_sessions(stack):
    """Whichever side notices the deadline first (the gateway's gRPC client or the
    orchestrator), the answer is 504 ``deadline_exceeded``, not a 500."""
    gateway = start_in_thread(HttpConfig(stack.slow_orch.address, port=0, timeout_s=0.3))
    try:
        with DiscoClient(stack.slow_orch.address, timeout=CLIENT_TIMEOUT_S) as info:
            with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
                response = http.post(gateway.url + "/completions", json=LONG)
            assert response.status_code == 504, response.text
            error = response.json()["error"]
            assert error["code"] == "deadline_exceeded" and error["type"] == "server_error", error
            wait_idle(info)
    finally:
        gateway.stop()


def test_an_error_mid_stream_is_one_error_event_then_the_end(stack):
    """The request's deadline passes mid-stream: the status line was 200 already, so the
    error arrives as one event carrying the error object (504's), and no ``[DONE]`` follows.
    (A target that goes away mid-stream is waited for by the orchestrator, see
    orchestrator/routing.py, so the deadline is what ends such a stream too.)"""
    gateway = start_in_thread(HttpConfig(stack.slow_orch.address, port=0, timeout_s=1.5))
    try:
        with DiscoClient(stack.slow_orch.address, timeout=CLIENT_TIMEOUT_S) as info:
            with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
                with http.stream("POST", gateway.url + "/completions", json={**LONG, "stream": True}) as response:
                    assert response.status_code == 200
                    events = [line.removeprefix("data:").strip() for line in response.iter_lines()
                              if line.startswith("data:")]
            assert json.loads(events[0])["choices"][0]["text"]
            error = json.loads(events[-1])["error"]
            assert error["code"] == "deadline_exceeded" and error["type"] == "server_error", error
            assert "[DONE]" not in events
            wait_idle(info)
    finally:
        gateway.stop()


def test_an_unreachable_orchestrator_is_503():
    gateway = start_in_thread(HttpConfig(f"127.0.0.1:{free_port()}", port=0, timeout_s=5))
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            client_of(gateway).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert raised.value.status_code == 503
        assert raised.value.response.json()["error"] | {"message": ""} == {
            "message": "", "type": "server_error", "param": None, "code": "unavailable"}
        with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
            health = http.get(gateway.url.removesuffix("/v1") + "/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == "the orchestrator does not answer"
    finally:
        gateway.stop()


def test_https_in_front_of_a_tls_deployment_with_a_token(target_model, drafts, tokenizer, tmp_path):
    """One set of files for the whole deployment, as `disco serve --tls-* --http-port` uses
    them: mTLS backends, a TLS orchestrator with a token, and the gateway connecting to it
    over TLS and serving HTTPS with the same certificate."""
    ca = Authority(tmp_path)
    identity = ca.issue("disco")
    tls = TlsFiles.from_paths(identity.cert, identity.key, ca.ca)
    target = target_service.server.serve(loaded(target_model, tokenizer, MODEL), tls=tls)
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"), tls=tls)
    orch = orchestrator.server.serve(tokenizer, draft.address, target.address, tls=tls, auth_tokens=TOKEN)
    gateway = start_in_thread(HttpConfig.fronting(orch.address, "127.0.0.1", 0, tls_cert=str(identity.cert),
                                                  tls_key=str(identity.key), tls_ca=str(ca.ca), auth_tokens=(TOKEN,)))
    try:
        assert gateway.url.startswith("https://")
        with DiscoClient(orch.address, tls_ca=str(ca.ca), auth_token=TOKEN, timeout=CLIENT_TIMEOUT_S) as grpc_client:
            expected = grpc_client.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
        with httpx2.Client(verify=ssl.create_default_context(cafile=str(ca.ca)), timeout=CLIENT_TIMEOUT_S) as http:
            client = openai.OpenAI(base_url=gateway.url, api_key=TOKEN, max_retries=0, http_client=http)
            response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                 extra_body={"ignore_eos": True})
            assert response.choices[0].text == expected.text
    finally:
        gateway.stop()
        for server in (orch, draft, target):
            server.stop(0)


def spawn(*argv):
    env = {key: value for key, value in os.environ.items() if key != "DISCO_AUTH_TOKEN"}
    return subprocess.Popen([sys.executable, "-m", "disco_cli.main", *argv, "--json"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop(process):
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_disco_http_command_fronts_a_running_orchestrator(stack):
    process = spawn("http", "--server", stack.orch.address, "--port", "0", "--served-model-name", "served")
    try:
        announced = json.loads(process.stdout.readline())
        assert announced["service"] == "http" and announced["server"] == stack.orch.address
        client = openai.OpenAI(base_url=announced["url"], api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        assert [m.id for m in client.models.list()] == ["served"]
        expected = stack.grpc.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
        response = client.completions.create(model="served", prompt=PROMPT, max_tokens=6,
                                             extra_body={"ignore_eos": True})
        assert response.choices[0].text == expected.text
    finally:
        stop(process)


@pytest.mark.slow  # NOTE: four Python processes importing torch take ~40 s on 2 busy cores
def test_disco_serve_http_port(tiny_pair_dirs):
    process = spawn("serve", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                    "--dtype", "float32", "--port", "0", "--http-port", "0")
    try:
        announced = json.loads(process.stdout.readline())
        assert set(announced) == {"orchestrator", "draft", "target", "http"}
        with DiscoClient(announced["orchestrator"], timeout=CLIENT_TIMEOUT_S) as grpc_client:
            expected = grpc_client.generate(PROMPT, policy="static:3", max_new_tokens=8, ignore_eos=True)
        client = openai.OpenAI(base_url=announced["http"], api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        chunks = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, stream=True,
                                           extra_body={"policy": "static:3", "ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    finally:
        stop(process)
