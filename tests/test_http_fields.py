"""No field of the OpenAI API is ignored silently (issue 48, items 1 and 7), with the official
``openai`` client against real uvicorn gateways on loopback in front of a real orchestrator
(tiny float32 models): a field this server does not implement is a 400 naming it unless it
holds its neutral value (which is accepted and changes nothing), an unknown field is a 400
naming it, and the limits (max tokens, concurrency with a bounded queue, the deadline), the
defaults, the 404/405 answers and the log line of a cancelled stream are as documented."""

import argparse
import copy
import json
import logging
import threading
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
from disco.errors import DiscoError
from disco_cli.bench.latency import AddedLatency
from disco_cli.commands import http as http_command
from disco_cli.commands import serve as serve_command
from orchestrator.client import DiscoClient
from orchestrator.http.config import DEFAULT_QUEUE_PER_SLOT, HttpConfig
from orchestrator.http.schemas import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)
from orchestrator.http.server import start_in_thread
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded
from tests.test_http_api import CHAT_TEMPLATE, LONG, MODEL, PROMPT, wait_idle

LIMIT = 64  # max_tokens_limit of the limited gateway
HI = [{"role": "user", "content": "Hi"}]


class Stack:
    def __init__(self, target_model, draft_model, tokenizer):
        chat_tokenizer = copy.deepcopy(tokenizer)
        chat_tokenizer.chat_template = CHAT_TEMPLATE
        self.target = target_service.server.serve(loaded(target_model, tokenizer, MODEL))
        self.draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-noisy"))
        serve = orchestrator.server.serve
        self.orch = serve(chat_tokenizer, self.draft.address, self.target.address)
        self.slow_orch = serve(chat_tokenizer, self.draft.address, self.target.address,
                               backend_interceptors=[AddedLatency(0.05)])
        self.http = start_in_thread(HttpConfig(self.orch.address, port=0))
        self.limited_http = start_in_thread(HttpConfig(self.orch.address, port=0, max_tokens_limit=LIMIT))
        self.queued_http = start_in_thread(HttpConfig(self.slow_orch.address, port=0, max_concurrent=1, max_queue=1))
        self.slow_http = start_in_thread(HttpConfig(self.slow_orch.address, port=0))
        self.grpc = DiscoClient(self.orch.address, timeout=CLIENT_TIMEOUT_S)

    def close(self):
        self.grpc.close()
        for gateway in (self.http, self.limited_http, self.queued_http, self.slow_http):
            gateway.stop()
        for server in (self.orch, self.slow_orch, self.draft, self.target):
            server.stop(0)


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    running = Stack(target_model, drafts["noisy"], tokenizer)
    yield running
    running.close()


def client_of(gateway):
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def create(stack, route, gateway=None, **fields):
    """One request through the openai client; every field goes in the body as given."""
    client = client_of(gateway or stack.http)
    stream = fields.pop("stream", False)  # the client must know: it then parses server-sent events
    if route == "completions":
        return client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, extra_body=fields)
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", HI), stream=stream,
                                          extra_body=fields)


def refused(stack, route, **fields):
    """The error object of a request that must be a 400."""
    with pytest.raises(openai.BadRequestError) as raised:
        create(stack, route, max_tokens=4, **fields)
    body = raised.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


# --- not supported yet: 400 naming the field, unless neutral --------------------------

