"""vLLM's sampling controls over the wire (issue 48, item 3): over gRPC on loopback, each control
gives ``none``'s tokens with ``static:4`` and ``heuristic:3``, greedy and seeded-sampled, and the
in-process tokens; with the official ``openai`` client each field is applied (the output changes
as the field says, and equals ``none``'s), and an invalid value is a 400 naming the field
(INVALID_ARGUMENT over gRPC). Real servers, tiny float32 models."""

from __future__ import annotations

import re

import grpc
import openai
import pytest

from disco.config import SamplingParams, SpeculationConfig
from orchestrator.client import DiscoRpcError, build_request
from protos.disco.v1 import orchestrator_pb2_grpc
from tests.grpc_fixtures import CLIENT_TIMEOUT_S
from tests.helpers import PROMPTS, local_generator
from tests.test_sampling_controls import bad_word_of
from tests.http_fixtures import MODEL, stack  # noqa: F401 - fixture

PROMPT = PROMPTS[0]
MAX_NEW = 24
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def baseline(stack):
    """gRPC target-only greedy tokens without controls (the controls are built from them)."""
    result = stack.grpc.generate(PROMPT, policy="none", max_new_tokens=MAX_NEW, ignore_eos=True)
    assert len(set(result.token_ids)) > MAX_NEW // 2
    return result


def controls(base, tokenizer):
    """Each control as :func:`orchestrator.client.build_request` arguments, at values that change
    the tiny target's output (its reference repeats no token: see tests/test_sampling_controls.py)."""
    ids = base.token_ids
    word = bad_word_of(ids, tokenizer)
    return {
        "repetition_penalty": dict(repetition_penalty=0.5),
        "presence_frequency": dict(repetition_penalty=0.7, presence_penalty=1.5, frequency_penalty=0.8),
        "negative_penalties": dict(presence_penalty=-2.0, frequency_penalty=-1.0),
        "logit_bias": dict(logit_bias={ids[0]: -100.0, ids[4]: 3.0}),
        "min_p": dict(min_p=0.2),
        "min_tokens": dict(min_tokens=10, stop_token_ids=[ids[1], ids[3]], ignore_eos=False),
        "stop_token_ids": dict(stop_token_ids=[ids[6]]),
        "bad_words": dict(bad_words=[word]),
        "all": dict(repetition_penalty=0.8, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05,
                    logit_bias={ids[1]: -5.0}, min_tokens=4, stop_token_ids=[ids[7]], bad_words=[word],
                    include_stop_str_in_output=True),
    }


def request_of(control, sampled):
    return {"max_new_tokens": MAX_NEW, "ignore_eos": True, **(SAMPLED if sampled else {}), **control}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["repetition_penalty", "presence_frequency", "negative_penalties", "logit_bias",
                                  "min_p", "min_tokens", "stop_token_ids", "bad_words", "all"])
def test_speculative_output_equals_target_only_over_grpc(stack, baseline, tokenizer, name, sampled):
    request = request_of(controls(baseline, tokenizer)[name], sampled)
    results = {policy: stack.grpc.generate(PROMPT, policy=policy, **request)
               for policy in ("none", "static:4", "heuristic:3")}
    expected = results["none"]
    for policy, result in results.items():
        assert (result.token_ids, result.text) == (expected.token_ids, expected.text), (name, sampled, policy)
    assert results["static:4"].stats["draft_tokens"] > 0
    if not sampled and name != "min_p":
        assert expected.token_ids != baseline.token_ids, f"{name} changed nothing"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_grpc_gives_the_in_process_tokens(stack, baseline, target_model, tokenizer, sampled):
    """Every control travels: the served tokens are the in-process ones under all of them."""
    request = request_of(controls(baseline, tokenizer)["all"], sampled)
    served = stack.grpc.generate(PROMPT, policy="static:4", **request)
    fields = {**request, "logit_bias": tuple(request["logit_bias"].items()),
              "stop_token_ids": tuple(request["stop_token_ids"]), "bad_words": tuple(request["bad_words"])}
    sampling = SamplingParams(**fields)
    local = local_generator(target_model, None, tokenizer).generate(tokenizer(PROMPT)["input_ids"], sampling,
                                                                    SpeculationConfig("none"))
    assert (served.token_ids, served.text) == (local.token_ids, local.text)


@pytest.mark.parametrize("request_fields, message", [
    (dict(stop_token_ids=[512]), "stop_token_ids: token id 512 is outside the vocabulary"),
    (dict(logit_bias={700: 1.0}), "logit_bias: token id 700 is outside the vocabulary"),
    (dict(min_tokens=30), "min_tokens must be in"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be"),
    (dict(bad_words=[" "]), r"bad_words\[0\] is empty"),
])
def test_invalid_controls_are_invalid_argument_over_grpc(stack, request_fields, message):
    with pytest.raises(DiscoRpcError) as raised:
        stack.grpc.generate(PROMPT, max_new_tokens=MAX_NEW, **request_fields)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, raised.value.details()), raised.value.details()


