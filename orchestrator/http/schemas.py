"""Request bodies of the OpenAI-compatible routes, and their mapping to one gRPC
``GenerateRequest`` (the keyword arguments of :func:`orchestrator.client.build_request`).

Fields follow the OpenAI API; ``policy``, ``max_lookahead``, ``top_k`` and ``ignore_eos``
are extra body fields (as vLLM takes extra sampling fields). OpenAI fields this server
does not implement are accepted only at their neutral value, so that a client never gets
silently different behaviour; unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from disco.config import MAX_STOP_CHARS, MAX_STOP_STRINGS
from disco.speculation.policies.spec import MAX_POLICY_SPEC_CHARS

#: OpenAI's default ``max_tokens`` of a text completion (a chat's default is the server's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: OpenAI fields not implemented, accepted only at their neutral value: why each is refused.
UNSUPPORTED = {
    "presence_penalty": "penalties are not supported (they would change the target's distribution)",
    "frequency_penalty": "penalties are not supported (they would change the target's distribution)",
    "logit_bias": "logit_bias is not supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "logprobs": "logprobs are not supported",
    "tools": "tools are not supported",
}


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extra fields of this server.
    policy: str = Field(default="", max_length=MAX_POLICY_SPEC_CHARS,
                        description="speculation stop policy spec (`disco policies`); empty: the server's default")
    max_lookahead: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    # OpenAI fields not implemented: only their neutral value is accepted.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise _refuse(f"only n=1 is supported (one generation per request), got n={n}")
        return n

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """The core's caps (:meth:`disco.config.SamplingParams.validate`), checked here so that a
        long list is refused before it is copied into a gRPC request."""
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise _refuse(f"stop strings: {len(stops)} given, more than the limit of {MAX_STOP_STRINGS}")
        for index, text in enumerate(stops):
            if not text:
                raise _refuse("stop strings must not be empty")
            if len(text) > MAX_STOP_CHARS:
                raise _refuse(f"stop strings must be at most {MAX_STOP_CHARS} characters long; "
                              f"stop[{index}] has {len(text)}")
        return stop

    @field_validator("*")
    @classmethod
    def _neutral_unless_supported(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI fields this server does not implement (:data:`UNSUPPORTED`) are refused
        unless they hold their neutral value (absent, 0, false, empty)."""
        reason = UNSUPPORTED.get(info.field_name or "")
        if reason is not None and value:
            raise _refuse(reason)
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "GenerationRequest":
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        """The :func:`~orchestrator.client.build_request` arguments besides the prompt
        (``None``/empty: the server's default)."""
        return {
            "policy": self.policy,
            "max_lookahead": self.max_lookahead,
            "max_new_tokens": max_tokens,
            "temperature": self.temperature or 0.0,
            "top_p": self.top_p,
            "top_k": self.top_k or 0,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: a raw prompt, as text or token ids (one prompt only)."""

    prompt: Any = Field(description="a string, a list with one string, token ids, or a list with one list "
                                    "of token ids")
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise _refuse("prompt is empty")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _refuse(f"only one prompt per request is supported, got {len(prompt)}")
        raise _refuse("prompt must be a non-empty string or a non-empty list of token ids")

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise _refuse("only best_of=1 is supported")
        return best_of

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~orchestrator.client.build_request`."""
        prompt = self.prompt
        text, ids = (prompt, None) if isinstance(prompt, str) else ("", prompt)
        return {"prompt": text, "prompt_ids": ids, "chat": False, **self.sampling_kwargs(self.max_tokens)}


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are supported."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise _refuse("only text content parts are supported")
        return "".join(part.text or "" for part in self.content)


#: OpenAI's ``developer`` role is the newer name of ``system``; chat templates know ``system``.
ROLE_ALIASES = {"developer": "system"}


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: a conversation (system, user and assistant messages,
    the last one from the user), rendered by the orchestrator with the target's chat
    template (``GenerateRequest.messages``). Tool and function messages are refused.
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _a_conversation(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise _refuse("messages is empty")
        for index, message in enumerate(messages):
            if message.role in ("tool", "function"):
                raise _refuse(f"messages[{index}]: role {message.role!r} is not supported (no tool calling)")
        if messages[-1].role != "user":
            raise _refuse(f"the last message must have role 'user', got {messages[-1].role!r}")
        if not any(message.text().strip() for message in messages):
            raise _refuse("every message is empty")
        return messages

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, response_format: dict | None) -> dict | None:
        if response_format and response_format.get("type", "text") != "text":
            raise _refuse("only response_format {\"type\": \"text\"} is supported")
        return response_format

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~orchestrator.client.build_request`."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        messages = [(ROLE_ALIASES.get(message.role, message.role), message.text()) for message in self.messages]
        return {"messages": messages, **self.sampling_kwargs(max_tokens)}


def validation_param(loc: tuple[Any, ...]) -> str | None:
    """The ``param`` of a validation error at ``loc`` (FastAPI's ``("body", field, ...)``):
    ``messages[0].content``-style, ``None`` for the body as a whole."""
    path = [part for part in loc if part != "body"]
    if not path or not isinstance(path[0], str):
        return None
    param = path[0]
    for part in path[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in ChatMessage.model_fields or part in ContentPart.model_fields:
            param += f".{part}"
        else:  # a union member's name (e.g. "str"): not a field
            break
    return param
