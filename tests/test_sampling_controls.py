"""vLLM's sampling controls applied by the draft and the target alike (issue 48, item 3;
docs/exactness.md, "Sampling controls"):

* each processor of :mod:`disco.speculation.logits_processors` against a hand-computed reference,
  a block's rows equal to one-row calls bit for bit, min_p in vLLM's place (before top-p);
* the detokenizer's stop rules (stop token ids, min_tokens, include_stop_str_in_output);
* validation: every field's range and budget, named in the message;
* on the tiny pair in float32, for each control: ``static:4`` and ``heuristic:3`` give ``none``'s
  tokens, greedy and seeded-sampled; an identical draft is fully accepted under the controls; a
  target session lost mid-request is re-created with its output counted as output.
"""

from __future__ import annotations

import math

import pytest
import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.in_process import make_decode, make_encode
from disco.errors import InvalidRequest
from disco.speculation.detokenize import IncrementalDetokenizer
from disco.speculation.logits_processors import (apply_logits_controls, apply_min_p, apply_penalties,
                                                 ban_bad_words, ban_until_min_tokens, tokenize_bad_words)
from disco.speculation.sampling import logits_to_probs
from tests.helpers import EOS_ID, PROMPTS, local_generator
from tests.test_faults_loop import SessionDroppingVerifier

INF = float("inf")

# -- the processors, by hand -----------------------------------------------------------------


def test_no_control_costs_nothing_and_returns_the_logits_themselves():
    logits = torch.randn(3, 8)
    assert apply_logits_controls(logits, SamplingParams(min_p=0.5, top_k=3), [1, 2], 2, 1) is logits
    # min_tokens without a token to ban is no control either.
    assert apply_logits_controls(logits, SamplingParams(min_tokens=3, max_new_tokens=8), [1, 2], 2, 1) is logits


def test_bad_words_ban_the_last_token_where_the_output_ends_with_the_rest():
    tokens = [1, 2, 3, 4]  # prompt [1, 2], output [3, 4]
    logits = torch.zeros(2, 6)  # row 0 after [1, 2, 3] (output [3]), row 1 after [1, 2, 3, 4] (output [3, 4])
    words = [(5,), (3, 1), (2, 3, 0), (3, 4, 2)]
    ban_bad_words(logits, words, tokens, first=3, output_start=2)
    expected = torch.zeros(2, 6)
    expected[:, 5] = -INF  # one token: always
    expected[0, 1] = -INF  # the output ends with 3
    # (2, 3, 0): [2, 3] ends row 0's history, but 2 is a prompt token: vLLM matches output tokens only.
    expected[1, 2] = -INF  # the output ends with 3, 4
    assert torch.equal(logits, expected)


def test_min_tokens_bans_eos_and_stop_token_ids_while_too_few_outputs_precede():
    sampling = SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=(4,), eos_token_ids=(0,), ignore_eos=True)
    logits = torch.zeros(4, 6)
    ban_until_min_tokens(logits, sampling, first_output_length=1)  # rows after 1, 2, 3, 4 output tokens
    expected = torch.zeros(4, 6)
    expected[:2, [0, 4]] = -INF  # 1 and 2 < 3 (EOS too with ignore_eos, as vLLM does)
    assert torch.equal(logits, expected)


def test_logit_bias_is_added_to_every_row():
    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    sampling = SamplingParams(logit_bias=((1, -100.0), (4, 2.5)))
    out = apply_logits_controls(logits, sampling, [0, 1, 2], 2, 1)
    expected = logits.clone()
    expected[:, 1] -= 100.0
    expected[:, 4] += 2.5
    assert torch.equal(out, expected) and not torch.equal(out, logits)  # the input is left as it was


def reference_penalties(row_logits, history, output, sampling):
    """vLLM's apply_penalties for one row, written out token by token."""
    out = row_logits.clone()
    for token in range(len(out)):
        if token in history and sampling.repetition_penalty != 1.0:
            value = out[token]
            out[token] = value / sampling.repetition_penalty if value > 0 else value * sampling.repetition_penalty
        count = output.count(token)
        out[token] -= sampling.frequency_penalty * count
        if count:
            out[token] -= sampling.presence_penalty
    return out


