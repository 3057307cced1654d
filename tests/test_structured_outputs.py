"""Structured outputs (issue 48, item 5): the draft and the target mask tokens with the same
grammar state, so speculative output equals target-only constrained decoding; the output
follows the constraint; bad specifications are refused before any work; the gRPC contract
carries the constraint (real services on loopback)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from disco.config import MAX_STRUCTURED_CHARS, SamplingParams, SpeculationConfig, StructuredOutput
from disco.errors import InvalidRequest
from disco.speculation.grammar import GrammarCompiler
from tests.grpc_fixtures import grpc_stacks  # noqa: F401 - fixture
from tests.helpers import EOS_ID, PROMPTS, grammar_for, local_generator

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.com"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'start: sum\nsum: NUM (" + " NUM)*\nNUM: /[1-9][0-9]?/'
CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", EMAIL),
    "choice": StructuredOutput("choice", json.dumps(CHOICES)),
    "grammar": StructuredOutput("grammar", GRAMMAR),
    "json_object": StructuredOutput("json_object"),
}
MODES = {"greedy": dict(), "sampled": dict(temperature=0.9, top_p=0.95, seed=5)}
MAX_NEW = 48


def follows(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)  # raises on a violation
        return True
    if kind == "regex":
        return re.fullmatch(EMAIL, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "grammar":
        return re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", text) is not None
    return text.startswith("{")  # json_object: may be cut by max_new_tokens; parsed when it ended


@pytest.fixture(scope="module")
def pair(target_model, drafts, tokenizer):
    return {"speculative": local_generator(target_model, drafts["noisy"], tokenizer),
            "same": local_generator(target_model, target_model, tokenizer)}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPTS[0])["input_ids"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_speculative_output_equals_target_only_and_follows_the_constraint(pair, prompt_ids, kind, mode):
    sampling = SamplingParams(max_new_tokens=MAX_NEW, structured=CONSTRAINTS[kind], **MODES[mode])
    results = {policy: pair["speculative"].generate(prompt_ids, sampling, SpeculationConfig(policy))
               for policy in ("none", "static:4", "static:1", "heuristic:3")}
    expected = results["none"]
    for policy, result in results.items():
        assert result.token_ids == expected.token_ids, (kind, mode, policy)
    assert results["static:4"].stats.draft_tokens > 0
    assert follows(kind, expected.text), expected.text
    if kind != "json_object":
        assert expected.finish_reason == "stop" and expected.token_ids[-1] == EOS_ID  # the grammar ended it
    elif expected.finish_reason == "stop":
        assert isinstance(json.loads(expected.text), dict)


def test_an_unconstrained_request_differs(pair, prompt_ids):
    """The constraint really acts: the same request without it gives other text."""
    free = pair["speculative"].generate(prompt_ids, SamplingParams(max_new_tokens=MAX_NEW), SpeculationConfig("none"))
    assert not follows("regex", free.text)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_identical_draft_is_fully_accepted_under_a_grammar(pair, prompt_ids, mode):
    """Rejected draft tokens never stay in the draft's grammar state: an exact draft proposes
    exactly the target's masked tokens, across blocks."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, structured=CONSTRAINTS["json_schema"], **MODES[mode])
    result = pair["same"].generate(prompt_ids, sampling, SpeculationConfig("static:4"))
    assert result.stats.draft_tokens > 0 and result.stats.accepted_tokens == result.stats.draft_tokens


def test_masks_roll_back_after_a_block_and_follow_any_history(target_model, tokenizer):
    compiler = grammar_for(target_model, tokenizer)
    state = compiler.start(CONSTRAINTS["regex"])
    ids = tokenizer("abc@de.com")["input_ids"]
    block = state.masks([], ids[:3], 4)  # [4, vocab]: rows after [], ids[:1], ids[:2], ids[:3]
    for row in range(3):
        assert bool(block[row, ids[row]])
    alone = [compiler.start(CONSTRAINTS["regex"]).masks(ids[:row], [], 1)[0] for row in range(4)]
    for row in range(4):
        assert torch.equal(block[row], alone[row])  # a block's row = that history's own mask
    assert torch.equal(state.masks(ids[:2], [], 1)[0], alone[2])  # rolled back, then advanced
    assert torch.equal(state.masks(ids[:1], [], 1)[0], alone[1])  # a shorter history: rolled back
    done = state.masks(ids, [], 1)[0]
    assert torch.nonzero(done).flatten().tolist() == [EOS_ID]  # the grammar is complete: EOS only
    with pytest.raises(InvalidRequest, match="does not follow"):
        state.masks(tokenizer("ab1")["input_ids"], [], 1)


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("xml", "x"), "kind must be one of"),
    (StructuredOutput("regex", ""), "needs a specification"),
    (StructuredOutput("json_object", "{}"), "takes no specification"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("json_schema", "[1]"), "must be a JSON object"),
    (StructuredOutput("choice", '["a", 3]'), "list of 1 to"),
    (StructuredOutput("choice", "[]"), "list of 1 to"),
    (StructuredOutput("regex", "a" * (MAX_STRUCTURED_CHARS + 1)), "more than the limit"),
])
def test_invalid_specifications_are_refused_by_validation(structured, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(structured=structured).validate()


def test_combinations_the_grammar_cannot_honor_are_refused():
    for fields, message in ((dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=3), "min_tokens")):
        with pytest.raises(InvalidRequest, match=message):
            SamplingParams(structured=CONSTRAINTS["regex"], **fields).validate()


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("regex", "(["), "regex.*not valid"),
    (StructuredOutput("grammar", "start: foo"), "grammar.*not valid"),
])
def test_a_specification_the_grammar_engine_refuses_is_an_invalid_request_before_work(
        target_model, drafts, tokenizer, prompt_ids, structured, message):
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    with pytest.raises(InvalidRequest, match=message):
        generator.generate(prompt_ids, SamplingParams(max_new_tokens=8, structured=structured),
                           SpeculationConfig("static:4"))
    assert generator.verifier.active_sessions() == 0 and generator.drafter.active_sessions() == 0


