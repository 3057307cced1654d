"""The sampling controls of the OpenAI routes (vLLM's fields): the bounds of the fields pydantic
cannot express, checked before a request is built (the core's limits, :mod:`disco.config`; the
vocabulary is the orchestrator's check), and their :func:`~orchestrator.client.build_request`
arguments. The semantics: docs/exactness.md, "Sampling controls"."""

from __future__ import annotations

import math
from typing import Any, Callable

from pydantic_core import PydanticCustomError

from disco.config import LOGIT_BIAS_LIMIT, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS
from orchestrator.http.errors import invalid

#: Largest token id the gateway passes on (the gRPC fields are int32; the orchestrator checks the vocabulary).
MAX_TOKEN_ID = 2**31 - 1


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def check_logit_bias(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's shape: token ids as strings, biases in [-100, 100], at most MAX_LOGIT_BIAS."""
    entries = logit_bias or {}
    if len(entries) > MAX_LOGIT_BIAS:
        raise _refuse(f"{len(entries)} entries, more than the limit of {MAX_LOGIT_BIAS}")
    for key, bias in entries.items():
        if not key.strip().isdigit() or int(key) > MAX_TOKEN_ID:
            raise _refuse(f"keys must be token ids (integers >= 0, as strings), got {key!r}")
        if not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
            raise _refuse(f"the bias of token {key} must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                          f"got {bias}")
    if len({int(key) for key in entries}) != len(entries):
        raise _refuse("a token id appears twice")
    return logit_bias


def check_stop_token_ids(ids: list[int] | None) -> list[int] | None:
    if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
        raise _refuse(f"{len(ids)} token ids, more than the limit of {MAX_STOP_TOKEN_IDS}")
    if ids is not None and any(not 0 <= token <= MAX_TOKEN_ID for token in ids):
        raise _refuse("token ids must be integers >= 0 in the vocabulary")
    return ids


def check_bad_words(words: list[str] | None) -> list[str] | None:
    if len(words or ()) > MAX_BAD_WORDS:
        raise _refuse(f"{len(words)} given, more than the limit of {MAX_BAD_WORDS}")
    for index, word in enumerate(words or ()):
        if not word.strip():
            raise _refuse(f"bad_words[{index}] is empty")
        if len(word) > MAX_STOP_CHARS:
            raise _refuse(f"bad_words must be at most {MAX_STOP_CHARS} characters long; bad_words[{index}] "
                          f"has {len(word)}")
    return words


#: The checks by field (a pydantic field validator of the request classes calls them).
CHECKS: dict[str, Callable[[Any], Any]] = {"logit_bias": check_logit_bias, "stop_token_ids": check_stop_token_ids,
                                           "bad_words": check_bad_words}


def control_kwargs(body: Any, max_tokens: int) -> dict[str, Any]:
    """The sampling controls' :func:`~orchestrator.client.build_request` arguments of a request body
    (:class:`~orchestrator.http.schemas.GenerationRequest`; ``None``: the neutral value).

    Raises:
        ApiError: ``min_tokens`` above the request's ``max_tokens`` (a 400 naming it).
    """
    if body.min_tokens and body.min_tokens > max_tokens:
        raise invalid(f"min_tokens must be <= max_tokens ({max_tokens}), got {body.min_tokens}", "min_tokens")
    return {
        "stop_token_ids": list(body.stop_token_ids or ()),
        "min_tokens": body.min_tokens or 0,
        "include_stop_str_in_output": bool(body.include_stop_str_in_output),
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "logit_bias": {int(key): bias for key, bias in (body.logit_bias or {}).items()},
        "min_p": body.min_p or 0.0,
        "bad_words": list(body.bad_words or ()),
    }
