"""Prompts on the public API: their size checked before any tokenizing, and tokenized
without making other requests wait.

A prompt's bytes bound its tokens only loosely, but they are what tokenizing costs (one
to two seconds per MB on one core; a 7.5 MB prompt took 14 s with the test tokenizer).
So the orchestrator refuses a prompt larger than its byte limit before tokenizing it
(by default :func:`default_prompt_byte_limit` of the context); the token limit (the
target's context, ``max_prompt_tokens``) is checked after, as before.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

from disco.engines.in_process import make_decode
from disco.errors import InvalidRequest

#: Default byte limit per token of context: real tokenizers average 3-5 bytes per token on
#: text and code (up to ~6 on CJK text), so 8 refuses no prompt that fits the context.
PROMPT_BYTES_PER_TOKEN = 8
#: The default byte limit is never below this (a tiny context still takes a page of text;
#: the token check refuses what does not fit) ...
MIN_PROMPT_BYTES = 64 * 1024
#: ... nor above this (a model that reports no context, or a huge one: ~15 s of tokenizing).
MAX_DEFAULT_PROMPT_BYTES = 8 * 1024 * 1024
#: Prompts up to this size are encoded on a tokenizer copy of their own (a few ms each), so
#: they never wait behind a long one.
SHORT_PROMPT_BYTES = 16 * 1024
#: Tokenizer copies for longer prompts: as many are tokenized at once, the others wait.
LONG_PROMPT_ENCODERS = 2


def prompt_bytes(prompt: str, messages: Sequence[tuple[str, str]] = ()) -> int:
    """UTF-8 bytes of a prompt, or of a conversation's contents."""
    if messages:
        return sum(len(content.encode("utf-8", "surrogatepass")) for _, content in messages)
    return len(prompt.encode("utf-8", "surrogatepass"))


def default_prompt_byte_limit(context_tokens: int) -> int:
    """The byte limit of prompts for a context of ``context_tokens``."""
    return min(max(PROMPT_BYTES_PER_TOKEN * context_tokens, MIN_PROMPT_BYTES), MAX_DEFAULT_PROMPT_BYTES)


def check_prompt_bytes(size: int, limit: int) -> None:
    """Refuse a prompt of ``size`` bytes above ``limit``.

    Raises:
        InvalidRequest: naming the size and the limit.
    """
    if size > limit:
        raise InvalidRequest(f"prompt is {size} bytes (UTF-8), more than the limit of {limit} bytes on this "
                             "server; it was not tokenized")


def check_fits_context(prompt_tokens: int, max_new_tokens: int, max_context: int) -> None:
    """Refuse a request the target would refuse, before its ids are sent to both services
    (``max_context`` 0: unknown, not checked).

    Raises:
        InvalidRequest: in the target's words.
    """
    if max_context and prompt_tokens + max_new_tokens > max_context:
        raise InvalidRequest(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the target model's context of {max_context} tokens")


class Tokenizers:
    """Copies of one tokenizer, so that tokenizing a long prompt holds up no other request.

    NOTE: a Hugging Face fast tokenizer must not be shared across threads (transformers
    re-sets the Rust tokenizer's truncation and padding on a call, which fails with
    "Already borrowed" while another thread encodes), so each use below has copies of its
    own (``copy.deepcopy``: a new Rust tokenizer; for a 150k-token vocabulary about 0.7 s
    and 32 MB each, made once, here):

    * streams decode a few tokens per call on one copy, under a lock (as do the token texts
      of logprobs and an echoed prompt, :meth:`token_texts` and :meth:`render`);
    * prompts up to :data:`SHORT_PROMPT_BYTES` are encoded on one copy, under a lock;
    * longer ones on one of :data:`LONG_PROMPT_ENCODERS` copies, waiting while all are busy.

    Encoding releases the GIL, so nothing else waits while a long prompt is tokenized.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, long_encoders: int = LONG_PROMPT_ENCODERS) -> None:
        self._decoder = copy.deepcopy(tokenizer)
        self._decode = make_decode(self._decoder)
        self._decode_lock = threading.Lock()
        self._token_texts: dict[int, str] = {}  # at most the vocabulary
        self._short = copy.deepcopy(tokenizer)
        self._short_lock = threading.Lock()
        self._long: queue.SimpleQueue[PreTrainedTokenizerBase] = queue.SimpleQueue()
        for _ in range(long_encoders):
            self._long.put(copy.deepcopy(tokenizer))

    @contextmanager
    def encoder(self, prompt_bytes: int) -> Iterator[PreTrainedTokenizerBase]:
        """A tokenizer for a prompt of ``prompt_bytes``, that no other thread uses until the block ends."""
        if prompt_bytes <= SHORT_PROMPT_BYTES:
            with self._short_lock:
                yield self._short
            return
        tokenizer = self._long.get()
        try:
            yield tokenizer
        finally:
            self._long.put(tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._decode_lock:
            return self._decode(token_ids)

    def render(self, token_ids: Sequence[int]) -> str:
        """The ids as text with their special tokens (an echoed prompt given as ids)."""
        with self._decode_lock:
            return self._decoder.decode(list(token_ids), skip_special_tokens=False)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each id alone as text, special tokens kept: how vLLM renders the tokens of logprobs
        (a token inside a multi-byte character gives U+FFFD). Cached per id."""
        missing = {token for token in token_ids if token not in self._token_texts}
        if missing:
            with self._decode_lock:
                for token in missing:
                    self._token_texts[token] = self._decoder.decode([token], skip_special_tokens=False) or ""
        return [self._token_texts[token] for token in token_ids]


def conversation_from_pb(messages: Sequence, tools_json: str) -> tuple[list[dict], list[dict] | None]:
    """A request's ``ChatMessage`` list and ``tools_json`` as the chat template takes them:
    OpenAI's message dicts (an assistant's ``tool_calls`` with each ``arguments`` parsed into a
    JSON object, as templates render it) and the tools.

    Raises:
        InvalidRequest: naming the message or field that is not what the contract says.
    """
    conversation = []
    for index, message in enumerate(messages):
        turn: dict = {"role": message.role, "content": message.content}
        if message.tool_calls_json:
            turn["tool_calls"] = _tool_calls(message.tool_calls_json, index)
        if message.tool_call_id:
            turn["tool_call_id"] = message.tool_call_id
        if message.name:
            turn["name"] = message.name
        conversation.append(turn)
    tools = None
    if tools_json:
        tools = _json(tools_json, "tools_json")
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise InvalidRequest("tools_json must be a JSON array of tool objects")
    return conversation, tools


def conversation_bytes(messages: Sequence, tools_json: str) -> int:
    """What a conversation's size check counts: contents, tool calls and the tools (UTF-8)."""
    return (prompt_bytes("", [(m.role, m.content) for m in messages]) + len(tools_json.encode("utf-8"))
            + sum(len(m.tool_calls_json.encode("utf-8")) for m in messages))


def _tool_calls(text: str, index: int) -> list[dict]:
    calls = _json(text, f"messages[{index}].tool_calls_json")
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{index}].tool_calls_json must be a JSON array")
    out = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"messages[{index}].tool_calls[{number}] needs a function with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json(arguments or "{}", f"messages[{index}].tool_calls[{number}].function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _json(text: str, field: str):
    try:
        return json.loads(text)
    except ValueError as error:
        raise InvalidRequest(f"{field} is not valid JSON: {error}") from None