def test_an_engine_without_a_tokenizer_refuses_structured_outputs(target_model, tokenizer, prompt_ids):
    from disco.engines.target import TargetEngine  # noqa: PLC0415

    with pytest.raises(InvalidRequest, match="tokenizer"):
        TargetEngine(target_model).start_session("s", prompt_ids, SamplingParams(structured=CONSTRAINTS["regex"]))


def test_compiler_builds_the_tokenizer_once_and_only_when_asked(target_model, tokenizer):
    compiler = GrammarCompiler(tokenizer, int(target_model.config.vocab_size), (EOS_ID,))
    assert compiler._tokenizer is None  # no cost for services that never see a structured request
    first = compiler.tokenizer
    compiler.start(CONSTRAINTS["choice"])
    assert compiler.tokenizer is first


@pytest.mark.parametrize("kind", ["json_schema", "choice"])
def test_structured_output_over_grpc_equals_in_process(grpc_stacks, pair, tokenizer, kind):
    structured = CONSTRAINTS[kind]
    local = pair["speculative"].generate(tokenizer(PROMPTS[1])["input_ids"],
                                         SamplingParams(max_new_tokens=MAX_NEW, structured=structured,
                                                        **MODES["sampled"]), SpeculationConfig("static:4"))
    client = grpc_stacks["noisy"].client
    remote = client.generate(PROMPTS[1], policy="static:4", max_new_tokens=MAX_NEW,
                             structured=(structured.kind, structured.spec), **MODES["sampled"])
    none = client.generate(PROMPTS[1], policy="none", max_new_tokens=MAX_NEW,
                           structured=(structured.kind, structured.spec), **MODES["sampled"])
    assert remote.token_ids == local.token_ids == none.token_ids
    assert follows(kind, remote.text)


def test_a_bad_specification_over_grpc_is_invalid_argument(grpc_stacks):
    import grpc  # noqa: PLC0415

    with pytest.raises(Exception) as caught:
        grpc_stacks["noisy"].client.generate(PROMPTS[0], max_new_tokens=8, structured=("regex", "(["))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in str(caught.value.details())


def test_overlapped_drafting_under_a_grammar(target_model, tokenizer, prompt_ids, pair):
    """Pre-drafted blocks (and their guessed bonus token) are masked with the history they
    follow: with an identical draft every guess hits, and the text is target-only's."""
    from disco.engines.draft import DraftEngine  # noqa: PLC0415
    from disco.speculation.policies import PolicyFactory  # noqa: PLC0415

    generator = local_generator(target_model, None, tokenizer)
    generator.drafter = DraftEngine(target_model, PolicyFactory(), overlap=True,
                                    grammar=grammar_for(target_model, tokenizer))
    for mode in MODES:
        sampling = SamplingParams(max_new_tokens=MAX_NEW, structured=CONSTRAINTS["json_schema"], **MODES[mode])
        result = generator.generate(prompt_ids, sampling, SpeculationConfig("static:3"))
        assert result.token_ids == pair["speculative"].generate(prompt_ids, sampling,
                                                                SpeculationConfig("none")).token_ids
        assert result.stats.overlap_hits > 0 and result.stats.overlap_misses == 0, mode


def test_filler_vocabulary_entries_are_never_allowed(target_model, tokenizer):
    """A converted tokenizer padded to the model's rows (``[PAD151665]`` ...) has entries llguidance
    reads as literal text; they are masked out wherever the grammar would allow text."""
    from disco.speculation.grammar import GrammarState  # noqa: PLC0415

    compiler = grammar_for(target_model, tokenizer)
    open_string = tokenizer('{"a": "x')["input_ids"]
    allowed = compiler.start(CONSTRAINTS["json_object"]).masks(open_string, [], 1)[0]
    fillers = torch.nonzero(allowed).flatten()[:3].tolist()
    state = GrammarState(compiler.start(CONSTRAINTS["json_object"]).matcher, compiler.vocab_size, (EOS_ID,), fillers)
    masked = state.masks(open_string, [], 1)[0]
    assert not masked[fillers].any() and int(masked.sum()) == int(allowed.sum()) - 3
    assert compiler.filler_ids == ()  # the tiny tokenizer has none
