"""Tool calling in the Qwen2.5 / Hermes chat format: the constraint that makes a model call
a tool, and the parser that turns its text into OpenAI ``tool_calls``.

The model writes each call as ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``
(what Qwen2.5's chat template tells it in the system turn, and how it renders earlier calls).
``tool_choice`` ``required`` or a named function becomes a ``tool_calls`` structured output
(:func:`tool_calls_constraint`): the draft and the target mask every token outside a valid
call, so the arguments validate against the tool's parameters and speculative output equals
target-only. ``auto`` leaves the model free and parses what it wrote (:func:`parse_tool_calls`);
``none`` parses nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

#: How a template that knows this format names its markers (the parser is picked by them).
HERMES_MARKERS = ("<tool_call>", "</tool_call>")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's ``{"id", "type": "function", "function": {...}}``."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_speaks_hermes(chat_template: str | None) -> bool:
    """Whether a chat template renders tools and calls in the Hermes format (Qwen2.5's does)."""
    return bool(chat_template) and all(marker in chat_template for marker in HERMES_MARKERS)


def tool_calls_constraint(tools: Sequence[dict], name: str | None, parallel: bool) -> tuple[str, str]:
    """The ``(kind, spec)`` structured output that makes the model call a tool: any of
    ``tools`` (``tool_choice: "required"``) or the one ``name``d, one call or (``parallel``)
    several. ``tools`` are OpenAI's tool objects."""
    chosen = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    spec = {"tools": [{"name": function["name"], "parameters": function.get("parameters") or {"type": "object"}}
                      for function in chosen], "parallel": parallel and name is None}
    return "tool_calls", json.dumps(spec)


def parse_tool_calls(text: str, request_id: str) -> tuple[str, list[ToolCall]]:
    """The text outside the calls (the message's content, stripped) and the calls, in order. A call
    whose body is not a JSON object with a string ``name`` stays in the content (as vLLM's
    Hermes parser leaves text it cannot parse). Call ids are derived from the request's id and
    the call's index, so a response is reproducible."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        arguments = body.get("arguments", {})
        digest = hashlib.sha256(f"{request_id}:{len(calls)}".encode()).hexdigest()[:24]
        calls.append(ToolCall(id=f"call_{digest}", name=body["name"],
                              arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    kept.append(text[position:])
    return "".join(kept).strip(), calls


class ToolCallStream:
    """One streamed chat choice whose text may hold tool calls: the content is sent as it
    comes, up to the first ``<tool_call>`` (a text ending with a prefix of the marker is held
    back until the next piece tells); from the marker on, the text is held and parsed at the end
    (:meth:`finish`), as vLLM's Hermes parser streams calls once they are complete."""

    def __init__(self) -> None:
        self.held = ""
        self.in_calls = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held back) that is content to send now."""
        buffer = self.held + text
        if self.in_calls:
            self.held = buffer
            return ""
        at = buffer.find(HERMES_MARKERS[0])
        if at >= 0:
            self.in_calls, self.held = True, buffer[at:]
            return buffer[:at]
        keep = next((k for k in range(len(HERMES_MARKERS[0]) - 1, 0, -1) if buffer.endswith(HERMES_MARKERS[0][:k])), 0)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def finish(self, request_id: str) -> tuple[str, list[ToolCall]]:
        """The content still to send and the calls, at the end of the choice."""
        held, self.held = self.held, ""
        if not self.in_calls:
            return held, []
        content, calls = parse_tool_calls(held, request_id)
        return (content if calls else held), calls