def test_penalties_follow_vllm_row_by_row():
    """Repetition over prompt + output (the history before each row), frequency and presence over
    the output only; a block's row j counts the draft tokens before it."""
    torch.manual_seed(0)
    vocab, rows = 12, 4
    logits = torch.randn(rows, vocab) * 3
    tokens = [3, 5, 3, 7, 7, 1, 9, 7, 2]  # prompt [3, 5, 3, 7], output [7, 1], then draft tokens 9, 7, 2
    first, output_start = 6, 4
    sampling = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4)
    out = logits.clone()
    apply_penalties(out, sampling, tokens, first, output_start)
    for row in range(rows):
        history = tokens[:first + row]
        expected = reference_penalties(logits[row], history, history[output_start:], sampling)
        assert torch.allclose(out[row], expected, atol=1e-6), row
    untouched = [t for t in range(vocab) if t not in tokens]
    assert torch.equal(out[:, untouched], logits[:, untouched])  # tokens never seen keep their bits


def test_a_blocks_rows_equal_one_row_calls_bit_for_bit():
    """What keeps verification equal to decoding: row j of a block gets the bits a one-row call
    with the history tokens[:first + j] gets, under every control at once."""
    torch.manual_seed(1)
    vocab = 50
    tokens = [4, 8, 15, 16, 23, 42, 8, 4, 4, 30, 31, 8]
    first, output_start, rows = 7, 5, 5
    sampling = SamplingParams(max_new_tokens=20, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.2,
                              logit_bias=((4, 1.5), (30, -3.0)), min_tokens=4, stop_token_ids=(31,),
                              eos_token_ids=(0,), bad_words_token_ids=((8, 4), (4, 4, 30), (49,)))
    logits = torch.randn(rows, vocab) * 4
    block = apply_logits_controls(logits, sampling, tokens, first, output_start)
    for row in range(rows):
        alone = apply_logits_controls(logits[row:row + 1], sampling, tokens[:first + row], first + row, output_start)
        assert torch.equal(block[row], alone[0]), row


def test_min_p_is_relative_to_the_top_probability_and_runs_before_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert torch.equal(apply_min_p(logits, 0.5)[0, 2], torch.tensor(-INF))  # 0.2 < 0.5 x 0.5
    assert torch.isfinite(apply_min_p(logits, 0.5)[0, :2]).all()
    # vLLM's order: min_p drops 0.2, the rest renormalized [0.625, 0.375]; top_p 0.6 then keeps one.
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6))
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0]]))
    # Without min_p, top_p 0.6 keeps two.
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6)) > 0).sum() == 2


def test_bad_words_are_tokenized_as_vllm_does():
    vocab = {"are": [7], " are": [9], "hi there": [1, 2], " hi there": [3, 2], "x y": [4, 5], " x y": [4, 6]}
    encode = vocab.__getitem__
    # A word and its space-prefixed form (another first token, as many tokens); "x y" keeps one form.
    assert tokenize_bad_words(["are", "  hi there", "x y"], encode) == ((7,), (9,), (1, 2), (3, 2), (4, 5))
    with pytest.raises(InvalidRequest, match=r"bad_words\[0\] tokenizes to no token"):
        tokenize_bad_words(["zz"], lambda text: [])
    with pytest.raises(InvalidRequest, match=r"bad_words\[0\] is 40 tokens long"):
        tokenize_bad_words(["long"], lambda text: list(range(40)))


# -- the detokenizer's stop rules -----------------------------------------------------------


def letters(ids):
    return "".join(chr(ord("a") + token) for token in ids)


def push_all(detokenizer, ids):
    """Push until a stop; returns (tokens pushed, stopped)."""
    for count, token in enumerate(ids, start=1):
        if detokenizer.push(token).stopped:
            return count, True
    detokenizer.finish()
    return len(ids), False


def test_stop_token_ids_end_like_eos_and_their_text_only_with_include():
    ids = [0, 1, 2, 3, 4]  # "abcde"
    plain = IncrementalDetokenizer(letters, stop_token_ids=(2,))
    assert push_all(plain, ids) == (3, True) and plain.text == "ab"
    kept = IncrementalDetokenizer(letters, stop_token_ids=(2,), include_stop_str_in_output=True)
    assert push_all(kept, ids) == (3, True) and kept.text == "abc"


