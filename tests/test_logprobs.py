"""The target's logprobs and echo (issue 48, item 2), on the tiny float32 pair.

* The math, with hand-made tensors: each entry is the row's log_softmax at its token, its rank,
  the row's most likely tokens; only asked sessions compute anything.
* In process: every emitted token's logprob (and the prompt's) equals the log_softmax of a plain
  HF forward of the target over prompt + output within 1e-4, raw (before temperature); a
  speculative run (``static:4``, the noisy draft) returns ``none``'s, greedy and seeded; the list
  is truncated with the tokens (stop strings); ``max_new_tokens: 0`` scores the prompt.
* Over gRPC on loopback (target, draft and orchestrator services): the same values, streamed and
  not; the prompt's logprobs and text (echo).
* With the official ``openai`` client against the HTTP gateway: completions ``logprobs`` and
  ``echo`` (prompt scoring with ``max_tokens: 0``), chat ``logprobs`` / ``top_logprobs``, vLLM's
  ``prompt_logprobs``, streamed and not, in OpenAI's shapes; bad values are 400s naming the field.
"""

from __future__ import annotations

import dataclasses

import openai
import pytest
import torch

from disco.config import MAX_LOGPROB_ENTRIES, MAX_LOGPROBS, SamplingParams, SpeculationConfig
from disco.errors import InvalidRequest, Unavailable
from disco.speculation.logprobs import raw_logprobs, select_logprobs
from disco.speculation.loop import SpeculativeGenerator
from tests.helpers import local_generator
from tests.http_fixtures import stack  # noqa: F401 - fixture

PROMPT = "def fibonacci(n):\n    "
TOL = 1e-4
GREEDY = dict(ignore_eos=True)
SAMPLED = dict(ignore_eos=True, temperature=0.9, top_p=0.95, seed=3)


def reference(target_model, token_ids):
    """The target's log_softmax over ``token_ids`` by a plain HF forward: row i is the
    distribution of token i + 1."""
    with torch.inference_mode():
        logits = target_model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len, vocab]


def check_against_reference(reference_logprobs, token_ids, first, entries, top_n):
    """Entry j is token ``token_ids[first + j]``'s: its value, rank and top alternatives."""
    for j, entry in enumerate(entries):
        row = reference_logprobs[first + j - 1]
        token = token_ids[first + j]
        assert abs(entry.logprob - row[token].item()) < TOL, (j, entry.logprob, row[token].item())
        assert len(entry.top_logprobs) == top_n
        values = row.topk(top_n).values.tolist()
        for (top_id, top_value), expected in zip(zip(entry.top_token_ids, entry.top_logprobs), values):
            assert abs(top_value - expected) < TOL and abs(row[top_id].item() - top_value) < TOL
        assert entry.rank == 1 + int((row > row[token] + TOL).sum()) or abs(
            row.sort(descending=True).values[entry.rank - 1].item() - row[token].item()) < TOL


# --- the math -------------------------------------------------------------------------------


def test_select_logprobs_by_hand():
    target_logits = torch.tensor([[0.0, 2.0, 1.0, float("-inf")],
                                  [3.0, 0.0, 0.0, 0.0]])  # [2, vocab]
    target_logprobs = raw_logprobs(target_logits)
    entries = select_logprobs(target_logprobs, [2, 0], top_n=2)
    expected = torch.log_softmax(target_logits, dim=-1)
    assert entries[0].logprob == pytest.approx(expected[0, 2].item()) and entries[0].rank == 2
    assert entries[0].top_token_ids == (1, 2) and entries[0].top_logprobs[0] == pytest.approx(expected[0, 1].item())
    assert entries[1].rank == 1 and entries[1].top_token_ids[0] == 0
    assert select_logprobs(target_logprobs, [3, 0], top_n=0)[0].logprob == float("-inf")
    assert select_logprobs(target_logprobs, [3, 0], top_n=0)[0].top_token_ids == ()
    # Raw: a new tensor, untouched by later processing of the logits.
    target_logits.div_(0.5)
    assert torch.equal(target_logprobs, expected)


