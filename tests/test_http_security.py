"""The HTTP gateway's limits (issue 45), against a real uvicorn gateway on loopback in front
of a real orchestrator and backends (tiny float32 models): a body over the limit is 413
before it is read, a refused token is 401 before that, several API keys are accepted (the
first is sent on), and connections that stall in their request head, their body, or idle
between requests are closed after short injected timeouts."""

import json
import socket
import time

import openai

try:  # the HTTP client the installed openai package uses (httpx2 in recent releases, httpx before)
    import httpx2
except ImportError:  # pragma: no cover - depends on the openai release pip picked
    import httpx as httpx2
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.errors import DiscoError
from disco_cli.bench.latency import AddedLatency
from orchestrator.http.config import DEFAULT_MAX_BODY_BYTES, HttpConfig
from orchestrator.http.server import start_in_thread
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded
from tests.test_http_api import spawn, stop

MODEL = "tiny-target"
PROMPT = "def f(x):"
KEY_A = "key-a-0123456789abcdef"  # the orchestrator's only key: the one the gateway sends on
KEY_B = "key-b-0123456789abcdef"
TIMEOUT_S = 0.5  # the gateway's header, keep-alive and body timeouts in this module
TEN_MB = 10_000_000


class Stack:
    def __init__(self, target_model, draft_model, tokenizer):
        self.target = target_service.server.serve(loaded(target_model, tokenizer, MODEL))
        self.draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-noisy"))
        # Backend calls are slowed so that a request outlasts the gateway's timeouts.
        self.orch = orchestrator.server.serve(tokenizer, self.draft.address, self.target.address,
                                              auth_tokens=(KEY_A,), backend_interceptors=[AddedLatency(0.02)])
        self.http = start_in_thread(HttpConfig(self.orch.address, port=0, auth_tokens=(KEY_A, KEY_B),
                                               header_timeout_s=TIMEOUT_S, keep_alive_timeout_s=TIMEOUT_S,
                                               body_timeout_s=TIMEOUT_S))
        self.root = self.http.url.removesuffix("/v1")

    def close(self):
        self.http.stop()
        for server in (self.orch, self.draft, self.target):
            server.stop(0)


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    running = Stack(target_model, drafts["noisy"], tokenizer)
    yield running
    running.close()


def connect(stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.http.port), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response with a ``Content-Length``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"closed before a response head: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536) or pytest.fail("closed mid-body")
    return int(status_line.split()[1]), headers, body


def seconds_until_closed(sock: socket.socket) -> float:
    """How long until the server closes ``sock`` (it must send nothing meanwhile)."""
    started = time.monotonic()
    try:
        assert sock.recv(1024) == b""
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def head(path: str, token: str | None, length: int, *, method: str = "POST") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {length}\r\n\r\n").encode()


def check_error(body: bytes, code: str) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


# --- the body limit -------------------------------------------------------------------------


def test_the_default_body_limit_is_the_orchestrators_largest_message():
    assert DEFAULT_MAX_BODY_BYTES == orchestrator.server.PUBLIC_MAX_RECEIVE_BYTES == 8 * 1024 * 1024


def test_a_10_mb_body_is_413_at_once_and_never_read(stack):
    # Not one byte of the body is sent: the answer comes from the Content-Length alone.
    with connect(stack) as sock:
        started = time.monotonic()
        sock.sendall(head("/v1/completions", KEY_A, TEN_MB) + b'{"prompt": "')
        status, headers, body = read_response(sock)
        assert status == 413 and time.monotonic() - started < 1.0
        assert headers["connection"] == "close" and seconds_until_closed(sock) < 1.0
    error = check_error(body, "request_too_large")
    assert error["type"] == "invalid_request_error" and str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    # The whole body sent by a client (not JSON, so a parser would have answered 400).
    with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
        started = time.monotonic()
        response = http.post(stack.http.url + "/completions", content=b"x" * TEN_MB,
                             headers={"Authorization": f"Bearer {KEY_B}", "Content-Type": "application/json"})
        elapsed = time.monotonic() - started
    assert response.status_code == 413 and elapsed < 1.0, (response.text, elapsed)
    check_error(response.content, "request_too_large")