def test_include_stop_str_cuts_after_the_stop_string():
    ids = [0, 1, 2, 3, 4]
    cut = IncrementalDetokenizer(letters, stop=("cd",))
    assert push_all(cut, ids) == (4, True) and cut.text == "ab"
    kept = IncrementalDetokenizer(letters, stop=("cd",), include_stop_str_in_output=True)
    assert push_all(kept, ids) == (4, True) and kept.text == "abcd"


def test_min_tokens_defers_stop_tokens_and_stop_strings():
    ids = [0, 1, 2, 3, 0, 1, 4]  # "abcdabe"
    # A stop string ending in the text of the first min_tokens tokens does not count; a later one does.
    late = IncrementalDetokenizer(letters, stop=("ab",), min_tokens=3)
    assert push_all(late, ids) == (6, True) and late.text == "abcd"
    # A stop token counts from the min_tokens-th token on (vLLM's check_stop).
    token = IncrementalDetokenizer(letters, stop_token_ids=(0,), min_tokens=2)
    assert push_all(token, ids) == (5, True) and token.text == "abcd"
    eos = IncrementalDetokenizer(letters, eos_token_ids=(1,), min_tokens=3)
    assert push_all(eos, ids) == (6, True) and eos.text == "abcda"


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(stop_token_ids=(-1,)), "stop_token_ids: token ids must be integers >= 0"),
    (dict(stop_token_ids=tuple(range(65))), "stop_token_ids: 65 token ids, more than the limit of 64"),
    (dict(min_tokens=-1), "min_tokens must be in"),
    (dict(max_new_tokens=4, min_tokens=5), r"min_tokens must be in \[0, max_new_tokens = 4\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=math.nan), "repetition_penalty must be"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(logit_bias=((1, 101.0),)), r"logit_bias: the bias of token 1 must be in \[-100, 100\]"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias: a token id appears twice"),
    (dict(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias: 301 entries, more than the limit of 300"),
    (dict(bad_words=("",)), r"bad_words\[0\] is empty"),
    (dict(bad_words=("x" * 257,)), r"bad_words\[0\] has 257"),
    (dict(bad_words=("x",) * 65), "bad_words: 65 given"),
    (dict(bad_words_token_ids=((),)), r"bad_words_token_ids\[0\] is empty"),
    (dict(bad_words_token_ids=(tuple(range(33)),)), r"bad_words_token_ids\[0\]: 33 token ids"),
    (dict(resumed_tokens=-1), "resumed_tokens must be >= 0"),
])
def test_invalid_controls_are_refused_naming_the_field(fields, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**fields).validate()


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field():
    for fields, name in [(dict(stop_token_ids=(3, 600)), "stop_token_ids"), (dict(logit_bias=((512, 1.0),)), "logit_bias"),
                         (dict(bad_words_token_ids=((1, 999),)), "bad_words_token_ids")]:
        with pytest.raises(InvalidRequest, match=rf"{name}: token id \d+ is outside the vocabulary \[0, 512\)"):
            SamplingParams(**fields).check_token_ids(512)


def test_a_resumed_session_counts_its_committed_output():
    sampling = SamplingParams(max_new_tokens=20, min_tokens=18)
    resumed = sampling.resumed_after(5).resumed_after(3)  # two re-creations
    assert (resumed.max_new_tokens, resumed.resumed_tokens) == (12, 8)
    resumed.validate()  # min_tokens is checked against the request's whole budget


def test_engines_refuse_out_of_vocabulary_ids_before_any_work(target_model, drafts, tokenizer):
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    vocab = int(target_model.config.vocab_size)
    for engine, start in ((generator.verifier, lambda s: generator.verifier.start_session("x", ids, s)),
                          (generator.drafter, lambda s: generator.drafter.start_session("x", ids, s, "static:2"))):
        with pytest.raises(InvalidRequest, match="stop_token_ids: token id"):
            start(SamplingParams(stop_token_ids=(vocab,)))
        with pytest.raises(InvalidRequest, match="resumed_tokens"):
            start(SamplingParams(resumed_tokens=len(ids)))
        assert engine.active_sessions() == 0


