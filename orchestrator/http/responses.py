"""Response objects of the OpenAI-compatible routes, shaped like OpenAI's.

A text completion is ``object: "text_completion"`` with ``choices[i].text``; a chat
completion ``"chat.completion"`` with ``choices[i].message`` and, streamed,
``"chat.completion.chunk"`` with ``choices[i].delta``. Besides ``usage`` every final
answer carries ``speculation``: what the request's speculation did (from the gRPC
``RequestStats``), and ``seed``: the seed the request was sampled with — its own, or the
random one drawn when it gave none (``null`` under greedy decoding) — which, sent back as
the request's ``seed``, gives the same text whatever the policy, lookahead and load.

An answer of several generations (``n``, ``best_of``, a list of prompts:
:mod:`orchestrator.http.choices`) has one choice per output (``index`` 0, 1, ...): each
choice also carries its own ``seed`` and ``speculation``, while ``usage`` and the top-level
``speculation`` add up every generation (``best_of``'s candidates included).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from orchestrator.client import Chunk, Completion, TokenLogprob
from orchestrator.http.choices import Outputs
from orchestrator.http.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from orchestrator.tools import parse_tool_calls


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
    tools: bool = False  # a chat answer's text is parsed for tool calls (orchestrator.tools)

    def call_id(self, index: int) -> str:
        """The request id the tool call ids of choice ``index`` derive from."""
        return f"{self.id}-{index}"

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}")
        if not self.created:
            object.__setattr__(self, "created", int(time.time()))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def completion(self, outputs: Outputs) -> dict[str, Any]:
        """The whole answer (``stream: false``)."""
        choices = [self._choice(result, index, outputs.several) for index, result in enumerate(outputs.choices)]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and self.prompt_logprobs is not None:  # vLLM's: at the top of a chat completion
            body["prompt_logprobs"] = vllm_prompt_logprobs(outputs.choices[0].prompt_logprobs, self.prompt_logprobs)
        return {**body, **self._totals(outputs)}

    def _choice(self, result: Completion, index: int, several: bool) -> dict[str, Any]:
        text, entries = self.delta(result, first=True)
        logprobs = self._logprobs(entries)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = result.finish_reason
            if self.tools:
                content, calls = parse_tool_calls(text, self.call_id(index))
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [call.to_openai() for call in calls]}
                    finish_reason = "tool_calls"
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
            if self.prompt_logprobs is not None:  # vLLM puts them in the choice of a completion
                choice["prompt_logprobs"] = vllm_prompt_logprobs(result.prompt_logprobs, self.prompt_logprobs)
        return {**choice, **(self.own(result) if several else {})}

    def own(self, result: Completion) -> dict[str, Any]:
        """What one output of several reports of itself: its ``seed`` and ``speculation``."""
        return {"seed": result.stats.get("seed"), "speculation": speculation(result.stats, self.policy)}

    def _totals(self, outputs: Outputs) -> dict[str, Any]:
        stats = combined_stats([result.stats for result in outputs.generated])
        return {"usage": usage({**stats, "prompt_tokens": outputs.prompt_tokens}),
                "speculation": speculation(stats, self.policy), "seed": outputs.seed}

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
              text_offset: int = 0, index: int = 0, own: dict[str, Any] | None = None,
              tool_calls: list[dict] | None = None) -> dict[str, Any]:
        """One streamed event of choice ``index`` with a text delta (or the role, or the finish
        reason, with ``own``: what one output of several reports of itself) and, when asked, the
        logprobs of its tokens (``text_offset``: the choice's characters before it)."""
        shaped = self._logprobs(logprobs, text_offset) if logprobs is not None else None
        if self.chat:
            delta = {**({"role": role} if role else {}), **({"content": text} if text is not None else {}),
                     **({"tool_calls": tool_calls} if tool_calls else {})}
            choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}
        choice.update(own or {})
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, outputs: Outputs) -> dict[str, Any]:
        """The last event with ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, **self._totals(outputs)}


def usage(stats: dict) -> dict[str, int]:
    """OpenAI's ``usage`` from the request's stats."""
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("generated_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


#: The counts of :func:`speculation` that several generations add up.
SUMMED_STATS = ("generated_tokens", "iterations", "draft_tokens", "accepted_tokens", "target_forwards",
                "draft_forwards", "draft_fallbacks")


def combined_stats(stats: list[dict]) -> dict:
    """The stats of several generations as one: counts added up, the rates recomputed from them
    (one generation's: unchanged)."""
    if len(stats) == 1:
        return stats[0]
    total = {key: sum(int(one.get(key, 0)) for one in stats) for key in SUMMED_STATS}
    draft, iterations = total["draft_tokens"], total["iterations"]
    return {**total, "acceptance_rate": round(total["accepted_tokens"] / draft, 6) if draft else 0.0,
            "mean_lookahead": round(draft / iterations, 4) if iterations else 0.0}


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
