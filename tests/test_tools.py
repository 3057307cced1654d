"""Tool calling over gRPC (issue 48, item 6): tools and tool messages through the chat
template, a ``tool_calls`` constraint that makes the model call a tool with valid arguments
(speculative = target-only), the Hermes parser, continuing a final assistant message; real
services on loopback, tiny models."""

from __future__ import annotations

import copy
import json

import grpc
import jsonschema
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.config import StructuredOutput
from orchestrator.client import DiscoClient
from orchestrator.tools import parse_tool_calls, template_speaks_hermes, tool_calls_constraint
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded

#: A small template in Qwen2.5's manner: the tools listed in a system turn, earlier calls
#: rendered in the Hermes format, tool results in their own turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\ntools: {% for tool in tools %}{{ tool['function']['name'] }} {% endfor %}"
    "<tool_call></tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for call in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"exact": {"type": "boolean"}},
                                     "required": ["exact"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
ASK = [("user", "What is the weather in Paris?")]


@pytest.fixture(scope="module")
def client(target_model, drafts, tokenizer):
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = TOOLS_TEMPLATE
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    draft = draft_service.server.serve(loaded(drafts["noisy"], tokenizer, "tiny-noisy"))
    orch = orchestrator.server.serve(chat_tokenizer, draft.address, target.address)
    running = DiscoClient(orch.address, timeout=CLIENT_TIMEOUT_S)
    yield running
    running.close()
    for server in (orch, draft, target):
        server.stop(0)


def call(client, policy, name=None, parallel=False, **fields):
    return client.generate(messages=ASK, tools=TOOLS, policy=policy, max_new_tokens=96,
                           structured=tool_calls_constraint(TOOLS, name, parallel), **fields)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=3)])
@pytest.mark.parametrize("name", ["get_weather", "search", None])
def test_a_required_or_named_tool_call_validates_and_equals_target_only(client, name, sampling):
    results = {policy: call(client, policy, name, **sampling) for policy in ("none", "static:4", "heuristic:2")}
    expected = results["none"].token_ids
    assert all(result.token_ids == expected for result in results.values())
    assert results["static:4"].stats["draft_tokens"] > 0
    content, calls = parse_tool_calls(results["none"].text, "req-1")
    assert content == "" and len(calls) == 1
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[calls[0].name]
    assert name is None or calls[0].name == name
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])


def test_parallel_calls_each_validate(client):
    result = call(client, "static:3", None, parallel=True, temperature=1.0, seed=8)
    _, calls = parse_tool_calls(result.text, "req-2")
    assert calls
    for made in calls:
        tool = {t["function"]["name"]: t["function"] for t in TOOLS}[made.name]
        jsonschema.validate(json.loads(made.arguments), tool["parameters"])


def test_tool_messages_and_earlier_calls_reach_the_template(client):
    earlier = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "days": 2}'}}]}
    conversation = ASK + [earlier, {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                                    "content": "sunny"}]
    result = client.generate(messages=conversation, tools=TOOLS, max_new_tokens=4, echo=True, policy="none")
    prompt = result.prompt_text
    assert prompt.startswith("<|system|>\ntools: get_weather search")
    assert '"name": "get_weather"' in prompt and '{"city": "Oslo", "days": 2}' in prompt
    assert "<|tool|>\nsunny" in prompt and prompt.endswith("<|assistant|>\n")


def test_continue_final_message_leaves_the_assistant_turn_open(client):
    conversation = ASK + [{"role": "assistant", "content": "The weather is"}]
    result = client.generate(messages=conversation, continue_final_message=True, max_new_tokens=4, echo=True,
                             policy="none")
    assert result.prompt_text.endswith("<|assistant|>\nThe weather is")


@pytest.mark.parametrize("fields, message", [
    (dict(prompt="x", tools=TOOLS), "need messages"),
    (dict(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]},
                    ("user", "hi")]), "needs a function with a name"),
    (dict(messages=[{"role": "assistant", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}, ("user", "hi")]), "arguments is not valid JSON"),
    (dict(messages=[("user", "hi"), ("assistant", "x")]), "last message must have role 'user' or 'tool'"),
    (dict(messages=[("user", "hi")], continue_final_message=True), "needs an assistant message last"),
    (dict(messages=[("robot", "hi")]), "role must be one of"),
    (dict(messages=ASK, structured=("tool_calls", json.dumps({"tools": []}))), "tools"),
])
def test_bad_tool_requests_are_invalid_argument(client, fields, message):
    with pytest.raises(Exception) as caught:
        client.generate(max_new_tokens=4, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()


def test_the_parser_keeps_text_it_cannot_parse_and_derives_ids():
    text = 'Sure.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call><tool_call>oops</tool_call>'
    content, calls = parse_tool_calls(text, "r")
    assert content == "Sure.<tool_call>oops</tool_call>" and [c.name for c in calls] == ["a"]
    assert json.loads(calls[0].arguments) == {"x": 1} and calls[0].id == parse_tool_calls(text, "r")[1][0].id
    assert parse_tool_calls("plain text", "r") == ("plain text", [])
    assert template_speaks_hermes(TOOLS_TEMPLATE) and not template_speaks_hermes("{{ messages }}")


def test_a_named_constraint_allows_only_that_tool():
    kind, spec = tool_calls_constraint(TOOLS, "search", parallel=True)
    value = json.loads(spec)
    assert kind == "tool_calls" and [t["name"] for t in value["tools"]] == ["search"] and not value["parallel"]
    StructuredOutput(kind, spec).validate()