# -- speculative output equals target-only output under the controls (tiny pair, float32) -----

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPTS[0])["input_ids"]


@pytest.fixture(scope="module")
def baseline(target_model, tokenizer, prompt_ids):
    """Target-only greedy tokens without controls (the controls below are built from them)."""
    generator = local_generator(target_model, None, tokenizer)
    tokens = generator.generate(prompt_ids, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
                                SpeculationConfig("none")).token_ids
    assert len(set(tokens)) > MAX_NEW // 2  # a varied reference (initializer_range 0.3)
    return tokens


def bad_word_of(base, tokenizer):
    """A word of the reference output that vLLM's rule bans as the very token the output has (a
    word like " are" whose written form is two tokens is banned only as those two: vLLM's rule)."""
    encode = make_encode(tokenizer)
    for token in base:
        word = tokenizer.decode([token]).strip()
        if word.isalpha() and len(word) >= 3 and (token,) in tokenize_bad_words([word], encode):
            return word
    raise AssertionError("no word to ban in the reference output")


def controls_for(base, tokenizer):
    """Each control, at values that change the tiny target's output."""
    word = bad_word_of(base, tokenizer)
    # NOTE: the reference output repeats no token, so positive penalties alone change nothing greedy;
    # a repetition penalty below 1 makes it repeat, which the positive ones then push back on.
    return {
        "repetition_penalty": dict(repetition_penalty=0.5),
        "presence_frequency": dict(repetition_penalty=0.7, presence_penalty=1.5, frequency_penalty=0.8),
        "negative_penalties": dict(presence_penalty=-2.0, frequency_penalty=-1.0),
        "logit_bias": dict(logit_bias=((base[0], -100.0), (base[4], 3.0))),
        "min_p": dict(min_p=0.2),
        "min_tokens": dict(min_tokens=10, stop_token_ids=(base[1], base[3]), ignore_eos=False),
        "stop_token_ids": dict(stop_token_ids=(base[6],)),
        "bad_words_token_ids": dict(bad_words_token_ids=((base[2],), (base[5], base[6]))),
        "bad_words": dict(bad_words=(word,)),
        "all": dict(repetition_penalty=0.8, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05,
                    logit_bias=((base[1], -5.0),), min_tokens=4, stop_token_ids=(base[7],),
                    bad_words_token_ids=((base[2], base[3]),), include_stop_str_in_output=True),
    }


CONTROL_NAMES = ("repetition_penalty", "presence_frequency", "negative_penalties", "logit_bias", "min_p",
                 "min_tokens", "stop_token_ids", "bad_words_token_ids", "bad_words", "all")
MODES = {"greedy": dict(), "sampled": dict(temperature=0.9, top_p=0.95, seed=5)}


@pytest.fixture(scope="module")
def pair(target_model, drafts, tokenizer):
    return {"speculative": local_generator(target_model, drafts["noisy"], tokenizer),
            "same": local_generator(target_model, target_model, tokenizer)}


def sampling_of(control, mode):
    return SamplingParams(max_new_tokens=MAX_NEW, **{"ignore_eos": True, **MODES[mode], **control})


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CONTROL_NAMES)
def test_speculative_output_equals_target_only_under_each_control(pair, baseline, tokenizer, prompt_ids, name, mode):
    control = controls_for(baseline, tokenizer)[name]
    sampling = sampling_of(control, mode)
    generator = pair["speculative"]
    results = {policy: generator.generate(prompt_ids, sampling, SpeculationConfig(policy))
               for policy in ("none", "static:4", "heuristic:3")}
    expected = results["none"].token_ids
    for policy, result in results.items():
        assert result.token_ids == expected, (name, mode, policy)
        assert result.text == results["none"].text
    assert results["static:4"].stats.draft_tokens > 0
    if mode == "greedy" and name != "min_p":  # min_p never changes an argmax
        assert expected != baseline, f"{name} changed nothing: the test would pass on broken code"
    if name == "stop_token_ids":
        assert not set(expected[:-1]) & set(control["stop_token_ids"])
        if mode == "greedy":  # the reference's 7th token
            assert len(expected) == 7 and results["none"].finish_reason == "stop"
            assert results["none"].text == make_decode(tokenizer)(expected[:-1])  # the stop token's text is not shown
    if name == "min_tokens":
        assert len(expected) >= control["min_tokens"]
        assert not set(expected[:control["min_tokens"]]) & {*control["stop_token_ids"], EOS_ID}
    if name == "bad_words_token_ids":
        assert baseline[2] not in expected