def test_the_backend_only_fields_are_refused_from_a_client(stack):
    stub = orchestrator_pb2_grpc.OrchestratorStub(stack.grpc._channel)
    for field, value in (("eos_token_ids", [0]), ("resumed_tokens", 3)):
        request = build_request(PROMPT, max_new_tokens=4)
        if field == "eos_token_ids":
            request.sampling.eos_token_ids.extend(value)
        else:
            request.sampling.resumed_tokens = value
        with pytest.raises(grpc.RpcError) as raised:
            stub.GenerateUnary(request, timeout=CLIENT_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "set by the orchestrator" in \
            raised.value.details()


# --- the openai client: one request per field ---------------------------------------------------


def complete(stack, policy, **fields):
    """A completion through the openai client (every field in the body as given)."""
    return stack.openai.completions.create(model=MODEL, prompt=PROMPT, extra_body={"policy": policy, **fields})


def http_fields(control):
    """The HTTP body fields of a control (logit_bias keys are strings, as OpenAI's)."""
    fields = dict(control)
    if "logit_bias" in fields:
        fields["logit_bias"] = {str(token): bias for token, bias in fields["logit_bias"].items()}
    fields.pop("max_new_tokens", None)
    return fields


@pytest.mark.parametrize("name", ["repetition_penalty", "presence_frequency", "negative_penalties", "logit_bias",
                                  "min_p", "min_tokens", "stop_token_ids", "bad_words"])
def test_each_field_with_the_openai_client(stack, baseline, tokenizer, name):
    control = controls(baseline, tokenizer)[name]
    fields = {"max_tokens": MAX_NEW, "ignore_eos": True, **http_fields(control)}
    if name == "min_p":
        fields |= SAMPLED  # greedy ignores it
    answers = {policy: complete(stack, policy, **fields) for policy in ("none", "static:4")}
    text = answers["none"].choices[0].text
    assert answers["static:4"].choices[0].text == text
    # The same request over gRPC gives the same text (the gateway maps every field).
    grpc_result = stack.grpc.generate(PROMPT, policy="none", **request_of(control, name == "min_p"))
    assert grpc_result.text == text
    if name != "min_p":
        assert text != baseline.text, f"{name} changed nothing"
    usage, finish = answers["none"].usage, answers["none"].choices[0].finish_reason
    if name == "stop_token_ids":
        assert finish == "stop" and usage.completion_tokens == 7
    elif name == "min_tokens":
        assert usage.completion_tokens >= control["min_tokens"]
    else:
        assert finish == "length" and usage.completion_tokens == MAX_NEW
    if name == "bad_words":  # the word's one-token forms never appear
        forms = [tokenizer(prefix + control["bad_words"][0], add_special_tokens=False)["input_ids"] for prefix in ("", " ")]
        assert not {form[0] for form in forms if len(form) == 1} & set(grpc_result.token_ids)


def test_include_stop_str_in_output_with_the_openai_client(stack, baseline):
    stop = baseline.text[8:12]
    assert stop and stop in baseline.text
    cut = complete(stack, "static:4", max_tokens=MAX_NEW, ignore_eos=True, stop=[stop])
    kept = complete(stack, "static:4", max_tokens=MAX_NEW, ignore_eos=True, stop=[stop],
                    include_stop_str_in_output=True)
    start = baseline.text.index(stop)
    assert cut.choices[0].text == baseline.text[:start]
    assert kept.choices[0].text == baseline.text[:start + len(stop)]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"


def test_chat_applies_the_fields_too(stack):
    messages = [{"role": "user", "content": "Hi"}]

    def chat(policy, **fields):
        return stack.openai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16,
            extra_body={"policy": policy, "ignore_eos": True, **fields}).choices[0].message.content

    plain = chat("none")
    penalized = chat("none", repetition_penalty=0.5, presence_penalty=-1.0)
    assert penalized != plain and chat("static:4", repetition_penalty=0.5, presence_penalty=-1.0) == penalized


@pytest.mark.parametrize("fields, param", [
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 150}), "logit_bias"),
    (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (dict(logit_bias={"100000": 1}), "logit_bias"),  # outside the vocabulary: the orchestrator's check
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=9), "min_tokens"),  # above max_tokens
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[600]), "stop_token_ids"),  # outside the vocabulary
    (dict(stop_token_ids=list(range(65))), "stop_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["x"] * 65), "bad_words"),
    (dict(include_stop_str_in_output="maybe"), "include_stop_str_in_output"),
])
def test_invalid_values_are_a_400_naming_the_field(stack, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        complete(stack, "static:4", max_tokens=8, **fields)
    error = raised.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
