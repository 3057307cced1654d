"""Every budget of the public API is checked before work (issue 45), against real
servers on loopback with the tiny models: prompt bytes before tokenizing, tokenizing that
holds up no other request, capped stop strings matched in linear time, capped policy
specs, no silent target-only fallback on a bad ``disco:`` name, and log lines that a
client's values can neither forge nor flood."""

import io
import json
import logging
import statistics
import threading
import time

import grpc
import pytest

try:  # the HTTP client the installed openai package uses (httpx2 in recent releases, httpx before)
    import httpx2
except ImportError:  # pragma: no cover - depends on the openai release pip picked
    import httpx as httpx2

import draft_service.server
import orchestrator.server
import target_service.server
from disco.config import MAX_STOP_CHARS, MAX_STOP_STRINGS
from disco.speculation.detokenize import IncrementalDetokenizer, StopMatcher
from disco.speculation.policies.spec import MAX_POLICY_SPEC_CHARS
from orchestrator.client import DiscoClient, DiscoRpcError
from orchestrator.http.config import HttpConfig
from orchestrator.http.server import start_in_thread
from orchestrator.prompts import MIN_PROMPT_BYTES, SHORT_PROMPT_BYTES, Tokenizers, default_prompt_byte_limit
from orchestrator.servicer import OrchestratorLimits
from protos.disco.v1 import target_pb2, target_pb2_grpc
from protos.runtime.logs import MAX_FIELD_CHARS, ContextFilter, JsonFormatter, TextFormatter, replace_log_fields
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded

