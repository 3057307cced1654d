"""Structured outputs: the token masks of a grammar, for the draft and the target alike.

A request's :class:`~disco.config.StructuredOutput` (JSON schema, any JSON object, regex,
choice, Lark grammar) becomes an llguidance matcher per session (:class:`GrammarState`). The
mask of a position depends only on the output tokens before it, so the draft and the target
compute the same masks from the same history, and speculative output equals target-only
constrained decoding:

* the draft masks each token it drafts, its history being its own session's tokens;
* the target masks row ``j`` of a verified block with the history ``output + draft[:j]``: it
  advances the matcher through the block's draft tokens (as far as the grammar accepts them;
  rows after a draft token the grammar refuses are never reached, since that token is then
  rejected) and rolls them back after;
* rejected draft tokens are never consumed for good: every call first syncs the matcher to the
  session's committed output (rolling back what differs, consuming what is new), so a block
  the target cut short, a pre-draft thrown away or a re-created session all land on the state
  the output implies.

The grammar engine is llguidance (one ~3 MB wheel; chosen over xgrammar by mask time per token
on the real pair's tokenizer: docs/bench/structured/). Its masks cover the tokenizer's entries;
the model's extra rows (Qwen2.5: 151,936 rows, 151,665 tokens) are never allowed.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Sequence

import numpy as np
import torch

from disco.config import StructuredOutput
from disco.errors import InvalidRequest


#: JSON is written as ``json.dumps`` writes it: ``{"a": 1, "b": [2, 3]}``, one space after each
#: separator and no other whitespace (what instruction-tuned models write unprompted, so drafts
#: agree; and a model cannot pad an answer with whitespace until max_tokens). A schema may
#: override it with its own ``x-guidance`` options.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


#: The tool-call markers of the Qwen2.5 / Hermes chat format.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_FILLER = re.compile(r"\[PAD\d+\]")


def tool_calls_grammar(spec: str, marker_tokens: bool) -> str:
    """Lark: one tool call (or, with ``parallel``, several, one per line) in the Hermes format,
    ``<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>``, the arguments valid
    under the named tool's parameters. ``marker_tokens``: the tokenizer has the markers as
    tokens of their own (Qwen2.5), which llguidance's Lark names as ``<tool_call>``."""
    value = json.loads(spec)
    calls = [{"type": "object", "properties": {"name": {"const": tool["name"]},
                                               "arguments": tool.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in value["tools"]]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_OPTIONS
    open_, close = ((TOOL_CALL_OPEN, TOOL_CALL_CLOSE) if marker_tokens
                    else (json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)))
    start = 'start: call ("\\n" call)*' if value.get("parallel") else "start: call"
    return f'{start}\ncall: {open_} "\\n" arguments "\\n" {close}\narguments: %json {json.dumps(schema)}\n'


def grammar_text(structured: StructuredOutput, marker_tokens: bool = False) -> str:
    """The llguidance grammar of a structured output (nothing compiled yet); ``marker_tokens``:
    see :func:`tool_calls_grammar`."""
    import llguidance  # noqa: PLC0415

    if structured.kind == "tool_calls":
        return llguidance.LLMatcher.grammar_from_lark(tool_calls_grammar(structured.spec, marker_tokens))
    if structured.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(structured.spec, defaults=JSON_OPTIONS)
    if structured.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if structured.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    if structured.kind == "choice":
        # Lark string literals take JSON's escapes: each choice, exactly.
        choices = " | ".join(json.dumps(choice) for choice in json.loads(structured.spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {choices}")
    return llguidance.LLMatcher.grammar_from_lark(structured.spec)


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it (built on the first structured
    request, ~1 s for a 150k vocabulary, then kept), and a matcher per structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits rows
        self.eos_token_ids = [int(token) for token in eos_token_ids]
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # noqa: PLC0415

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer,
                                                               eos_token=self.eos_token_ids or None)
            return self._tokenizer

    @functools.cached_property
    def filler_ids(self) -> tuple[int, ...]:
        """Ids of the vocabulary's filler entries (``[PAD151665]``-style tokens that pad a
        converted tokenizer to the model's rows): llguidance reads them as literal text, so a JSON
        string would allow them; they are never allowed."""
        return tuple(sorted(token_id for token, token_id in self.hf_tokenizer.get_vocab().items()
                            if _FILLER.fullmatch(token)))

    @functools.cached_property
    def marker_tokens(self) -> bool:
        """Whether the tool-call markers are tokens of their own in this tokenizer."""
        vocab = self.hf_tokenizer.get_vocab()
        return TOOL_CALL_OPEN in vocab and TOOL_CALL_CLOSE in vocab

    def start(self, structured: StructuredOutput) -> "GrammarState":
        """A session's matcher; an invalid specification is refused here, before any work."""
        import llguidance  # noqa: PLC0415

        try:
            text = grammar_text(structured, self.marker_tokens)
        except ValueError as error:
            raise InvalidRequest(f"structured output ({structured.kind}): {error}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"structured output ({structured.kind}) is not valid: "
                                 f"{matcher.get_error().splitlines()[0]}")
        return GrammarState(matcher, self.vocab_size, self.eos_token_ids, self.filler_ids)


class GrammarState:
    """A session's matcher and the output tokens it has consumed. An EOS token the grammar
    ends with is not consumed (llguidance refuses tokens once it has stopped): the output has
    ended there, and a position after it (a draft drafting past its own EOS) is unconstrained."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 filler_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.filler_ids = torch.tensor(list(filler_ids), dtype=torch.long)
        self.eos_token_ids = frozenset(int(token) for token in eos_token_ids)
        self.consumed: list[int] = []
        self.ended = False  # the output holds an EOS after what was consumed
        self._lock = threading.Lock()  # the drafting loop and a pre-draft thread of one session

    def masks(self, output: Sequence[int],  # the output tokens before row 0
              draft_tokens: Sequence[int],  # the tokens of rows 0 .. rows - 2 (a verified block's)
              rows: int) -> torch.Tensor:  # [rows, vocab_size] bool: True where the grammar allows
        """Row ``j``'s mask after ``output + draft_tokens[:j]``; rows past a draft token the
        grammar refuses allow every token (that token is rejected, so they are never used)."""
        with self._lock:
            self._sync(output)
            masks = torch.ones((rows, self.vocab_size), dtype=torch.bool)
            if self.ended:
                return masks
            block = [int(token) for token in draft_tokens[:rows - 1]]
            allowed = self.matcher.validate_tokens(block[:self._before_eos(block)])
            advanced = 0
            for row in range(rows):
                masks[row] = self._mask()
                if row >= allowed or row == rows - 1:
                    break
                self.matcher.consume_token(int(draft_tokens[row]))
                advanced += 1
            if advanced and not self.matcher.rollback(advanced):
                raise InvalidRequest(f"structured output: {self.matcher.get_error()}")
            return masks

    def _sync(self, output: Sequence[int]) -> None:
        """Roll back to the longest common prefix of what was consumed and ``output``, then
        consume the rest of ``output``."""
        common = 0
        for mine, theirs in zip(self.consumed, output):
            if mine != theirs:
                break
            common += 1
        if common < len(self.consumed):
            if not self.matcher.rollback(len(self.consumed) - common):
                raise InvalidRequest(f"structured output: {self.matcher.get_error()}")
            del self.consumed[common:]
        rest = [int(token) for token in output[common:]]
        end = self._before_eos(rest)  # an EOS is never consumed: llguidance refuses it once stopped
        valid = self.matcher.validate_tokens(rest[:end]) if end else 0
        if valid < end:
            raise InvalidRequest("the session's output does not follow its structured output's grammar "
                                 f"(token {rest[valid]} after {len(self.consumed) + valid} output tokens)")
        if end and not self.matcher.consume_tokens(rest[:end]):
            raise InvalidRequest(f"structured output: {self.matcher.get_error()}")
        self.consumed.extend(rest[:end])
        self.ended = end < len(rest)

    def _before_eos(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` precede the first EOS (all of them without one)."""
        return next((index for index, token in enumerate(tokens) if token in self.eos_token_ids), len(tokens))

    def _mask(self) -> torch.Tensor:  # [vocab_size] bool
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[:len(allowed)] = torch.from_numpy(allowed)
        mask[self.filler_ids] = False
        return mask


def session_grammar(compiler: GrammarCompiler | None, structured: StructuredOutput | None) -> GrammarState | None:
    """A new session's grammar state (``None`` without a structured output)."""
    if structured is None:
        return None
    if compiler is None:
        raise InvalidRequest("structured outputs need the model's tokenizer, and this engine was built without it")
    return compiler.start(structured)