def test_a_chunked_body_over_the_limit_is_413(stack):
    sent = 0
    chunk = b"x" * 100_000

    def endless():  # 1 GB unless the server stops reading
        nonlocal sent
        for _ in range(10_000):
            sent += len(chunk)
            yield chunk

    with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
        started = time.monotonic()
        response = http.post(stack.http.url + "/completions", content=endless(),
                             headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
        elapsed = time.monotonic() - started
    assert response.status_code == 413 and elapsed < 5.0, (response.text, elapsed)
    check_error(response.content, "request_too_large")
    # Refused once past the limit: what was sent beyond it sits in socket buffers.
    assert DEFAULT_MAX_BODY_BYTES < sent < 4 * DEFAULT_MAX_BODY_BYTES


def test_a_chunked_body_under_the_limit_is_served(stack):
    payload = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}).encode()
    with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
        chunked = http.post(stack.http.url + "/completions", content=iter([payload[:10], payload[10:]]),
                            headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
        whole = http.post(stack.http.url + "/completions", content=payload,
                          headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
    assert chunked.status_code == 200 == whole.status_code, chunked.text
    assert chunked.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]


def test_the_token_is_checked_before_the_body_limit(stack):
    for token in (None, "wrong-key-0123456789"):
        with connect(stack) as sock:
            started = time.monotonic()
            sock.sendall(head("/v1/completions", token, TEN_MB))
            status, headers, body = read_response(sock)
            assert status == 401 and time.monotonic() - started < 1.0
            assert headers["www-authenticate"] == "Bearer" and headers["connection"] == "close"
        check_error(body, "invalid_api_key")


def test_a_stalled_body_is_408(stack):
    with connect(stack) as sock:
        sock.sendall(head("/v1/completions", KEY_A, 100) + b'{"prompt"')
        started = time.monotonic()
        status, headers, body = read_response(sock)
        assert status == 408 and TIMEOUT_S * 0.8 < time.monotonic() - started < TIMEOUT_S + 2.0
        assert headers["connection"] == "close"
    check_error(body, "request_timeout")


# --- API keys -------------------------------------------------------------------------------


def test_every_api_key_is_accepted_and_the_first_is_sent_on(stack):
    """The orchestrator accepts only KEY_A: a request with KEY_B succeeds because the
    gateway presents its first key, not the client's."""
    texts = set()
    for key in (KEY_A, KEY_B):
        client = openai.OpenAI(base_url=stack.http.url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
        texts.add(response.choices[0].text)
        assert [model.id for model in client.models.list()] == [MODEL]
    assert len(texts) == 1
    for key in ("wrong-key-0123456789", KEY_A[:-1], KEY_A + "x"):
        client = openai.OpenAI(base_url=stack.http.url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
        with pytest.raises(openai.AuthenticationError) as raised:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert raised.value.response.json()["error"]["code"] == "invalid_api_key"


def test_api_keys_in_the_config():
    assert HttpConfig("x:1", auth_tokens=KEY_A).auth_tokens == (KEY_A,)  # not one key per character
    assert HttpConfig("x:1", auth_tokens=[KEY_A, KEY_B]).upstream_token == KEY_A
    assert HttpConfig("x:1").upstream_token is None
    # The deprecated spelling of fronting(...) still works, alone or with the new one.
    assert HttpConfig.fronting("x:1", "127.0.0.1", 0, auth_token=KEY_A).auth_tokens == (KEY_A,)
    assert HttpConfig.fronting("x:1", "127.0.0.1", 0, auth_tokens=(KEY_A, KEY_B)).auth_tokens == (KEY_A, KEY_B)
    assert HttpConfig.fronting("x:1", "127.0.0.1", 0, auth_token=None).auth_tokens == ()
    for bad in (dict(auth_tokens=(KEY_A, "")), dict(auth_tokens=("two words",)), dict(max_body_bytes=0),
                dict(header_timeout_s=0), dict(keep_alive_timeout_s=-1)):
        with pytest.raises(DiscoError):
            HttpConfig("x:1", port=0, **bad).validate()


def test_disco_http_accepts_every_key_of_its_token_file(stack, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# API keys\n{KEY_A}\n\n{KEY_B}\n")
    process = spawn("http", "--server", stack.orch.address, "--port", "0", "--auth-token-file", str(keys))
    try:
        url = json.loads(process.stdout.readline())["url"]
        with open(f"/proc/{process.pid}/cmdline", "rb") as command_line:  # `ps` shows no key
            assert KEY_A.encode() not in command_line.read()
        for key in (KEY_A, KEY_B):
            client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
            assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong-key-0123456789", max_retries=0,
                          timeout=CLIENT_TIMEOUT_S).models.list()
    finally:
        stop(process)


# --- connection timeouts --------------------------------------------------------------------


def test_a_stalled_request_head_is_disconnected(stack):
    with connect(stack) as sock:  # half a request line, then nothing
        sock.sendall(b"POST /v1/compl")
        assert TIMEOUT_S * 0.8 < seconds_until_closed(sock) < TIMEOUT_S + 2.0
    with connect(stack) as sock:  # nothing at all
        assert TIMEOUT_S * 0.8 < seconds_until_closed(sock) < TIMEOUT_S + 2.0
    with connect(stack) as sock:  # a byte at a time (10 s in all) does not move the deadline
        started = time.monotonic()
        with pytest.raises(OSError):  # broken pipe or reset, once the server has closed
            for byte in b"GET /health HTTP/1.1\r\n" + b"X-Slow: y\r\n" * 50:
                sock.sendall(bytes([byte]))
                time.sleep(0.02)
        assert time.monotonic() - started < TIMEOUT_S + 2.0


def test_an_idle_keep_alive_connection_is_closed(stack):
    with connect(stack) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection") != "close"
        assert TIMEOUT_S * 0.8 < seconds_until_closed(sock) < TIMEOUT_S + 2.0
    with connect(stack) as sock:  # after a response, half of the next request head: the header deadline
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /hea")
        assert TIMEOUT_S * 0.8 < seconds_until_closed(sock) < TIMEOUT_S + 2.0


def test_requests_longer_than_the_timeouts_are_served(stack):
    """The timeouts bound waiting for the client, not the work: a request that takes
    several times as long, streamed or not, and a second request on the same
    connection, are served."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "policy": "static:1"}
    with httpx2.Client(timeout=CLIENT_TIMEOUT_S, headers={"Authorization": f"Bearer {KEY_B}"}) as http:
        started = time.monotonic()
        whole = http.post(stack.http.url + "/completions", json=body)
        assert whole.status_code == 200 and time.monotonic() - started > 2 * TIMEOUT_S
        with http.stream("POST", stack.http.url + "/completions", json={**body, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(event.removeprefix("data:"))["choices"][0]["text"] for event in events[:-1])
        assert text == whole.json()["choices"][0]["text"]