Code = grpc.StatusCode
SMALL = dict(prompt="def f(x):", max_new_tokens=4)
HUGE_PROMPT = "def f(x):\n    return x\n" * (7_500_000 // 24)  # 7.5 MB
ALLOWED_BYTES = 4_000_000
BIG_PROMPT = "def f(x):\n    return x\n" * (3_000_000 // 24)  # 3 MB: allowed by ALLOWED_BYTES, seconds to tokenize
TOO_MANY_STOPS = [f"zz{i}" for i in range(200_000)]
FORGED = "2030-01-01 00:00:00,000 ERROR forged: line"


class Stack:
    """Backends, an orchestrator with the default limits, one that lets 4 MB prompts be
    tokenized, and an HTTP gateway in front of the first."""

    def __init__(self, target_model, draft_model, tokenizer):
        self.target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
        self.draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-noisy"))
        self.orch = orchestrator.server.serve(tokenizer, self.draft.address, self.target.address)
        self.roomy_orch = orchestrator.server.serve(tokenizer, self.draft.address, self.target.address,
                                                    limits=OrchestratorLimits(max_prompt_bytes=ALLOWED_BYTES))
        self.http = start_in_thread(HttpConfig(self.orch.address, port=0))
        self.client = DiscoClient(self.orch.address, timeout=CLIENT_TIMEOUT_S)
        self.roomy = DiscoClient(self.roomy_orch.address, timeout=CLIENT_TIMEOUT_S)

    def close(self):
        self.client.close()
        self.roomy.close()
        self.http.stop()
        for server in (self.orch, self.roomy_orch, self.draft, self.target):
            server.stop(0)


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    running = Stack(target_model, drafts["noisy"], tokenizer)
    yield running
    running.close()


def refusal(call) -> tuple[DiscoRpcError, float]:
    """The error ``call`` raised and how long it took."""
    started = time.perf_counter()
    with pytest.raises(DiscoRpcError) as raised:
        call()
    return raised.value, time.perf_counter() - started


def latency(client: DiscoClient) -> float:
    started = time.perf_counter()
    client.generate(**SMALL)
    return time.perf_counter() - started


def assert_not_delayed(alone: float, during: list[float]) -> None:
    """Small requests made while a big one was worked on took at most a second longer than
    alone (the median; a shared machine may stall one request, so the worst gets 3 s)."""
    assert during and statistics.median(during) < alone + 1.0 and max(during) < alone + 3.0, (alone, during)


def test_the_default_byte_limit_follows_the_context():
    assert default_prompt_byte_limit(512) == MIN_PROMPT_BYTES  # the floor
    assert default_prompt_byte_limit(32_768) == 8 * 32_768
    assert default_prompt_byte_limit(1 << 30) == 8 * 1024 * 1024  # a model that reports no context


def test_a_huge_prompt_is_refused_before_tokenizing_and_delays_no_one(stack):
    alone = statistics.median(latency(stack.client) for _ in range(5))
    outcome = {}

    def huge():
        outcome["error"], outcome["seconds"] = refusal(lambda: stack.client.generate(HUGE_PROMPT, max_new_tokens=4))

    thread = threading.Thread(target=huge)
    thread.start()
    during = []
    while thread.is_alive() or not during:
        during.append(latency(stack.client))
    thread.join()
    error = outcome["error"]
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"prompt is {len(HUGE_PROMPT)} bytes" in error.details() and f"limit of {MIN_PROMPT_BYTES}" in error.details()
    assert outcome["seconds"] < 1.0, outcome  # 14 s of tokenizing before
    assert_not_delayed(alone, during)


def test_a_huge_conversation_is_refused_by_its_bytes(stack):
    half = HUGE_PROMPT[: len(HUGE_PROMPT) // 2]
    error, seconds = refusal(lambda: stack.client.generate(messages=[("system", half), ("user", half)],
                                                           max_new_tokens=4))
    assert error.code() == Code.INVALID_ARGUMENT and f"prompt is {2 * len(half)} bytes" in error.details()
    assert seconds < 1.0


def test_tokenizing_a_big_allowed_prompt_does_not_hold_up_other_requests(stack):
    """A 3 MB prompt (allowed by this orchestrator) takes seconds to tokenize; another
    client's small request meanwhile is not slower by more than a second."""
    alone = statistics.median(latency(stack.roomy) for _ in range(5))
    outcome = {}

    def big():  # tokenized, then refused by its tokens (the tiny target's context is 512)
        outcome["error"], outcome["seconds"] = refusal(lambda: stack.roomy.generate(BIG_PROMPT, max_new_tokens=4))

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.2)  # the prompt is on its way (3 MB over loopback: milliseconds)
    during = []
    while thread.is_alive() and len(during) < 20:
        during.append(latency(stack.roomy))
    overlapped = thread.is_alive()  # the big prompt was still being worked on after every small request
    thread.join()
    assert "context" in outcome["error"].details()  # it was tokenized, not refused by bytes
    assert overlapped or outcome["seconds"] > 1.0, outcome
    assert_not_delayed(alone, during)  # 13.5 s before


def test_tokenizer_copies_are_never_shared(tokenizer):
    tokenizers = Tokenizers(tokenizer, long_encoders=2)
    with (tokenizers.encoder(10) as short, tokenizers.encoder(SHORT_PROMPT_BYTES + 1) as first,
          tokenizers.encoder(10**6) as second):
        assert len({id(tokenizer), id(short), id(first), id(second)}) == 4
        assert first("def f(x):")["input_ids"] == short("def f(x):")["input_ids"] == tokenizer("def f(x):")["input_ids"]
    ids = tokenizer("def f(x):")["input_ids"]
    assert tokenizers.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_200000_stop_strings_are_refused_over_grpc(stack):
    error, seconds = refusal(lambda: stack.client.generate(**SMALL, stop=TOO_MANY_STOPS))
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"200000 given, more than the limit of {MAX_STOP_STRINGS}" in error.details()
    assert seconds < 2.0  # 8.8 s for 32 tokens before


@pytest.mark.parametrize("stop, message", [
    (["x"] * (MAX_STOP_STRINGS + 1), f"{MAX_STOP_STRINGS + 1} given"),
    (["ok", "y" * (MAX_STOP_CHARS + 1)], f"stop[1] has {MAX_STOP_CHARS + 1}"),
])
def test_stop_strings_are_capped_in_count_and_length(stack, stop, message):
    error, _ = refusal(lambda: stack.client.generate(**SMALL, stop=stop))
    assert error.code() == Code.INVALID_ARGUMENT and message in error.details()
    assert stack.client.generate(**SMALL, stop=["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).finish_reason


@pytest.mark.parametrize("body, param, message", [
    (dict(stop=TOO_MANY_STOPS), "stop", "200000 given"),
    (dict(stop=["y" * (MAX_STOP_CHARS + 1)]), "stop", f"stop[0] has {MAX_STOP_CHARS + 1}"),
    (dict(policy="disco:" + "x" * 20_000), "policy", f"at most {MAX_POLICY_SPEC_CHARS} characters"),
    (dict(policy="disco:no-such-artifact"), "policy", "not available on this draft service"),
])
def test_the_http_gateway_answers_400_naming_the_field(stack, body, param, message):
    with httpx2.Client(base_url=stack.http.url, timeout=CLIENT_TIMEOUT_S) as http:
        started = time.perf_counter()
        response = http.post("/completions", json={"prompt": "def f(x):", "max_tokens": 4, **body})
        seconds = time.perf_counter() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert seconds < 2.0


def test_a_too_long_policy_spec_is_refused_not_served_target_only(stack):
    """Before: the draft's refusal quoting a 20,000-character name overflowed gRPC's
    metadata limit, and the request went on target-only with no error."""
    error, _ = refusal(lambda: stack.client.generate(**SMALL, policy="disco:" + "x" * 20_000))
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"more than the limit of {MAX_POLICY_SPEC_CHARS}" in error.details() and len(error.details()) < 300


@pytest.mark.parametrize("policy, message", [
    ("disco:no-such-artifact", "policy 'disco:no-such-artifact' names a DISCO artifact that is not available"),
    ("disco:", "expected disco:PATH"),
    ("disco:default@td=x", "malformed policy spec"),
])
def test_a_bad_disco_name_is_invalid_argument(stack, policy, message):
    error, _ = refusal(lambda: stack.client.generate(**SMALL, policy=policy))
    assert error.code() == Code.INVALID_ARGUMENT and message in error.details(), error.details()


# Logs


def format_record(formatter, message="session %s ended", *args, **fields) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter())
    logger = logging.getLogger("tests.budgets")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    replace_log_fields(**fields)
    try:
        logger.info(message, *args)
    finally:
        replace_log_fields()
        logger.removeHandler(handler)
    return out.getvalue()


@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter])
def test_a_field_with_a_newline_is_one_log_line(formatter):
    text = format_record(formatter, "session %s ended\r", f"a\n{FORGED}", session_id=f"s\n{FORGED}\x1b[31m")
    lines = text.splitlines()
    assert len(lines) == 1 and not any(line.startswith(FORGED) for line in lines), text
    assert "\\n" + FORGED in lines[0] and "\x1b" not in lines[0]
    if formatter is JsonFormatter:
        entry = json.loads(lines[0])
        assert entry["session_id"] == f"s\\n{FORGED}\\x1b[31m" and entry["message"].endswith("ended\\r")


@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter])
def test_a_megabyte_field_is_cut(formatter):
    text = format_record(formatter, "got %s and %d", "y" * 1_000_000, 7, session_id="x" * 1_000_000, tokens=12)
    assert len(text) < 2 * MAX_FIELD_CHARS + 500, len(text)
    assert text.count("...[cut, 1000000 chars]") == 2 and "and 7" in text
    if formatter is JsonFormatter:
        assert json.loads(text)["tokens"] == 12  # numbers stay numbers


