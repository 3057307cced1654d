"""The sampling controls that read the token history, applied to logits by the draft and the
target alike (vLLM's semantics and order), so that speculative output stays the target-only
output under the same controls.

A control at a position depends on the tokens before it, so each row of a block is processed
with its own history: row ``j`` of a block whose first row follows ``first`` tokens sees
``tokens[:first + j]`` (the prompt, the committed output and the draft tokens before it), the
history target-only decoding has at that position. The draft processes each of its proposals
with its own history the same way, so an exact draft's proposals are accepted.

*Output tokens* are the tokens from ``output_start`` on: a session's prompt length, less the
output a re-created session holds in its prompt (:attr:`SamplingParams.resumed_tokens`).

The order is vLLM v1's (the structured-output bitmask in the model runner, then its
``Sampler``: ``vllm/v1/sample/sampler.py``), on float32 logits:

0. a structured output's grammar mask (:mod:`disco.speculation.grammar`): every token the
   grammar does not allow after the row's output history is -inf. Should bad words then ban
   every token the grammar allows in a row, that row keeps the grammar's mask alone (the
   output must stay in the grammar);
1. bad words (:func:`ban_bad_words`): the last token of a word's token sequence is banned where
   the output ends with the rest of it;
2. min_tokens (:func:`ban_until_min_tokens`): EOS and ``stop_token_ids`` banned while fewer than
   ``min_tokens`` output tokens precede;
3. logit_bias (:func:`add_logit_bias`): added to the logits;
4. penalties (:func:`apply_penalties`): repetition (prompt + output tokens), then frequency and
   presence (output tokens);
5. greedy decoding takes the argmax here; sampling goes on in
   :func:`disco.speculation.sampling.logits_to_probs`: temperature, min_p (:func:`apply_min_p`),
   top-k, top-p.

Each step is a few vectorized tensor operations over the rows (bad words compare short token
lists on the host first); a request without controls costs one boolean test
(:attr:`SamplingParams.has_logits_controls`). Every value a row gets depends on that row's logits
and history alone (element-wise arithmetic, a row-wise softmax), so a row computes the same bits
in a block of any size, which is what keeps verification equal to decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from disco.config import MAX_BAD_WORD_TOKENS, SamplingParams

if TYPE_CHECKING:
    from disco.speculation.grammar import GrammarState
from disco.errors import InvalidRequest

NEG_INF = float("-inf")
#: Text -> token ids, without special tokens (the target's tokenizer).
Encode = Callable[[str], Sequence[int]]


def tokenize_bad_words(
    words: Sequence[str],
    encode: Encode,
) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``SamplingParams.update_from_tokenizer``: each word's token sequence as written
    (its leading whitespace stripped) and, when it tokenizes to another first token in as many
    tokens, with a leading space (the word inside a text).

    Raises:
        InvalidRequest: a word that tokenizes to nothing, or to more than MAX_BAD_WORD_TOKENS tokens.
    """
    sequences: list[tuple[int, ...]] = []
    for index, word in enumerate(words):
        for prefix in ("", " "):
            ids = tuple(int(token) for token in encode(prefix + word.lstrip()))
            if not ids:
                if not prefix:
                    raise InvalidRequest(f"bad_words[{index}] tokenizes to no token")
                continue
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequest(f"bad_words[{index}] is {len(ids)} tokens long, more than the limit of "
                                     f"{MAX_BAD_WORD_TOKENS}")
            if not prefix or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
    return tuple(dict.fromkeys(sequences))


def apply_logits_controls(
    logits: torch.Tensor,  # [k, vocab] raw logits; row j predicts the token after tokens[:first + j]
    sampling: SamplingParams,
    tokens: Sequence[int],  # the session's tokens, at least first + k - 1 of them
    first: int,  # length of row 0's history
    output_start: int,  # index in tokens of the first output token
    grammar: GrammarState | None = None,  # the session's structured output, when it has one
) -> torch.Tensor:  # [k, vocab] float32: a new tensor, or logits itself when no control is set
    """Steps 0-4 of the module docstring; ``logits`` is never modified in place."""
    if not sampling.has_logits_controls:
        return logits
    penalties = (sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0
                 or sampling.frequency_penalty != 0.0)
    below_min_tokens = sampling.min_tokens > first - output_start  # else min_tokens is met: nothing to ban
    if not (grammar is not None or sampling.bad_words_token_ids or sampling.logit_bias or penalties
            or below_min_tokens):
        return logits
    logits = logits.to(torch.float32, copy=True)
    grammar_masked = None
    if grammar is not None:
        rows = logits.shape[0]
        allowed = grammar.masks(tokens[output_start:first], tokens[first:first + rows - 1], rows)  # [k, vocab]
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
        grammar_masked = logits.clone() if sampling.bad_words_token_ids else None
    if sampling.bad_words_token_ids:
        ban_bad_words(logits, sampling.bad_words_token_ids, tokens, first, output_start)
        if grammar_masked is not None:  # a row left with no token keeps the grammar's mask alone
            emptied = torch.isneginf(logits).all(dim=-1)  # [k]
            logits[emptied] = grammar_masked[emptied]
    if below_min_tokens:
        ban_until_min_tokens(logits, sampling, first - output_start)
    if sampling.logit_bias:
        add_logit_bias(logits, sampling.logit_bias)
    if penalties:
        apply_penalties(logits, sampling, tokens, first, output_start)
    return logits