def test_the_fields_are_checked_before_any_work():
    for bad in (dict(logprobs=MAX_LOGPROBS + 1), dict(logprobs=-1), dict(prompt_logprobs=MAX_LOGPROBS + 1)):
        with pytest.raises(InvalidRequest, match=next(iter(bad))):
            SamplingParams(**bad).validate()
    with pytest.raises(InvalidRequest, match="0 only with prompt_logprobs"):
        SamplingParams(max_new_tokens=0).validate()
    SamplingParams(max_new_tokens=0, prompt_logprobs=0).validate()
    with pytest.raises(InvalidRequest, match="more than the limit"):
        SamplingParams(max_new_tokens=MAX_LOGPROB_ENTRIES // 20, logprobs=20).check_logprob_entries(10)
    with pytest.raises(InvalidRequest, match="more than the limit"):
        SamplingParams(prompt_logprobs=5).check_logprob_entries(MAX_LOGPROB_ENTRIES // 6 + 1)
    # A session re-created after a failure does not compute the prompt's logprobs again.
    assert SamplingParams(prompt_logprobs=2, logprobs=1).resumed_after(3).prompt_logprobs is None


def test_nothing_is_computed_unless_asked(target_model, tokenizer, monkeypatch):
    import disco.engines.target as target_engine  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(target_engine, "raw_logprobs", lambda logits: calls.append(1) or raw_logprobs(logits))
    generator = local_generator(target_model, None, tokenizer)
    ids = tokenizer(PROMPT)["input_ids"]
    result = generator.generate(ids, SamplingParams(max_new_tokens=4, **GREEDY), SpeculationConfig(policy="none"))
    assert not calls and result.logprobs == () and result.prompt_logprobs == ()
    generator.generate(ids, SamplingParams(max_new_tokens=4, logprobs=0, **GREEDY), SpeculationConfig(policy="none"))
    assert len(calls) == 4


# --- in process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generator(target_model, drafts, tokenizer):
    return local_generator(target_model, drafts["noisy"], tokenizer)


@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_logprobs_are_the_targets_and_speculation_returns_target_onlys(generator, target_model, tokenizer, mode):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    sampling = SamplingParams(max_new_tokens=20, logprobs=4, prompt_logprobs=3, **mode)
    plain = generator.generate(prompt_ids, sampling, SpeculationConfig(policy="none"))
    speculative = generator.generate(prompt_ids, sampling, SpeculationConfig(policy="static:4"))
    assert speculative.token_ids == plain.token_ids and len(set(plain.token_ids)) >= 8
    assert speculative.stats.accepted_tokens > 0 and speculative.stats.draft_tokens > speculative.stats.accepted_tokens
    sequence = prompt_ids + plain.token_ids
    ref = reference(target_model, sequence)
    for result in (plain, speculative):
        assert len(result.logprobs) == len(result.token_ids) and len(result.prompt_logprobs) == len(prompt_ids) - 1
        check_against_reference(ref, sequence, len(prompt_ids), result.logprobs, 4)
        check_against_reference(ref, sequence, 1, result.prompt_logprobs, 3)
    for a, b in zip(plain.logprobs, speculative.logprobs):
        assert abs(a.logprob - b.logprob) < TOL and a.top_token_ids == b.top_token_ids
    if mode is SAMPLED:  # raw values: some sampled tokens are not the argmax
        assert any(entry.rank > 1 for entry in plain.logprobs)


def test_logprobs_are_truncated_with_the_tokens(generator, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    whole = generator.generate(prompt_ids, SamplingParams(max_new_tokens=24, logprobs=1, **GREEDY),
                               SpeculationConfig(policy="none"))
    stop = whole.text[len(whole.text) // 2:][:3]
    assert stop.strip()
    for policy in ("none", "static:4"):
        events = list(generator.stream(prompt_ids, SamplingParams(max_new_tokens=24, logprobs=1, stop=(stop,),
                                                                  **GREEDY), SpeculationConfig(policy=policy)))
        *chunks, result = events
        assert result.finish_reason == "stop" and len(result.token_ids) < 24
        assert len(result.logprobs) == len(result.token_ids)
        assert [e.logprob for e in result.logprobs] == pytest.approx([e.logprob for e in whole.logprobs[
            :len(result.token_ids)]], abs=TOL)
        assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]
        assert all(c.prompt_logprobs == () for c in chunks)


def test_prompt_scoring_with_no_tokens(generator, target_model, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    result = generator.generate(prompt_ids, SamplingParams(max_new_tokens=0, prompt_logprobs=2),
                                SpeculationConfig(policy="static:4"))
    assert result.token_ids == [] and result.finish_reason == "length" and result.stats.target_forwards == 0
    check_against_reference(reference(target_model, prompt_ids), prompt_ids, 1, result.prompt_logprobs, 2)
    one = generator.generate(prompt_ids[:1], SamplingParams(max_new_tokens=0, prompt_logprobs=0),
                             SpeculationConfig(policy="none"))
    assert one.prompt_logprobs == () and one.token_ids == []


class LosingVerifier:
    """The target engine, forgetting the session once after ``after`` verifications (a restart):
    the loop re-prefills it from its tokens; and optionally a target that returns no logprobs
    (older than this loop)."""

    def __init__(self, engine, after: int = 2, drop_logprobs: bool = False):
        self.engine, self.after, self.drop_logprobs = engine, after, drop_logprobs
        self.starts: list[SamplingParams] = []

    def start_session(self, session_id, prompt_ids, sampling):
        self.starts.append(sampling)
        return self.engine.start_session(session_id, prompt_ids, sampling)

    def verify(self, session_id, draft_token_ids, draft_probs):
        self.after -= 1
        if self.after == 0:
            self.engine.end_session(session_id)
        verdict = self.engine.verify(session_id, draft_token_ids, draft_probs)
        return dataclasses.replace(verdict, logprobs=()) if self.drop_logprobs else verdict

    def end_session(self, session_id):
        self.engine.end_session(session_id)


def test_a_re_prefilled_target_session_keeps_the_logprobs(generator, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    sampling = SamplingParams(max_new_tokens=12, logprobs=2, prompt_logprobs=1, **SAMPLED)
    expected = generator.generate(prompt_ids, sampling, SpeculationConfig(policy="static:4"))
    losing = LosingVerifier(generator.verifier, after=2)
    flaky = SpeculativeGenerator(generator.drafter, losing, generator.decode, generator.eos_token_ids)
    result = flaky.generate(prompt_ids, sampling, SpeculationConfig(policy="static:4"))
    assert result.stats.target_reprefills == 1 and result.token_ids == expected.token_ids
    assert values(result.logprobs) == pytest.approx(values(expected.logprobs), abs=TOL)
    assert values(result.prompt_logprobs) == pytest.approx(values(expected.prompt_logprobs), abs=TOL)
    assert [s.prompt_logprobs for s in losing.starts] == [1, None]  # the re-prefill scores no prompt
    old = SpeculativeGenerator(None, LosingVerifier(generator.verifier, after=-1, drop_logprobs=True),
                               generator.decode, generator.eos_token_ids)
    with pytest.raises(Unavailable, match="logprobs"):
        old.generate(prompt_ids, sampling, SpeculationConfig(policy="none"))


# --- gRPC and HTTP ----------------------------------------------------------------------------


def values(entries):
    return [entry.logprob for entry in entries]


def test_over_grpc_streamed_and_not(stack, target_model, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    request = dict(max_new_tokens=16, logprobs=3, prompt_logprobs=2, echo=True, **SAMPLED)
    plain = stack.grpc.generate(PROMPT, policy="none", **request)
    speculative = stack.grpc.generate(PROMPT, policy="static:4", **request)
    assert speculative.token_ids == plain.token_ids and speculative.stats["accepted_tokens"] > 0
    assert values(speculative.logprobs) == pytest.approx(values(plain.logprobs), abs=TOL)
    sequence = prompt_ids + plain.token_ids
    ref = reference(target_model, sequence)
    assert [e.token_id for e in plain.logprobs] == plain.token_ids
    assert values(plain.logprobs) == pytest.approx([ref[i - 1, sequence[i]].item()
                                                    for i in range(len(prompt_ids), len(sequence))], abs=TOL)
    assert [len(e.top_logprobs) for e in plain.logprobs] == [3] * 16
    top = plain.logprobs[0].top_logprobs[0]
    assert top.token == tokenizer.decode([top.token_id]) and top.logprob == pytest.approx(
        ref[len(prompt_ids) - 1].max().item(), abs=TOL)
    # The prompt: every token, the first without a logprob, and its text.
    assert [e.token_id for e in plain.prompt_logprobs] == prompt_ids and plain.prompt_logprobs[0].logprob is None
    assert values(plain.prompt_logprobs[1:]) == pytest.approx([ref[i - 1, prompt_ids[i]].item()
                                                               for i in range(1, len(prompt_ids))], abs=TOL)
    assert plain.prompt_text == PROMPT
    # Streamed: the chunks' logprobs add up to the result's; the prompt's come with the first.
    stream = stack.grpc.stream(PROMPT, policy="static:4", **request)
    chunks = list(stream)
    assert [e.token_id for c in chunks for e in c.logprobs] == plain.token_ids
    assert values([e for c in chunks for e in c.logprobs]) == pytest.approx(values(plain.logprobs), abs=TOL)
    assert chunks[0].prompt_text == PROMPT and len(chunks[0].prompt_logprobs) == len(prompt_ids)
    assert all(not c.prompt_logprobs and not c.prompt_text for c in chunks[1:])
    assert values(stream.result.logprobs) == pytest.approx(values(plain.logprobs), abs=TOL)
    # Prompt scoring; a prompt given as ids is echoed decoded.
    scored = stack.grpc.generate(prompt_ids=prompt_ids, max_new_tokens=0, prompt_logprobs=1, echo=True)
    assert scored.token_ids == [] and scored.prompt_text == tokenizer.decode(prompt_ids)
    assert values(scored.prompt_logprobs[1:]) == pytest.approx(values(plain.prompt_logprobs[1:]), abs=TOL)


def test_completions_logprobs_and_echo(stack, tokenizer):
    grpc_result = stack.grpc.generate(PROMPT, policy="none", max_new_tokens=12, logprobs=2, prompt_logprobs=2,
                                      **GREEDY)
    for policy in ("none", "static:4"):
        answer = stack.openai.completions.create(model="m", prompt=PROMPT, max_tokens=12, logprobs=2, echo=True,
                                                 extra_body={"policy": policy, "ignore_eos": True})
        choice = answer.choices[0]
        assert choice.text == PROMPT + grpc_result.text
        logprobs = choice.logprobs
        n_prompt = len(grpc_result.prompt_logprobs)
        assert len(logprobs.tokens) == n_prompt + 12 == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.tokens == [e.token for e in grpc_result.prompt_logprobs + grpc_result.logprobs]
        assert logprobs.token_logprobs[1:] == pytest.approx(
            values(grpc_result.prompt_logprobs[1:] + grpc_result.logprobs), abs=TOL)
        for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
            assert top[token] == pytest.approx(value) and 2 <= len(top) <= 3
        offsets = logprobs.text_offset
        assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))
    # Streamed, without echo: the events' logprobs add up to the whole answer's.
    chunks = list(stack.openai.completions.create(model="m", prompt=PROMPT, max_tokens=12, logprobs=2, stream=True,
                                                  extra_body={"policy": "static:4", "ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((lp.token_logprobs for lp in streamed), []) == pytest.approx(values(grpc_result.logprobs), abs=TOL)
    assert sum((lp.tokens for lp in streamed), []) == [e.token for e in grpc_result.logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_result.text
    sent = 0  # each event's offsets start at the characters sent before it
    for chunk in (c for c in chunks if c.choices):
        if chunk.choices[0].logprobs:
            assert chunk.choices[0].logprobs.text_offset[0] == sent
        sent += len(chunk.choices[0].text)
    # Without logprobs: none.
    plain = stack.openai.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_prompt_scoring_with_max_tokens_0(stack):
    grpc_result = stack.grpc.generate(PROMPT, max_new_tokens=0, prompt_logprobs=1)
    for stream in (False, True):
        answer = stack.openai.completions.create(model="m", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                                                 stream=stream)
        if stream:
            chunks = [c for c in answer if c.choices]
            assert "".join(c.choices[0].text for c in chunks) == PROMPT
            logprobs = chunks[0].choices[0].logprobs
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            assert answer.choices[0].text == PROMPT and answer.usage.completion_tokens == 0
            logprobs = answer.choices[0].logprobs
        assert logprobs.token_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx(values(grpc_result.prompt_logprobs[1:]), abs=TOL)
    # Echo without logprobs: only the text.
    answer = stack.openai.completions.create(model="m", prompt=PROMPT, max_tokens=0, echo=True)
    assert answer.choices[0].text == PROMPT and answer.choices[0].logprobs is None


def test_vllm_prompt_logprobs(stack):
    grpc_result = stack.grpc.generate(PROMPT, max_new_tokens=2, prompt_logprobs=2)
    answer = stack.openai.completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                             extra_body={"prompt_logprobs": 2}).model_dump()
    shaped = answer["choices"][0]["prompt_logprobs"]
    assert shaped[0] is None and len(shaped) == len(grpc_result.prompt_logprobs)
    for position, entry in zip(shaped[1:], grpc_result.prompt_logprobs[1:]):
        own = position[str(entry.token_id)]
        assert own["logprob"] == pytest.approx(entry.logprob) and own["rank"] == entry.rank
        assert own["decoded_token"] == entry.token and 1 <= len(position) <= 3
    chat = stack.openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                                extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])


def test_chat_logprobs_streamed_and_not(stack, tokenizer):
    messages = [{"role": "user", "content": "Write a function."}]
    grpc_result = stack.grpc.generate(messages=[("user", "Write a function.")], policy="none", max_new_tokens=12,
                                      logprobs=3, **GREEDY)
    for policy in ("none", "static:4"):
        answer = stack.openai.chat.completions.create(model="m", messages=messages, max_tokens=12, logprobs=True,
                                                      top_logprobs=3,
                                                      extra_body={"policy": policy, "ignore_eos": True})
        content = answer.choices[0].logprobs.content
        assert len(content) == 12 == answer.usage.completion_tokens
        assert [c.token for c in content] == [e.token for e in grpc_result.logprobs]
        assert [c.logprob for c in content] == pytest.approx(values(grpc_result.logprobs), abs=TOL)
        for item in content:
            assert item.bytes == list(item.token.encode("utf-8")) and len(item.top_logprobs) == 3
            assert item.top_logprobs[0].logprob >= item.logprob - TOL
            assert all(top.bytes == list(top.token.encode("utf-8")) for top in item.top_logprobs)
    chunks = list(stack.openai.chat.completions.create(model="m", messages=messages, max_tokens=12, logprobs=True,
                                                       stream=True, extra_body={"policy": "static:4",
                                                                                "ignore_eos": True}))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [item.logprob for item in streamed] == pytest.approx(values(grpc_result.logprobs), abs=TOL)
    assert all(item.top_logprobs == [] for item in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_result.text
    plain = stack.openai.chat.completions.create(model="m", messages=messages, max_tokens=2, top_logprobs=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("route, fields, param", [
    ("completions", dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    ("completions", dict(logprobs=-1), "logprobs"),
    ("completions", dict(max_tokens=0), "max_tokens"),
    ("completions", dict(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("completions", dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    ("chat", dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("chat", dict(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("chat", dict(echo=True), "echo"),
])
def test_bad_values_are_400_naming_the_field(stack, route, fields, param):
    stream = fields.pop("stream", False)
    fields.setdefault("max_tokens", 2)
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "completions":
            stack.openai.completions.create(model="m", prompt=PROMPT, stream=stream, extra_body=fields)
        else:
            stack.openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                 stream=stream, extra_body=fields)
    error = raised.value.response.json()["error"]
    assert error["param"] == param, error