#: A value of each field that is not supported yet that is NOT its neutral one.
SHARED_VALUES = {
    "allowed_token_ids": [1, 2], "use_beam_search": True,
    "length_penalty": 0.5, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4, "guided_whitespace_pattern": " ",
    "structural_tag": "{}", "logits_processors": ["pkg.Processor"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "priority": 1, "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
}
COMPLETION_VALUES = {**SHARED_VALUES, "suffix": "x", "prompt_embeds": "AAAA",
                     "add_special_tokens": False}
CHAT_VALUES = {
    **SHARED_VALUES, "best_of": 2, "echo": True,
    "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "service_tier": "flex", "store": True, "add_special_tokens": True, "documents": [{"title": "a", "text": "b"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "include_reasoning": False,
}
MESSAGE_VALUES = {"function_call": {"name": "f", "arguments": "{}"}, "audio": {"id": "a"}, "refusal": "no"}


def test_every_field_not_supported_yet_has_a_refused_value_here():
    """The lists above cover every field the schemas accept only at a neutral value."""
    assert set(COMPLETION_VALUES) == set(CompletionRequest.NOT_YET)
    assert set(CHAT_VALUES) == set(ChatCompletionRequest.NOT_YET)
    assert set(MESSAGE_VALUES) == set(ChatMessage.NOT_YET)
    assert set(StreamOptions.NOT_YET) == {"continuous_usage_stats"}


@pytest.mark.parametrize("route, field, value", [("completions", f, v) for f, v in COMPLETION_VALUES.items()]
                         + [("chat", f, v) for f, v in CHAT_VALUES.items()])
def test_a_field_not_supported_yet_is_400_naming_it(stack, route, field, value):
    error = refused(stack, route, **{field: value})
    assert error["param"] == field and "not supported yet" in error["message"], error
    assert error["message"].startswith(f"{field}: ")


@pytest.mark.parametrize("field, value", MESSAGE_VALUES.items())
def test_a_message_field_not_supported_yet_is_400_naming_it(stack, field, value):
    role = "assistant" if field in ("tool_calls", "function_call", "audio", "refusal") else "user"
    messages = [{"role": role, "content": "Hello", field: value}, {"role": "user", "content": "Hi"}]
    error = refused(stack, "chat", messages=messages)
    assert error["param"] == f"messages[0].{field}" and "not supported yet" in error["message"], error


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_options_continuous_usage_stats_is_refused(stack, route):
    error = refused(stack, route, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert error["param"] == "stream_options.continuous_usage_stats" and "not supported yet" in error["message"]


def test_a_non_text_content_part_is_refused_naming_it(stack):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    error = refused(stack, "chat", messages=messages)
    assert error["param"].startswith("messages[0].content[0]") and "not supported yet" in error["message"], error


def neutral_body(not_yet, pick):
    return {field: pick(values) for field, values in not_yet.items()}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_neutral_values_and_no_effect_fields_are_accepted_and_change_nothing(stack, route):
    """Every field not supported yet at each of its neutral values (all at once: the last
    neutral value, then null), and the fields that cannot change the output with real
    values: the text is the same as without any of them."""
    schema = CompletionRequest if route == "completions" else ChatCompletionRequest
    base = dict(max_tokens=12, ignore_eos=True)
    expected = create(stack, route, **base)
    no_effect = dict(user="user-1", cache_salt="salt")
    if route == "chat":
        no_effect |= dict(metadata={"k": "v"}, prompt_cache_key="key",
                          safety_identifier="someone")
        messages = [{"role": "user", "content": "Hi", **neutral_body(ChatMessage.NOT_YET, lambda v: v[-1])}]
    for pick in (lambda values: values[-1], lambda values: values[0]):
        fields = {**neutral_body(schema.NOT_YET, pick), **no_effect, **base}
        if route == "chat":
            fields["messages"] = messages
        answer = create(stack, route, **fields)
        text = answer.choices[0].text if route == "completions" else answer.choices[0].message.content
        assert text == (expected.choices[0].text if route == "completions" else expected.choices[0].message.content)
        assert answer.usage.completion_tokens == 12
    chunks = list(create(stack, route, **base, stream=True,
                         stream_options={"include_usage": True, "include_obfuscation": False,
                                         "continuous_usage_stats": False}))
    assert chunks[-1].usage.completion_tokens == 12


def test_the_neutral_values_named_in_the_issue_are_accepted(stack):
    for route, fields in [("completions", dict(n=1, presence_penalty=0, logprobs=None, frequency_penalty=0.0,
                                               repetition_penalty=1.0, min_p=0, min_tokens=0, stop_token_ids=[],
                                               include_stop_str_in_output=False, response_format={"type": "text"})),
                          ("chat", dict(tool_choice="none", top_logprobs=0,
                                        logprobs=False, response_format={"type": "text"}))]:
        assert create(stack, route, max_tokens=2, **fields).usage.completion_tokens >= 1


# --- unknown fields -------------------------------------------------------------------


@pytest.mark.parametrize("route, fields, param", [
    ("completions", dict(temprature=0.5), "temprature"),
    ("chat", dict(no_such_field=1), "no_such_field"),
    ("completions", dict(stream=True, stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
    ("chat", dict(messages=[{"role": "user", "content": "Hi", "mood": "happy"}]), "messages[0].mood"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}]}]),
     "messages[0].content[0].cache"),
])
def test_an_unknown_field_is_400_naming_it(stack, route, fields, param):
    error = refused(stack, route, **fields)
    assert error["param"] == param and error["message"] == f"Unrecognized request argument supplied: {param}"
    assert error["code"] == "unrecognized_argument"


