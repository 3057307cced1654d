"""Building the in-process path: load the pair, wrap it in engines, hand both to the loop."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from disco.config import ModelConfig, PairConfig
from disco.engines.draft import DraftEngine
from disco.engines.target import TargetEngine
from disco.errors import InvalidRequest
from disco.models.loading import LoadedModel, check_same_vocabulary, load_model
from disco.speculation.cost_model import CostModel
from disco.speculation.detokenize import Decode
from disco.speculation.grammar import GrammarCompiler
from disco.speculation.logits_processors import Encode
from disco.speculation.loop import SpeculativeGenerator
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.spec import LearnedPolicyLoader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalPipeline:
    generator: SpeculativeGenerator
    tokenizer: PreTrainedTokenizerBase
    target: LoadedModel
    draft: LoadedModel | None


def make_decode(tokenizer: PreTrainedTokenizerBase) -> Decode:
    def decode(token_ids: Sequence[int]) -> str:
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)
    return decode


def make_encode(tokenizer: PreTrainedTokenizerBase) -> Encode:
    """Text -> token ids without special tokens (a request's bad words)."""
    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return encode


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool) -> list[int]:
    """Token ids of a raw completion prompt, or of a one-message chat with the
    tokenizer's chat template and the assistant turn opened (``--chat``)."""
    if not prompt:
        raise InvalidRequest("prompt is empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}],
                           "--chat needs a tokenizer with a chat template, and this one has none")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


#: Roles a conversation may use (what chat templates render).
CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of a conversation of ``(role, content)`` messages (:func:`encode_conversation`)."""
    return encode_conversation(tokenizer, [{"role": role, "content": content} for role, content in messages])


def encode_conversation(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict],
                        tools: Sequence[dict] | None = None, continue_final: bool = False) -> list[int]:
    """Token ids of a conversation, checked: known roles, some content, and the last message
    a user's or a tool's (the assistant turn is opened after it) or, with ``continue_final``,
    an assistant's (continued: not closed, no new turn). Messages are OpenAI's: ``role``,
    ``content``, an assistant's ``tool_calls`` (``function.arguments`` as a JSON object, as
    templates render it), a tool's ``tool_call_id`` and ``name``. ``tools``: OpenAI's tool
    objects, given to the template."""
    for index, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, "
                                 f"got {message['role']!r}")
    if not any(message.get("content") or message.get("tool_calls") for message in messages):
        raise InvalidRequest("prompt is empty: every message's content is empty")
    last = messages[-1]["role"]
    if continue_final and last != "assistant":
        raise InvalidRequest(f"continue_final_message needs an assistant message last, got {last!r}")
    if not continue_final and last not in ("user", "tool"):
        raise InvalidRequest(f"the last message must have role 'user' or 'tool' (or 'assistant' with "
                             f"continue_final_message), got {last!r}")
    return encode_chat(tokenizer, messages, "chat messages need a tokenizer with a chat template, and this one has none",
                       tools=tools, continue_final=continue_final)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], no_template_error: str,
                tools: Sequence[dict] | None = None, continue_final: bool = False) -> list[int]:
    """Token ids of a chat with the tokenizer's chat template and the assistant turn opened
    (or, ``continue_final``, the last assistant message left open)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(no_template_error)
    try:
        encoded = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                add_generation_prompt=not continue_final,
                                                continue_final_message=continue_final, tokenize=True)
    except (TemplateError, ValueError, TypeError, KeyError) as error:  # the template's raise_exception, or a
        # message it cannot render (a missing key, a wrong type)
        raise InvalidRequest(f"the chat template refused the conversation: {error}") from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def default_learned_loader(draft: LoadedModel | None = None) -> LearnedPolicyLoader | None:
    """The DISCO artifact loader, if the trained-policy module is available. Bound to
    ``draft`` (when given), it refuses artifacts trained for another draft model."""
    try:
        from disco.speculation.policies.learned import make_learned_loader  # noqa: PLC0415
    except ImportError:
        return None
    if draft is None:
        return make_learned_loader()
    return make_learned_loader(draft.fingerprint, draft.tokenizer_hash)


def build_local_pipeline(pair: PairConfig, home: Path, need_draft: bool = True,
                         max_new_tokens_limit: int | None = None, measure_costs: bool = False,
                         overlap: bool = False) -> LocalPipeline:
    """Load the target (and, unless only ``none`` will run, the draft) and wire them up.

    ``measure_costs``: give the loop the engines' measured costs (cached under ``home``;
    measured on first use), which the ``auto`` policy reads. ``overlap``: the draft engine
    pre-drafts the next block while the target verifies (:mod:`disco.engines.predraft`)."""
    target = load_model(pair.target, "target", home)
    draft = None
    if need_draft:
        draft = load_model(pair.draft, "draft", home)
        check_same_vocabulary(target, draft)
    costs = _measured_costs(pair, target, draft, home) if measure_costs and draft is not None else None
    drafter = _drafter(draft, overlap, pair.draft.prefill_window) if draft else None
    generator = SpeculativeGenerator(
        drafter=drafter,
        verifier=TargetEngine(target.model, grammar=grammar_compiler(target)),
        decode=make_decode(target.tokenizer),
        eos_token_ids=target.eos_token_ids,
        max_new_tokens_limit=max_new_tokens_limit,
        costs=costs,
        encode=make_encode(target.tokenizer),
    )
    return LocalPipeline(generator=generator, tokenizer=target.tokenizer, target=target, draft=draft)


def _measured_costs(pair: PairConfig, target: LoadedModel, draft: LoadedModel, home: Path) -> CostModel:
    """In-process cost model: the target's forwards over every block up to the lookahead cap
    (:func:`disco.engines.engine_costs.request_for`), the draft's per token."""
    from disco.engines import engine_costs  # noqa: PLC0415

    costs = engine_costs.to_cost_model(engine_costs.measure_loaded(target, pair.target, "target", home),
                                       engine_costs.measure_loaded(draft, pair.draft, "draft", home))
    return dataclasses.replace(costs, draft_prefill_window=pair.draft.prefill_window)


__all__ = ["LocalPipeline", "build_local_pipeline", "encode_prompt", "make_decode", "make_encode", "ModelConfig"]


def with_overlap(pipeline: LocalPipeline, overlap: bool) -> SpeculativeGenerator:
    """A generator on the same models and target engine whose draft engine pre-drafts
    (``overlap``) or not: both modes side by side in one process (``disco bench --overlap off,on``)."""
    base = pipeline.generator
    window = base.drafter.prefill_window if isinstance(base.drafter, DraftEngine) else 0
    drafter = _drafter(pipeline.draft, overlap, window) if pipeline.draft is not None else None
    return SpeculativeGenerator(drafter=drafter, verifier=base.verifier, decode=base.decode,
                                eos_token_ids=base.eos_token_ids, max_new_tokens_limit=base.max_new_tokens_limit,
                                costs=base.costs, encode=base.encode)


def _drafter(draft: LoadedModel, overlap: bool, prefill_window: int = 0) -> DraftEngine:
    """The draft engine over ``draft`` with the learned policies its artifacts allow."""
    return DraftEngine(draft.model, PolicyFactory(default_learned_loader(draft)), overlap=overlap,
                       grammar=grammar_compiler(draft), prefill_window=prefill_window)


def grammar_compiler(loaded: LoadedModel) -> GrammarCompiler:
    """Structured outputs for a loaded model (its tokenizer, logits rows and EOS ids)."""
    return GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
