"""Structured outputs and tools on the OpenAI routes: the request fields that constrain the
output, mapped onto the gRPC request's ``structured`` (``disco.v1.StructuredOutput``) and
``tools``.

* ``response_format`` (OpenAI; chat and completions): ``text``, ``json_object``,
  ``json_schema`` (``{"json_schema": {"name", "schema", "strict", "description"}}``);
* vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``;
  exactly one) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` (``guided_decoding_backend`` may name llguidance, the engine this server has);
* chat ``tools`` with ``tool_choice`` (``none``, ``auto``, ``required``, a named function) and
  ``parallel_tool_calls``: ``required`` and a named function become a ``tool_calls`` constraint
  (:func:`orchestrator.tools.tool_calls_constraint`), so the draft and the target both enforce
  a valid call; ``auto`` leaves the model free and the answer's text is parsed for calls.

At most one constraint per request; anything this server cannot honor is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from disco.config import MAX_TOOLS
from orchestrator.http.errors import invalid
from orchestrator.tools import tool_calls_constraint

#: The grammar engine names a request may ask for (vLLM's ``guided_decoding_backend``).
BACKENDS = (None, "auto", "guidance", "llguidance")
#: vLLM's ``structured_outputs`` keys, and those this server takes with a value other than the neutral one.
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json_object"}
_STRUCTURED_NEUTRAL = {"disable_fallback": (None, False, True), "disable_any_whitespace": (None, True),
                       "disable_additional_properties": (None, False), "whitespace_pattern": (None,),
                       "structural_tag": (None,), "backend": BACKENDS}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def structured_kwargs(body: Any, chat: bool) -> dict[str, Any]:
    """The ``structured`` / ``tools`` arguments of :func:`~orchestrator.client.build_request`.

    Raises:
        ApiError: 400 naming the field that cannot be honored.
    """
    found = [(param, value) for param, value in (
        ("response_format", _response_format(body.response_format)),
        ("structured_outputs", _structured_outputs(body.structured_outputs)),
        ("guided_json", _guided(body))) if value is not None]
    tools, forced = _tools(body) if chat else (None, None)
    if forced is not None:
        found.append(("tool_choice", forced))
    if len(found) > 1:
        raise invalid(f"only one output constraint per request; got {' and '.join(p for p, _ in found)}",
                      found[1][0])
    kwargs: dict[str, Any] = {}
    if found:
        kwargs["structured"] = found[0][1]
    if tools:
        kwargs["tools"] = tools
    return kwargs


def parses_tool_calls(body: Any) -> bool:
    """Whether the answer's text is parsed for tool calls: tools given and ``tool_choice`` not ``none``."""
    return bool(getattr(body, "tools", None)) and getattr(body, "tool_choice", None) != "none"


def _response_format(value: dict | None) -> tuple[str, str] | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return "json_object", ""
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) or not set(spec) <= {
                "name", "schema", "strict", "description"}:
            raise invalid("response_format.json_schema must be {name, schema, strict, description} with a "
                          "JSON schema object", "response_format")
        return "json_schema", json.dumps(spec.get("schema") or {})
    raise invalid("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {...}}", "response_format")


def _structured_outputs(value: Any) -> tuple[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", "structured_outputs")
    unknown = set(value) - set(_STRUCTURED_KINDS) - set(_STRUCTURED_NEUTRAL)
    if unknown:
        raise invalid(f"structured_outputs: unknown key {sorted(unknown)[0]!r}", "structured_outputs")
    for key, neutral in _STRUCTURED_NEUTRAL.items():
        if value.get(key) not in neutral:
            raise invalid(f"structured_outputs.{key}: not supported; accepted only as "
                          f"{' or '.join(json.dumps(v) for v in neutral)}", "structured_outputs")
    given = [key for key in _STRUCTURED_KINDS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise invalid("structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                      "structured_outputs")
    return _constraint(given[0], value[given[0]], f"structured_outputs.{given[0]}")


def _guided(body: Any) -> tuple[str, str] | None:
    if body.guided_decoding_backend not in BACKENDS:
        raise invalid(f"guided_decoding_backend: this server's grammar engine is llguidance; got "
                      f"{body.guided_decoding_backend!r}", "guided_decoding_backend")
    given = [(key, getattr(body, f"guided_{key}")) for key in ("json", "regex", "choice", "grammar")
             if getattr(body, f"guided_{key}") is not None]
    if len(given) > 1:
        raise invalid("only one of guided_json, guided_regex, guided_choice, guided_grammar", f"guided_{given[1][0]}")
    return _constraint(given[0][0], given[0][1], f"guided_{given[0][0]}") if given else None


def _constraint(key: str, value: Any, param: str) -> tuple[str, str]:
    kind = _STRUCTURED_KINDS[key]
    if kind == "json_object":
        return kind, ""
    if kind == "json_schema":
        if isinstance(value, str):
            return kind, value
        if isinstance(value, dict):
            return kind, json.dumps(value)
        raise invalid(f"{param} must be a JSON schema (an object or its JSON text)", param)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise invalid(f"{param} must be a list of strings", param)
        return kind, json.dumps(value)
    if not isinstance(value, str):
        raise invalid(f"{param} must be a string", param)
    return kind, value


def _tools(body: Any) -> tuple[list[dict] | None, tuple[str, str] | None]:
    """The tools for the chat template, and the constraint ``tool_choice`` asks for."""
    tools, choice, parallel = body.tools, body.tool_choice, body.parallel_tool_calls
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        if parallel is not None:
            raise invalid("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None, None
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools: {len(tools)} given, more than the limit of {MAX_TOOLS}", "tools")
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not _TOOL_NAME.match(function["name"]) or not isinstance(function.get("parameters", {}), dict)
                or not set(function) <= {"name", "description", "parameters", "strict"}):
            raise invalid(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{name (letters, digits, "
                          "_ and -, at most 64), description, parameters (a JSON schema object), strict}}}}",
                          f"tools[{index}]")
        names.append(function["name"])
    if len(set(names)) != len(names):
        raise invalid("tools: two tools have the same name", "tools")
    if choice in (None, "auto", "none"):
        return tools, None
    if choice == "required":
        return tools, tool_calls_constraint(tools, None, parallel is not False)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) and choice.get(
        "type") == "function" else None
    if name is None:
        raise invalid("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return tools, tool_calls_constraint(tools, name, False)