# --- details --------------------------------------------------------------------------


def test_top_k_minus_one_is_off(stack):
    sampled = dict(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    off = create(stack, "completions", top_k=0, **sampled).choices[0].text
    assert create(stack, "completions", top_k=-1, **sampled).choices[0].text == off
    error = refused(stack, "completions", top_k=-2)
    assert error["param"] == "top_k"


def test_a_whitespace_prompt_is_a_prompt_and_only_an_empty_one_is_refused(stack, tokenizer):
    """Whitespace tokenizes to tokens, as in vLLM: it is served (completions and chat)."""
    ids = tokenizer("   ", add_special_tokens=True)["input_ids"]
    assert ids
    expected = stack.grpc.generate(prompt_ids=ids, max_new_tokens=4, ignore_eos=True)
    client = client_of(stack.http)
    answer = client.completions.create(model=MODEL, prompt="   ", max_tokens=4, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == expected.text
    chat = create(stack, "chat", max_tokens=4, ignore_eos=True, messages=[{"role": "user", "content": " \n "}])
    assert chat.usage.completion_tokens == 4
    assert refused(stack, "chat", messages=[{"role": "user", "content": ""}])["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert raised.value.response.json()["error"]["param"] == "prompt"


def raw(gateway, method, path, **kwargs):
    with httpx2.Client(base_url=gateway.url.removesuffix("/v1"), timeout=CLIENT_TIMEOUT_S) as http:
        return http.request(method, path, **kwargs)


def test_max_tokens_null_or_absent_is_the_routes_default(stack):
    for body in ({}, {"max_tokens": None}):
        answer = raw(stack.http, "POST", "/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == COMPLETIONS_DEFAULT_MAX_TOKENS
        chat = raw(stack.http, "POST", "/v1/chat/completions", json={"messages": HI, "ignore_eos": True, **body})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == CHAT_DEFAULT_MAX_TOKENS
    # Behind a lower --max-tokens-limit the chat default is capped to it.
    chat = raw(stack.limited_http, "POST", "/v1/chat/completions",
               json={"messages": HI, "ignore_eos": True, "max_completion_tokens": None})
    assert chat.json()["usage"]["completion_tokens"] == LIMIT


@pytest.mark.parametrize("route, field", [("completions", "max_tokens"), ("chat", "max_tokens"),
                                          ("chat", "max_completion_tokens")])
def test_max_tokens_above_the_limit_is_400_naming_the_field(stack, route, field):
    with pytest.raises(openai.BadRequestError) as raised:
        create(stack, route, gateway=stack.limited_http, **{field: LIMIT + 1})
    error = raised.value.response.json()["error"]
    assert error["param"] == field and f"must be <= {LIMIT}" in error["message"]
    assert create(stack, route, gateway=stack.limited_http, **{field: LIMIT}).usage.completion_tokens >= 1


def test_models_report_max_model_len(stack):
    context = stack.grpc.info()["limits"]["max_context"]
    assert context > 0
    (card,) = client_of(stack.http).models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == context


def test_request_id_becomes_the_response_id(stack):
    assert create(stack, "completions", max_tokens=2, request_id="req-1").id == "cmpl-req-1"
    assert create(stack, "chat", max_tokens=2, request_id="req-2").id == "chatcmpl-req-2"
    assert refused(stack, "completions", request_id="two words")["param"] == "request_id"


def test_404_and_405_are_in_the_openai_error_shape(stack):
    missing = raw(stack.http, "POST", "/v1/no/such/route", json={})
    assert missing.status_code == 404
    assert missing.json() == {"error": {"message": "Invalid URL (POST /v1/no/such/route)",
                                        "type": "invalid_request_error", "param": None, "code": "not_found"}}
    wrong = raw(stack.http, "GET", "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    error = wrong.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("Invalid method for URL (GET /v1/completions)")
    with pytest.raises(openai.NotFoundError):
        client_of(stack.http).get("/no/such/route", cast_to=object)


# --- the queue ------------------------------------------------------------------------


def gauge(gateway, name):
    text = raw(gateway, "GET", "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return family.samples[0].value


def wait_for(condition, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_request_waits_in_the_queue_and_one_more_gets_429(stack):
    """Concurrency 1, queue 1: while one request runs, the second waits and then succeeds,
    the third is answered 429 at once."""
    queued = {}

    def second():
        try:
            queued["answer"] = create(stack, "completions", gateway=stack.queued_http, max_tokens=4, ignore_eos=True)
        except Exception as error:  # noqa: BLE001 - reported below
            queued["error"] = error

    with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
        with http.stream("POST", stack.queued_http.url + "/completions", json={**LONG, "stream": True}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # NOTE: kept, or its collection would close the connection
            next(line for line in lines if line.startswith("data:"))  # it holds the slot
            waiter = threading.Thread(target=second)
            waiter.start()
            wait_for(lambda: gauge(stack.queued_http, "disco_http_waiting_requests") == 1, "the queued request")
            with pytest.raises(openai.RateLimitError) as raised:
                create(stack, "completions", gateway=stack.queued_http, max_tokens=4)
            error = raised.value.response.json()["error"]
            assert error["code"] == "too_many_requests" and error["type"] == "rate_limit_error"
            assert not queued  # still waiting while the first runs
        # The first client left: its slot goes to the waiting request.
        waiter.join(CLIENT_TIMEOUT_S)
    assert "error" not in queued, queued.get("error")
    assert queued["answer"].usage.completion_tokens == 4
    wait_for(lambda: gauge(stack.queued_http, "disco_http_running_requests") == 0, "the slot back")


def test_a_request_past_its_deadline_in_the_queue_is_504(stack):
    """The deadline counts from the arrival: a request that waits for a slot longer gets 504."""
    gateway = start_in_thread(HttpConfig(stack.slow_orch.address, port=0, max_concurrent=1, timeout_s=2.0))
    try:
        with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
            with http.stream("POST", gateway.url + "/completions", json={**LONG, "stream": True}) as running:
                lines = running.iter_lines()  # NOTE: kept, or its collection would close the connection
                next(line for line in lines if line.startswith("data:"))
                waiting = http.post(gateway.url + "/completions", json={**LONG, "max_tokens": 4})
        assert waiting.status_code == 504 and waiting.json()["error"]["code"] == "deadline_exceeded"
    finally:
        gateway.stop()


# --- a cancelled stream is logged ------------------------------------------------------


def test_a_cancelled_stream_leaves_one_info_line(stack, caplog):
    caplog.set_level(logging.INFO, logger="orchestrator.http.app")
    with DiscoClient(stack.slow_orch.address, timeout=CLIENT_TIMEOUT_S) as info:
        with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as http:
            with http.stream("POST", stack.slow_http.url + "/completions",
                             json={**LONG, "stream": True, "request_id": "leaving-1"}) as response:
                first = next(line for line in response.iter_lines() if line.startswith("data:"))
                assert json.loads(first.removeprefix("data:"))["id"] == "cmpl-leaving-1"
        wait_idle(info)

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "orchestrator.http.app"
                and "cmpl-leaving-1" in r.getMessage()]

    wait_for(lambda: lines(), "the log line", timeout_s=10.0)
    (line,) = lines()
    assert line.startswith("stream cmpl-leaving-1: the client went away after ") and "tokens were sent" in line
    assert int(line.split("after ")[1].split()[0]) >= 1


# --- settings ---------------------------------------------------------------------------


def test_the_limits_are_flags_of_disco_http_and_disco_serve():
    for register, argv in ((http_command.register, ["http", "--server", "x:1"]), (serve_command.register, ["serve"])):
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(argv + ["--max-tokens-limit", "8", "--max-concurrent", "2", "--max-queue", "0",
                                         "--request-timeout", "5"])
        assert http_command.http_limits_from_args(args) == {"max_tokens_limit": 8, "max_concurrent": 2,
                                                            "max_queue": 0, "timeout_s": 5.0}
        defaults = http_command.http_limits_from_args(parser.parse_args(argv))
        assert defaults == {"max_tokens_limit": 4096, "max_concurrent": 64, "max_queue": None, "timeout_s": 300.0}
    parser = argparse.ArgumentParser()
    http_command.register(parser.add_subparsers())
    assert parser.parse_args(["http", "--server", "x:1", "--timeout", "7"]).request_timeout == 7.0  # the old name


def test_the_limits_in_the_config():
    assert HttpConfig("x:1", max_concurrent=3).queue_limit == DEFAULT_QUEUE_PER_SLOT * 3
    assert HttpConfig("x:1", max_queue=0).queue_limit == 0
    for bad in (dict(max_concurrent=0), dict(max_tokens_limit=0), dict(max_queue=-1), dict(timeout_s=0)):
        with pytest.raises(DiscoError):
            HttpConfig("x:1", port=0, **bad).validate()