@pytest.mark.parametrize("mode", list(MODES))
def test_an_identical_draft_is_fully_accepted_under_the_controls(pair, baseline, tokenizer, prompt_ids, mode):
    """The draft applies the target's processors with the same history: an exact draft proposes
    exactly the target's tokens."""
    sampling = sampling_of(controls_for(baseline, tokenizer)["all"], mode)
    result = pair["same"].generate(prompt_ids, sampling, SpeculationConfig("static:4"))
    assert result.stats.draft_tokens > 0 and result.stats.accepted_tokens == result.stats.draft_tokens


def test_a_lost_target_session_keeps_counting_its_output(target_model, drafts, tokenizer, prompt_ids):
    """A re-created session holds the committed output in its prompt: resumed_tokens keeps the
    presence / frequency penalties and min_tokens counting it, so the text is undisturbed."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, presence_penalty=2.0, frequency_penalty=1.0, min_tokens=20,
                              stop_token_ids=(EOS_ID,), temperature=0.8, seed=3)
    undisturbed = local_generator(target_model, drafts["noisy"], tokenizer).generate(
        prompt_ids, sampling, SpeculationConfig("static:3"))
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.verifier = SessionDroppingVerifier(generator.verifier, drop_before_call=4)
    result = generator.generate(prompt_ids, sampling, SpeculationConfig("static:3"))
    assert result.stats.target_reprefills == 1
    assert result.token_ids == undisturbed.token_ids


def test_a_re_prefilled_draft_keeps_counting_the_output(target_model, tokenizer, prompt_ids, baseline):
    """A lost draft session is re-created from the committed tokens with resumed_tokens: an
    identical draft then still applies the target's controls to the same history (all accepted)."""
    generator = local_generator(target_model, target_model, tokenizer)
    real_draft, calls = generator.drafter.draft, []

    def draft_forgetting_once(session_id, feedback, max_lookahead):
        calls.append(session_id)
        if len(calls) == 3:
            generator.drafter.end_session(session_id)  # the draft service restarted
        return real_draft(session_id, feedback, max_lookahead)

    generator.drafter.draft = draft_forgetting_once
    sampling = sampling_of(dict(presence_penalty=-2.0, frequency_penalty=-1.0, min_tokens=20,
                                stop_token_ids=(baseline[1],), bad_words_token_ids=((baseline[2], baseline[3]),)),
                           "sampled")
    result = generator.generate(prompt_ids, sampling, SpeculationConfig("static:3"))
    assert len(calls) > 3 and result.stats.accepted_tokens == result.stats.draft_tokens > 0


def test_overlapped_drafting_guesses_under_the_controls(target_model, tokenizer, prompt_ids, baseline, pair):
    """The pre-drafted block's guessed bonus token is chosen under the controls too: with an
    identical draft every guess hits, and the text is target-only's."""
    from disco.engines.draft import DraftEngine  # noqa: PLC0415
    from disco.speculation.policies import PolicyFactory  # noqa: PLC0415

    generator = local_generator(target_model, None, tokenizer)
    generator.drafter = DraftEngine(target_model, PolicyFactory(), overlap=True)
    for mode in MODES:
        sampling = sampling_of(controls_for(baseline, tokenizer)["all"], mode)
        result = generator.generate(prompt_ids, sampling, SpeculationConfig("static:3"))
        assert result.token_ids == pair["speculative"].generate(prompt_ids, sampling, SpeculationConfig("none")).token_ids
        assert result.stats.overlap_hits > 0 and result.stats.overlap_misses == 0, mode
