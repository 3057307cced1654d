"""Structured outputs and tools through the OpenAI routes (issue 48, items 5 and 6), with the
official ``openai`` client against the gateway on loopback (tiny models): each constraint field
gives output that follows it, ``static:4`` equals ``none``, tool calls come back as
``tool_calls`` (streamed and not) with arguments valid under the tool's parameters, and what
cannot be honored is a 400 naming the field."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import openai
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from orchestrator.http.config import HttpConfig
from orchestrator.http.server import start_in_thread
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded
from tests.test_tools import TOOLS, TOOLS_TEMPLATE

MODEL = "tiny-target"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def client(target_model, drafts, tokenizer):
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = TOOLS_TEMPLATE
    target = target_service.server.serve(loaded(target_model, tokenizer, MODEL))
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    orch = orchestrator.server.serve(chat_tokenizer, draft.address, target.address)
    http = start_in_thread(HttpConfig(orch.address, port=0))
    yield openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    http.stop()
    for server in (orch, draft, target):
        server.stop(0)


def chat(client, policy, **fields):
    extra = {"policy": policy, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", CHAT),
                                          max_tokens=fields.pop("max_tokens", 160 if "tools" in fields else 48),
                                          extra_body=extra, **fields)


CONSTRAINTS = [
    ("response_format json_schema", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}), lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ("response_format json_object", dict(response_format={"type": "json_object"}), None),
    ("structured_outputs regex", dict(extra_body={"structured_outputs": {"regex": "[a-d]{2,5}-[0-9]"}}),
     lambda text: re.fullmatch("[a-d]{2,5}-[0-9]", text) or pytest.fail(text)),
    ("structured_outputs choice", dict(extra_body={"structured_outputs": {"choice": ["red", "green"]}}),
     lambda text: text in ("red", "green") or pytest.fail(text)),
    ("guided_json", dict(extra_body={"guided_json": SCHEMA}), lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ("guided_grammar", dict(extra_body={"guided_grammar": 'start: "x" NUM\nNUM: /[0-9]{1,2}/'}),
     lambda text: re.fullmatch("x[0-9]{1,2}", text) or pytest.fail(text)),
]


@pytest.mark.parametrize("name, fields, check", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=4)], ids=["greedy", "sampled"])
def test_each_constraint_field_is_followed_and_speculation_changes_nothing(client, name, fields, check, sampling):
    answers = {policy: chat(client, policy, **copy.deepcopy(fields), **sampling) for policy in ("none", "static:4")}
    texts = {policy: answer.choices[0].message.content for policy, answer in answers.items()}
    assert texts["none"] == texts["static:4"]
    if check is not None:
        check(texts["none"])
    if answers["none"].choices[0].finish_reason == "stop":
        if "json" in name:
            assert isinstance(json.loads(texts["none"]), dict)


def test_completions_take_response_format_too(client):
    answer = client.completions.create(model=MODEL, prompt="{", max_tokens=48, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_tool_call_comes_back_as_tool_calls(client, tool_choice):
    answers = {policy: chat(client, policy, tools=TOOLS, tool_choice=tool_choice) for policy in ("none", "static:4")}
    message = answers["none"].choices[0].message
    assert answers["none"].choices[0].finish_reason == "tool_calls" and message.content is None
    assert [c.function.model_dump() for c in message.tool_calls] == [
        c.function.model_dump() for c in answers["static:4"].choices[0].message.tool_calls]
    call = message.tool_calls[0]
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    assert isinstance(tool_choice, str) or call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_a_streamed_tool_call_equals_the_unary_one(client):
    fields = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})
    unary = chat(client, "static:4", **fields).choices[0]
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=160, stream=True,
                                            extra_body={"policy": "static:4"}, **fields)
    calls, content, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            calls[call.index] = call
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c.function.name, c.function.arguments) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in unary.message.tool_calls]


def test_a_tool_result_conversation_and_auto_choice(client):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    answers = [chat(client, policy, messages=messages, tools=TOOLS, tool_choice="auto") for policy in ("none", "static:4")]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].choices[0].message.tool_calls is None  # a random model writes no call


def test_continue_final_message(client):
    messages = CHAT + [{"role": "assistant", "content": "{\"ok\": "}]
    answer = chat(client, "none", messages=messages, extra_body={"continue_final_message": True,
                                                                "add_generation_prompt": False}, max_tokens=4)
    assert answer.usage.prompt_tokens > 0


@pytest.mark.parametrize("fields, param, message", [
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_json",
     "only one output constraint"),
    (dict(response_format={"type": "yaml"}), "response_format", "response_format must be"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}), "structured_outputs",
     "not supported"),
    (dict(extra_body={"guided_regex": "a", "guided_decoding_backend": "outlines"}), "guided_decoding_backend",
     "llguidance"),
    (dict(extra_body={"structured_outputs": {"regex": "(["}}), None, "regex"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(parallel_tool_calls=True), "parallel_tool_calls", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0]", "tools[0] must be"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "only one output constraint"),
    (dict(extra_body={"continue_final_message": True}), "messages", "needs an assistant message last"),
])
def test_what_cannot_be_honored_is_400_naming_the_field(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, "static:4", **fields)
    error = raised.value.response.json()["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param, error
