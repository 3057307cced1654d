"""The target's log-probabilities in OpenAI's shapes (and vLLM's ``prompt_logprobs``).

The orchestrator sends each position's entry with its token's text (the id decoded alone,
special tokens kept, as vLLM renders them: :class:`orchestrator.client.TokenLogprob`); these
functions only arrange them:

* completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``, where each
  ``top_logprobs`` item maps the position's own token and its ``logprobs`` most likely
  alternatives to their logprobs (up to ``logprobs + 1`` keys; ``null`` for the first prompt
  token), and ``text_offset`` adds up the tokens' texts from the offset of the event (vLLM's);
* chat ``logprobs.content``: ``[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``
  with ``top_logprobs`` most likely tokens, ``bytes`` the token text's UTF-8;
* vLLM's ``prompt_logprobs``: ``[null, {"<token id>": {logprob, rank, decoded_token}, ...}, ...]``.

``-inf`` (a token the model rules out) is not JSON: it is sent as :data:`JSON_LOGPROB_FLOOR`,
as vLLM does.
"""

from __future__ import annotations

from typing import Any, Sequence

from orchestrator.client import TokenLogprob

JSON_LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, JSON_LOGPROB_FLOOR)


def completion_logprobs(entries: Sequence[TokenLogprob], top_n: int, text_offset: int = 0) -> dict[str, Any]:
    """The ``logprobs`` of a text completion (or of one streamed event of it)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry.token)
        offsets.append(text_offset)
        text_offset += len(entry.token)
        if entry.logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_value(entry.logprob))
        top = {entry.token: _value(entry.logprob)}
        for alternative in entry.top_logprobs[:top_n]:
            top[alternative.token] = _value(alternative.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], top_n: int) -> dict[str, Any]:
    """The ``logprobs`` of a chat completion choice (or of one streamed event of it)."""
    content = []
    for entry in entries:
        item = _chat_token(entry.token, entry.logprob if entry.logprob is not None else JSON_LOGPROB_FLOOR)
        item["top_logprobs"] = [_chat_token(top.token, top.logprob) for top in entry.top_logprobs[:top_n]]
        content.append(item)
    return {"content": content}


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob], top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: ``null``) its own entry and its
    position's ``top_n`` most likely tokens, keyed by token id."""
    shaped: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry.logprob is None:
            shaped.append(None)
            continue
        position = {str(entry.token_id): {"logprob": _value(entry.logprob), "rank": entry.rank,
                                          "decoded_token": entry.token}}
        for rank, top in enumerate(entry.top_logprobs[:top_n], start=1):
            position.setdefault(str(top.token_id), {"logprob": _value(top.logprob), "rank": rank,
                                                    "decoded_token": top.token})
        shaped.append(position)
    return shaped
