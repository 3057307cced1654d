"""The target's log-probabilities as the public API returns them (``disco.v1.TokenLogprob``).

The services return ids and values (:class:`disco.interfaces.TokenLogprobs`); the orchestrator,
which holds the tokenizer, adds each token's text as vLLM renders logprob tokens: the id decoded
alone, special tokens kept (:meth:`orchestrator.prompts.Tokenizers.token_texts`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from disco.interfaces import TokenLogprobs
from protos.disco.v1 import orchestrator_pb2

TokenTexts = Callable[[Sequence[int]], list[str]]  # token ids -> each one's text


def logprobs_to_pb(token_ids: Sequence[int], entries: Sequence[TokenLogprobs],
                   texts: TokenTexts) -> list[orchestrator_pb2.TokenLogprob]:
    """One message per token of ``token_ids`` from its entry (as many of both)."""
    assert len(token_ids) == len(entries), (len(token_ids), len(entries))
    rendered = iter(texts([*token_ids, *(token for entry in entries for token in entry.top_token_ids)]))
    messages = [orchestrator_pb2.TokenLogprob(token_id=token, token=next(rendered), logprob=entry.logprob,
                                              rank=entry.rank) for token, entry in zip(token_ids, entries)]
    for message, entry in zip(messages, entries):
        message.top_logprobs.extend(orchestrator_pb2.TopLogprob(token_id=token, token=next(rendered), logprob=value)
                                    for token, value in zip(entry.top_token_ids, entry.top_logprobs))
    return messages


def prompt_logprobs_to_pb(prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs],
                          texts: TokenTexts) -> list[orchestrator_pb2.TokenLogprob]:
    """One message per prompt token: the first without a logprob (nothing precedes it), then
    the entries of tokens ``1 .. n-1``."""
    if not prompt_ids:
        return []
    first = orchestrator_pb2.TokenLogprob(token_id=prompt_ids[0], token=texts([prompt_ids[0]])[0])
    return [first, *logprobs_to_pb(prompt_ids[1:], entries, texts)]