def test_a_backend_session_id_with_a_newline_forges_no_log_line(stack):
    """Whether the target refuses the id or logs it, no line of the log starts with the forgery."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with grpc.insecure_channel(stack.target.address) as channel, pytest.raises(grpc.RpcError):
            target_pb2_grpc.TargetServiceStub(channel).Verify(
                target_pb2.VerifyRequest(session_id=f"nope\n{FORGED}" + "z" * 1_000_000), timeout=10)
    finally:
        root.setLevel(level)
        root.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert not any(line.startswith(FORGED) for line in lines), out.getvalue()[:2000]
    assert all(len(line) < 5000 for line in lines)


# Stop strings


def decode_chars(ids):
    """A tokenizer whose token ``i`` is the character ``chr(i)``."""
    return "".join(chr(i) for i in ids)


def test_a_stop_string_spanning_two_tokens_is_found_and_cut():
    detokenizer = IncrementalDetokenizer(decode_chars, stop=["END", "cd"])
    text = ""
    for char in "abc":
        delta = detokenizer.push(ord(char))
        assert not delta.stopped
        text += delta.text
    assert text == "ab"  # "c" is held back: it starts a stop string
    delta = detokenizer.push(ord("d"))  # completes "cd", started by the previous token
    assert delta.stopped and text + delta.text == "ab" and detokenizer.text == "ab"


def test_the_stop_string_that_ends_first_wins():
    """One token brings both: the one that ends first cuts the text, as one token per character would."""
    detokenizer = IncrementalDetokenizer(lambda ids: "".join(["x", "abcd"][i] for i in ids), stop=["abcd", "bc"])
    assert not detokenizer.push(0).stopped
    delta = detokenizer.push(1)
    assert delta.stopped and detokenizer.text == "xa"


def test_stop_matching_reads_each_character_once():
    """Transitions of the matcher grow with the text, not with the stop strings nor with
    their length: at most 2 per character, and 10x the text costs about 10x."""
    stops = ["a" * (MAX_STOP_CHARS - 1) + "b", *(f"#{i:02d}" * 64 for i in range(MAX_STOP_STRINGS - 1))]

    def steps(length: int) -> int:
        matcher = StopMatcher(stops)
        text = "a" * length  # the worst case: always a partial match of the first stop string
        for start in range(0, length, 3):  # fed as tokens of 3 characters
            assert matcher.feed(text[start:start + 3]) is None
        assert matcher.pending == min(length, MAX_STOP_CHARS - 1)
        return matcher.steps

    short, long = steps(1_000), steps(10_000)
    assert short <= 2 * 1_000 and long <= 2 * 10_000
    assert long < 12 * short


def test_a_stop_string_fed_across_pieces_is_found_where_it_starts():
    matcher = StopMatcher(["</s>", "\n\n"])
    assert matcher.feed("hello <") is None and matcher.pending == 1
    assert matcher.feed("/") is None and matcher.pending == 2
    assert matcher.feed("s> more") == len("hello ")