def ban_bad_words(
    logits: torch.Tensor,  # [k, vocab] float32, modified in place
    bad_words_token_ids: Sequence[Sequence[int]],
    tokens: Sequence[int],
    first: int,
    output_start: int,
) -> None:
    """vLLM's ``apply_bad_words``: for each word's token sequence, its last token is set to -inf
    in a row whose output tokens end with the sequence's other tokens (a one-token word: in
    every row). Only output tokens are matched (a prefix longer than the output never matches)."""
    rows, cols = [], []
    for row in range(logits.shape[0]):
        end = first + row
        output_length = end - output_start
        for word in bad_words_token_ids:
            prefix = len(word) - 1
            if prefix > output_length:
                continue
            if prefix == 0 or list(tokens[end - prefix:end]) == list(word[:prefix]):
                rows.append(row)
                cols.append(word[-1])
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(NEG_INF, device=logits.device))


def ban_until_min_tokens(
    logits: torch.Tensor,  # [k, vocab] float32, modified in place
    sampling: SamplingParams,
    first_output_length: int,  # output tokens before row 0
) -> None:
    """vLLM's min-tokens processor: EOS (``eos_token_ids``, banned even with ``ignore_eos``, as
    vLLM does) and ``stop_token_ids`` are -inf in the rows with fewer than ``min_tokens`` output
    tokens before them (a prefix of the block's rows)."""
    banned = sorted(set(sampling.stop_token_ids) | set(sampling.eos_token_ids))
    below = min(logits.shape[0], max(0, sampling.min_tokens - first_output_length))
    if banned and below:
        logits[:below].index_fill_(1, torch.tensor(banned, device=logits.device), NEG_INF)


def add_logit_bias(
    logits: torch.Tensor,  # [k, vocab] float32, modified in place
    logit_bias: Sequence[tuple[int, float]],  # (token id, bias), ids unique
) -> None:
    """vLLM's logit-bias processor: each bias is added to its token's logit in every row."""
    ids = torch.tensor([token for token, _ in logit_bias], device=logits.device)
    bias = torch.tensor([value for _, value in logit_bias], dtype=torch.float32, device=logits.device)
    logits[:, ids] = logits[:, ids] + bias


def apply_penalties(
    logits: torch.Tensor,  # [k, vocab] float32, modified in place
    sampling: SamplingParams,
    tokens: Sequence[int],
    first: int,
    output_start: int,
) -> None:
    """vLLM's ``apply_penalties``, in its order: the repetition penalty over the prompt and
    output tokens (a positive logit divided by it, another multiplied), then the frequency
    penalty times each output token's count and the presence penalty once per output token,
    subtracted.

    Computed on the tokens of the history only (a few hundred columns, not the vocabulary): row
    ``j`` counts the history's positions before ``first + j``, one cumulative sum over the rows
    of the block."""
    rows = logits.shape[0]
    device = logits.device
    history = torch.tensor(list(tokens[:first + rows - 1]), dtype=torch.long, device=device)  # [n]
    unique, inverse = torch.unique(history, return_inverse=True)  # [u], [n]
    positions = torch.arange(len(history), device=device)  # [n]
    first_row = (positions - first + 1).clamp_(min=0)  # [n]: the first row whose history holds the position
    ones = torch.ones(len(history), device=device)
    # [rows, u]: occurrences of each history token before each row (all, then output tokens only).
    seen = torch.zeros(rows, len(unique), device=device).index_put_((first_row, inverse), ones, accumulate=True)
    seen = seen.cumsum_(0) > 0
    is_output = positions >= output_start
    counts = torch.zeros(rows, len(unique), device=device).index_put_(
        (first_row[is_output], inverse[is_output]), ones[is_output], accumulate=True).cumsum_(0)
    values = logits[:, unique]  # [rows, u]
    if sampling.repetition_penalty != 1.0:
        penalized = torch.where(values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty)
        values = torch.where(seen, penalized, values)
    occurred = counts > 0
    if sampling.frequency_penalty != 0.0:
        values = torch.where(occurred, values - sampling.frequency_penalty * counts, values)
    if sampling.presence_penalty != 0.0:
        values = torch.where(occurred, values - sampling.presence_penalty, values)
    logits[:, unique] = values


def apply_min_p(
    logits: torch.Tensor,  # [..., vocab] float32 logits after temperature
    min_p: float,
) -> torch.Tensor:  # [..., vocab]
    """vLLM's min-p processor: tokens whose probability is below ``min_p`` times the most likely
    token's are set to -inf (the most likely token always stays)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, NEG_INF)
