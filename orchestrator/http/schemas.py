"""Request bodies of the OpenAI-compatible routes, and their mapping to one gRPC
``GenerateRequest`` (the keyword arguments of :func:`orchestrator.client.build_request`).

No field is ever ignored silently. Every field of OpenAI's and vLLM's completions and chat
completions requests is declared here, as one of three kinds (docs/http.md has the table):

* **applied**: mapped onto the gRPC request (``prompt``, ``max_tokens``, ``temperature``,
  ...; ``policy``, ``max_lookahead``, ``top_k`` and ``ignore_eos`` are extra body fields,
  as vLLM takes extra sampling fields, and so are vLLM's sampling controls ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``bad_words``, ...);
* **no effect by definition**: accepted with any value because it cannot change the output
  (``user``, ``metadata``, ``cache_salt``, ...);
* **not supported yet** (:attr:`Strict.NOT_YET`): accepted only at its neutral value, the
  one that changes nothing (``suffix: ""``, ``use_beam_search: false``, ...);
  any other value is a 400 naming the field.

Several outputs per request (``n``, completions' ``best_of`` and list of prompts) are one gRPC
request per output: :meth:`GenerationRequest.generate_kwargs` gives one per prompt and
:mod:`orchestrator.http.choices` fans them out.

A field that is in neither API is a 400 naming it (``extra="forbid"``), as OpenAI answers
an unrecognized argument.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from disco.config import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, PENALTY_LIMIT, SamplingParams
from disco.speculation.policies.spec import MAX_POLICY_SPEC_CHARS
from orchestrator.http.controls import CHECKS, control_kwargs
from orchestrator.http.errors import invalid
from orchestrator.http.structured import structured_kwargs

#: OpenAI's default ``max_tokens`` of a text completion (also when it is sent as ``null``).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: The default ``max_tokens`` of a chat completion: the server's (``SamplingParams``).
CHAT_DEFAULT_MAX_TOKENS = SamplingParams.max_new_tokens
#: ``request_id``: becomes the response's ``id`` and appears in the log, so it is kept short and plain.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
#: The message of a field that is in neither OpenAI's nor vLLM's API (OpenAI's wording).
UNRECOGNIZED = "Unrecognized request argument supplied: {name}"


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _render(values: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(value) for value in values)


class Strict(BaseModel):
    """A request object: unknown fields are refused, and the fields this server does not
    implement yet (:attr:`NOT_YET`: field -> its neutral values) are refused unless they
    hold a neutral value (checked only for the fields the client sent)."""

    model_config = ConfigDict(extra="forbid")
    NOT_YET: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @field_validator("*")
    @classmethod
    def _neutral_unless_supported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = cls.NOT_YET.get(info.field_name or "")
        if neutral is not None and value not in neutral:
            raise _refuse(f"not supported yet; accepted only at its neutral value {_render(neutral)}, "
                          "which changes nothing")
        return value


class StreamOptions(Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    NOT_YET = {"continuous_usage_stats": (None, False)}

    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # no effect: padding against a side channel, not output
    continuous_usage_stats: bool | None = None  # vLLM: usage in every chunk


#: Neutral values of the sampling and output fields both routes share (vLLM's names).
SHARED_NOT_YET: dict[str, tuple[Any, ...]] = {
    "allowed_token_ids": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "priority": (None, 0),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
}


class GenerationRequest(Strict):
    """The fields completions and chat completions share."""

    NOT_YET = SHARED_NOT_YET

    # Applied.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    request_id: str | None = Field(default=None, pattern=REQUEST_ID_PATTERN,
                                   description="the response's id is `cmpl-`/`chatcmpl-` and this")
    # Applied, extra fields of this server (as vLLM takes extra sampling fields).
    policy: str = Field(default="", max_length=MAX_POLICY_SPEC_CHARS,
                        description="speculation stop policy spec (`disco policies`); empty: the server's default")
    max_lookahead: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1: off (vLLM's -1 is 0 on the gRPC side)")
    ignore_eos: bool | None = False
    # Applied: the sampling controls (vLLM's; the draft and the target apply them alike).
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                             description="vLLM's: over prompt and output tokens; 1: off")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (a string) -> bias in [-100, 100]")
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                        description="vLLM's: the prompt tokens' logprobs (not streamed)")
    # Applied by completions; chat: not supported yet (its NOT_YET: vLLM's chat echo is another thing).
    echo: bool | None = None
    # Applied: several outputs (orchestrator.http.choices); best_of: completions only (chat's NOT_YET).
    n: int | None = Field(default=None, ge=1, description="outputs per prompt, each its own generation")
    best_of: int | None = Field(default=None, ge=1, description="completions: candidates per prompt, the n with "
                                                                 "the highest summed target logprob returned")
    # No effect on the output, by definition: accepted with any value.
    user: str | None = None
    cache_salt: str | None = None  # vLLM: salts its prefix cache; disco shares no cache between requests
    # Not supported yet (NOT_YET): only their neutral value is accepted.
    allowed_token_ids: list[int] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    priority: int | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

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

    @field_validator("logit_bias", "stop_token_ids", "bad_words")
    @classmethod
    def _bounded_controls(cls, value: Any, info: ValidationInfo) -> Any:
        """The sampling controls' bounds (:mod:`orchestrator.http.controls`)."""
        return CHECKS[info.field_name or ""](value)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "GenerationRequest":
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The ``max_tokens`` the client asked for (``None``: none, or ``null``) and the
        field that holds it."""
        return self.max_tokens, "max_tokens"

    def default_max_tokens(self) -> int:
        """``max_tokens`` when the request gives none."""
        raise NotImplementedError

    def logprobs_asked(self) -> int | None:
        """The alternatives per generated token the response shows (``None``: no logprobs)."""
        raise NotImplementedError

    def best_of_asked(self) -> int | None:
        """Candidates per prompt, of which the ``n`` best are returned (``None``: ``n``); chat has none."""
        return None

    def check_logprob_fields(self) -> None:
        """Refuse what cannot be combined (a 400 naming the field); the ranges are the fields'.

        Raises:
            ApiError: vLLM's ``prompt_logprobs`` with ``stream: true`` (as vLLM refuses it).
        """
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("prompt_logprobs: not available with stream=true (as in vLLM)", "prompt_logprobs")

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """The :func:`~orchestrator.client.build_request` arguments besides the prompt
        (``None``/empty: the server's default)."""
        self.check_logprob_fields()
        return {
            "logprobs": self.logprobs_asked(),
            "prompt_logprobs": self.prompt_logprobs,
            "policy": self.policy,
            "max_lookahead": self.max_lookahead,
            "max_new_tokens": max_tokens,
            "temperature": self.temperature or 0.0,
            "top_p": self.top_p,
            "top_k": max(self.top_k or 0, 0),  # vLLM's "off" (-1) is 0 on the gRPC side
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            "ignore_eos": bool(self.ignore_eos),
            **control_kwargs(self, max_tokens),
            **structured_kwargs(self, chat=isinstance(self, ChatCompletionRequest)),
        }


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: raw prompts, as text or token ids (``prompt``: kept as a list)."""

    NOT_YET = {**SHARED_NOT_YET, "suffix": (None, ""), "prompt_embeds": (None,), "add_special_tokens": (None, True)}

    prompt: Any = Field(description="a string, a list of strings, token ids, or a list of lists of token ids")
    max_tokens: int | None = Field(default=None, ge=0, description="0 only with echo: the prompt scored")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="the sampled token's logprob and this many alternatives")
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """The prompts, as a list: a string, token ids, or a list of either (OpenAI's four forms, not
        mixed). Only a truly empty prompt is refused (whitespace is a prompt: it has tokens)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt or not (
                all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
            raise _refuse("prompt must be a non-empty string, a list of strings, a non-empty list of token ids "
                          "or a list of lists of token ids")
        for index, one in enumerate(prompt):
            where = "" if len(prompt) == 1 else f"prompt[{index}] "
            if isinstance(one, str) and not one:
                raise _refuse(f"{where or 'prompt '}is empty")
            if isinstance(one, list) and not (one and all(_is_token_id(t) for t in one)):
                raise _refuse(f"{where or 'prompt '}must be a non-empty list of token ids")
        return prompt

    def default_max_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def best_of_asked(self) -> int | None:
        return self.best_of

    def generate_kwargs(self, max_tokens: int) -> list[dict[str, Any]]:
        """The keyword arguments of :func:`~orchestrator.client.build_request`, one per prompt. With
        ``echo`` the server returns the prompt's text and, with ``logprobs``, its tokens' logprobs;
        ``max_tokens: 0`` (echo only) scores the prompt without generating.

        Raises:
            ApiError: ``max_tokens: 0`` without ``echo``.
        """
        if max_tokens == 0 and not self.echo:
            raise invalid("max_tokens must be >= 1 (0 only with echo: the prompt is scored, nothing is "
                          "generated)", "max_tokens")
        sampling = self.sampling_kwargs(max_tokens)
        if self.echo:
            # The prompt's logprobs as many as the echoed tokens show (and vLLM's field asks);
            # NOTE: max_tokens 0 is prompt scoring, for which the server computes them in any case.
            asked = [n for n in (sampling["prompt_logprobs"], self.logprobs, 0 if max_tokens == 0 else None)
                     if n is not None]
            sampling.update(echo=True, prompt_logprobs=max(asked) if asked else None)
        return [{"prompt": prompt, "prompt_ids": None, "chat": False, **sampling} if isinstance(prompt, str)
                else {"prompt": "", "prompt_ids": prompt, "chat": False, **sampling} for prompt in self.prompt]


class ContentPart(Strict):
    """One part of a message's content; only ``text`` parts are supported yet."""

    type: str
    text: str | None = None
    # The other parts' payloads (OpenAI's, then vLLM's): refused with their `type`.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None
    audio_url: Any = None
    video_url: Any = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise _refuse(f"not supported yet: content parts of type {kind!r} (only 'text' parts are)")
        return kind


class ChatMessage(Strict):
    """One message of a conversation (OpenAI's fields: an assistant's ``tool_calls``, a tool's
    ``tool_call_id``; ``name`` is given to the template)."""

    NOT_YET = {"function_call": (None,), "audio": (None,), "refusal": (None,)}

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message for the gRPC request (OpenAI's names; ``developer`` is ``system``)."""
        message: dict[str, Any] = {"role": ROLE_ALIASES.get(self.role, self.role), "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


#: OpenAI's ``developer`` role is the newer name of ``system``; chat templates know ``system``.
ROLE_ALIASES = {"developer": "system"}


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: a conversation (system, user, assistant and tool messages,
    the last one a user's or a tool's, or an assistant's to continue), rendered by the
    orchestrator with the target's chat template (``GenerateRequest.messages``), with ``tools``
    (:mod:`orchestrator.http.structured`). The deprecated ``functions`` and ``function`` messages
    are refused.
    """

    NOT_YET = {**SHARED_NOT_YET, "best_of": (None, 1), "echo": (None, False),
               "functions": (None, []), "function_call": (None, "none"),
               "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
               "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
               "service_tier": (None, "auto", "default"), "store": (None, False),
               "add_special_tokens": (None, False), "documents": (None,), "chat_template": (None,),
               "chat_template_kwargs": (None, {}), "include_reasoning": (None, True)}

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # No effect on the output, by definition: accepted with any value.
    metadata: dict[str, str] | None = None  # tags of a stored completion (nothing is stored)
    # Applied: tools (orchestrator.http.structured), continuing the last assistant message (vLLM's).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None  # false only with continue_final_message
    continue_final_message: bool | None = None
    prompt_cache_key: str | None = None  # OpenAI's cache routing hint
    safety_identifier: str | None = None  # an end-user id, like `user`
    logprobs: bool | None = None  # the generated tokens' logprobs, with top_logprobs alternatives each
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Not supported yet (NOT_YET): only their neutral value is accepted.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    service_tier: str | None = None
    store: bool | None = None
    add_special_tokens: bool | None = None
    documents: Any = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None

    @field_validator("messages")
    @classmethod
    def _a_conversation(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise _refuse("messages is empty")
        for index, message in enumerate(messages):
            if message.role == "function":
                raise _refuse(f"messages[{index}]: role 'function' is not supported (use tool messages)")
        if not any(message.text() or message.tool_calls for message in messages):
            raise _refuse("every message is empty")
        return messages

    def check_turn(self) -> None:
        """The conversation ends where the model answers: a user's or a tool's message, or an
        assistant's to continue (a 400 naming the field)."""
        last = self.messages[-1].role
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise invalid("continue_final_message and add_generation_prompt cannot both be true (as in vLLM)",
                              "continue_final_message")
            if last != "assistant":
                raise invalid(f"continue_final_message needs an assistant message last, got {last!r}", "messages")
        elif self.add_generation_prompt is False:
            raise invalid("add_generation_prompt: false is supported only with continue_final_message: true",
                          "add_generation_prompt")
        elif last not in ("user", "tool"):
            raise invalid(f"the last message must have role 'user' or 'tool' (or 'assistant' with "
                          f"continue_final_message), got {last!r}", "messages")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def default_max_tokens(self) -> int:
        return CHAT_DEFAULT_MAX_TOKENS

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_logprob_fields(self) -> None:
        """Also: ``top_logprobs`` above 0 needs ``logprobs: true`` (OpenAI's rule; 0 or null changes
        nothing, so it is accepted without)."""
        super().check_logprob_fields()
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs: needs logprobs: true", "top_logprobs")

    def generate_kwargs(self, max_tokens: int) -> list[dict[str, Any]]:
        """The keyword arguments of :func:`~orchestrator.client.build_request` (one conversation)."""
        self.check_turn()
        messages = [message.as_dict() for message in self.messages]
        return [{"messages": messages, "continue_final_message": bool(self.continue_final_message),
                 **self.sampling_kwargs(max_tokens)}]


#: Fields of the nested request objects, which a ``param`` path goes through.
_NESTED_FIELDS = frozenset({*ChatMessage.model_fields, *ContentPart.model_fields, *StreamOptions.model_fields})


def validation_param(loc: tuple[Any, ...], unrecognized: bool = False) -> str | None:
    """The ``param`` of a validation error at ``loc`` (FastAPI's ``("body", field, ...)``):
    ``messages[0].content``-style, ``None`` for the body as a whole. Union members' names
    (``str``, ``list[ContentPart]``) and dict keys are left out; with ``unrecognized`` the
    last part is an unknown field's name and is kept."""
    path = [part for part in loc if part != "body"]
    if not path or not isinstance(path[0], str):
        return None
    param = path[0]
    for index, part in enumerate(path[1:], start=1):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _NESTED_FIELDS or (unrecognized and index == len(path) - 1):
            param += f".{part}"
    return param
