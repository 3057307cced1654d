"""Response objects of the OpenAI-compatible routes, shaped like OpenAI's.

A text completion is ``object: "text_completion"`` with ``choices[i].text``; a chat
completion ``"chat.completion"`` with ``choices[i].message`` and, streamed,
``"chat.completion.chunk"`` with ``choices[i].delta``. Besides ``usage`` every final
answer carries ``speculation``: what the request's speculation did (from the gRPC
``RequestStats``), and ``seed``: the seed the request was sampled with — its own, or the
random one drawn when it gave none (``null`` under greedy decoding) — which, sent back as
the request's ``seed``, gives the same text whatever the policy, lookahead and load.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from orchestrator.client import Chunk, Completion, TokenLogprob
from orchestrator.http.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs


@dataclass(frozen=True)
class Shaper:
    """Builds the objects of one response; every one shares ``id``, ``created`` and ``model``.

    Args:
        chat: a chat completion (else a text completion).
        model: the model name the response reports.
        policy: the speculation policy spec the request ran with.
        logprobs: the alternatives per token the request asked for (completions ``logprobs``,
            chat ``top_logprobs`` with ``logprobs: true``); ``None``: no logprobs asked.
        echo: a completion that returns its prompt first (its text, and its tokens' logprobs).
        prompt_logprobs: vLLM's ``prompt_logprobs`` asked (not streamed); ``None``: not asked.
    """

    chat: bool
    model: str
    policy: str
    id: str = field(default="")
    created: int = field(default=0)
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}")
        if not self.created:
            object.__setattr__(self, "created", int(time.time()))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def completion(self, result: Completion) -> dict[str, Any]:
        """The whole answer (``stream: false``)."""
        text, entries = self.delta(result, first=True)
        logprobs = self._logprobs(entries)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
            if self.prompt_logprobs is not None:  # vLLM puts them in the choice of a completion
                choice["prompt_logprobs"] = vllm_prompt_logprobs(result.prompt_logprobs, self.prompt_logprobs)
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        if self.chat and self.prompt_logprobs is not None:  # ... and at the top of a chat completion
            body["prompt_logprobs"] = vllm_prompt_logprobs(result.prompt_logprobs, self.prompt_logprobs)
        return {**body, "usage": usage(result.stats), "speculation": speculation(result.stats, self.policy),
                "seed": result.stats.get("seed")}

    def delta(self, event: Chunk | Completion, first: bool) -> tuple[str, list[TokenLogprob]]:
        """The text and logprob entries ``event`` adds to the answer: a streamed chunk's (the first
        one, with ``echo``, after the prompt's), or the whole result's (its generated text, after
        the prompt's with ``echo``; a result streamed without chunks: ``max_tokens: 0``)."""
        text, entries = event.text, list(event.logprobs)
        if first and self.echo:
            text, entries = event.prompt_text + text, list(event.prompt_logprobs) + entries
        return text, entries

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.logprobs)
        return completion_logprobs(entries, self.logprobs, text_offset)

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: str | None = None,
              include_usage: bool = False, logprobs: list[TokenLogprob] | None = None,
              text_offset: int = 0) -> dict[str, Any]:
        """One streamed event with a text delta (or the role, or the finish reason) and, when
        asked, the logprobs of its tokens (``text_offset``: the answer's characters before it)."""
        shaped = self._logprobs(logprobs, text_offset) if logprobs is not None else None
        if self.chat:
            delta = {**({"role": role} if role else {}), **({"content": text} if text is not None else {})}
            choice = {"index": 0, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, result: Completion) -> dict[str, Any]:
        """The last event with ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": usage(result.stats), "speculation": speculation(result.stats, self.policy),
                "seed": result.stats.get("seed")}


def usage(stats: dict) -> dict[str, int]:
    """OpenAI's ``usage`` from the request's stats."""
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("generated_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation(stats: dict, policy: str) -> dict[str, Any]:
    """What speculative decoding did for the request (an extra object next to ``usage``)."""
    return {
        "policy": policy,
        "acceptance_rate": stats.get("acceptance_rate", 0.0),
        "mean_lookahead": stats.get("mean_lookahead", 0.0),
        "iterations": stats.get("iterations", 0),
        "draft_tokens": stats.get("draft_tokens", 0),
        "accepted_tokens": stats.get("accepted_tokens", 0),
        "target_forwards": stats.get("target_forwards", 0),
        "draft_forwards": stats.get("draft_forwards", 0),
        "draft_fallbacks": stats.get("draft_fallbacks", 0),
    }
