"""Several outputs per request (issue 48, item 4): ``n``, ``best_of`` and a list of prompts on the
OpenAI-compatible gateway, with the official ``openai`` client against real gRPC services on
loopback (tiny float32 models).

* Each choice is a single request with its derived seed (``choice_seed``: the request's seed plus
  the choice's index, vLLM's rule), streamed = non-streamed per choice, prompt-major order for a
  list of prompts, ``best_of`` returns the candidates with the highest summed target logprob, a
  speculative policy gives target-only's text for every choice.
* Errors are 400s naming the field; a failing output fails the request and frees every session.
* The fan-out machinery by hand: :class:`~orchestrator.http.middleware.Admission` takes a place
  per output atomically and first come first served; the first failure cancels the other calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import openai
import pytest

from orchestrator.http.choices import ENDED, ChoiceStreams, all_or_none, choice_seed
from orchestrator.http.config import HttpConfig
from orchestrator.http.errors import ApiError
from orchestrator.http.middleware import Admission
from orchestrator.http.server import start_in_thread
from tests.grpc_fixtures import CLIENT_TIMEOUT_S
from tests.helpers import PROMPTS
from tests.http_fixtures import MODEL, stack  # noqa: F401 - fixture

PROMPT = PROMPTS[0]
MAX = 12
SAMPLED = dict(temperature=0.9, top_p=0.95)


def complete(stack, prompt=PROMPT, **fields):
    """A completion through the openai client; the fields it has no argument for go in the body."""
    extra = {key: fields.pop(key) for key in ("policy", "ignore_eos") if key in fields}
    return stack.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=fields.pop("max_tokens", MAX),
                                           extra_body={"ignore_eos": True, **extra}, **fields)


def texts(answer):
    assert [choice.index for choice in answer.choices] == list(range(len(answer.choices)))
    return [choice.text for choice in answer.choices]


def streamed_texts(chunks, chat=False):
    """Each choice's text, from its interleaved events (and each one's finish reason)."""
    parts, finish = defaultdict(str), {}
    for chunk in chunks:
        for choice in chunk.choices:
            parts[choice.index] += (choice.delta.content or "") if chat else choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return [parts[index] for index in sorted(parts)], finish


# --- seeds ---------------------------------------------------------------------------------------


def test_the_seed_of_a_choice():
    assert [choice_seed(11, i) for i in range(3)] == [11, 12, 13]
    assert choice_seed(2**63 - 1, 1) == 0 and choice_seed(None, 2) is None


def test_n_seeded_choices_are_single_requests_with_their_derived_seeds(stack):
    answer = complete(stack, n=3, seed=11, **SAMPLED)
    got = texts(answer)
    singles = [complete(stack, seed=choice_seed(11, i), **SAMPLED) for i in range(3)]
    assert got == [single.choices[0].text for single in singles]
    assert got[0] == complete(stack, n=1, seed=11, **SAMPLED).choices[0].text  # choice 0: the request's seed
    assert len(set(got)) == 3, "distinct seeds should sample distinct texts"
    extra = answer.model_extra
    assert extra["seed"] == 11 and [choice.model_extra["seed"] for choice in answer.choices] == [11, 12, 13]
    assert answer.usage.completion_tokens == 3 * MAX
    assert answer.usage.prompt_tokens == singles[0].usage.prompt_tokens  # one prompt: counted once
    assert extra["speculation"]["iterations"] == sum(c.model_extra["speculation"]["iterations"]
                                                     for c in answer.choices)


def test_unseeded_choices_each_get_their_own_random_seed(stack):
    answer = complete(stack, n=3, **SAMPLED)
    seeds = [choice.model_extra["seed"] for choice in answer.choices]
    assert len(set(seeds)) == 3 and all(isinstance(seed, int) for seed in seeds)
    assert answer.model_extra["seed"] is None  # no one seed reproduces the answer: each choice names its own
    assert complete(stack, seed=seeds[2], **SAMPLED).choices[0].text == answer.choices[2].text


def test_n_1_is_unchanged(stack):
    answer = complete(stack, seed=4, **SAMPLED).model_dump()
    assert answer["seed"] == 4 and "seed" not in answer["choices"][0] and "speculation" not in answer["choices"][0]


# --- streamed, chat, several prompts --------------------------------------------------------------


def test_streamed_choices_equal_the_non_streamed_ones(stack):
    whole = complete(stack, n=3, seed=21, **SAMPLED)
    chunks = list(complete(stack, n=3, seed=21, stream=True, stream_options={"include_usage": True}, **SAMPLED))
    parts, finish = streamed_texts(chunks)
    assert parts == texts(whole) and finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * MAX
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and chunks[-1].model_extra["seed"] == 21
    ends = [choice.model_extra for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert sorted(end["seed"] for end in ends) == [21, 22, 23]


def test_chat_n_streamed_and_not(stack):
    messages = [{"role": "user", "content": "Write a function."}]
    fields = dict(model=MODEL, messages=messages, max_tokens=MAX, n=2, seed=3, extra_body={"ignore_eos": True},
                  **SAMPLED)
    whole = stack.openai.chat.completions.create(**fields)
    got = [choice.message.content for choice in whole.choices]
    assert [choice.index for choice in whole.choices] == [0, 1] and got[0] != got[1]
    single = stack.openai.chat.completions.create(**{**fields, "n": 1, "seed": 4})
    assert single.choices[0].message.content == got[1]
    chunks = list(stack.openai.chat.completions.create(**fields, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    assert streamed_texts(chunks, chat=True)[0] == got
    assert whole.usage.completion_tokens == 2 * MAX


def test_a_list_of_prompts_is_prompt_major(stack, tokenizer):
    prompts = [PROMPTS[0], PROMPTS[1]]
    answer = complete(stack, prompt=prompts, n=2, seed=7, **SAMPLED)
    expected = [complete(stack, prompt=prompts[k // 2], seed=choice_seed(7, k % 2), **SAMPLED).choices[0].text
                for k in range(4)]
    assert texts(answer) == expected
    assert answer.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert answer.usage.completion_tokens == 4 * MAX
    chunks = list(complete(stack, prompt=prompts, n=2, seed=7, stream=True, **SAMPLED))
    assert streamed_texts(chunks)[0] == expected
    # Token ids: a list of lists, the same order; with echo each choice starts with its own prompt.
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    echoed = complete(stack, prompt=ids, n=2, seed=7, echo=True, **SAMPLED)
    assert [c.text for c in echoed.choices] == [tokenizer.decode(ids[k // 2]) + expected[k] for k in range(4)]


# --- best_of ---------------------------------------------------------------------------------------


def summed_logprob(answer):
    return sum(answer.choices[0].logprobs.token_logprobs)


def test_best_of_returns_the_candidates_with_the_highest_summed_logprob(stack):
    candidates = [complete(stack, seed=choice_seed(5, i), logprobs=0, **SAMPLED) for i in range(3)]
    scores = [summed_logprob(candidate) for candidate in candidates]
    assert len(set(scores)) == 3
    order = sorted(range(3), key=lambda i: -scores[i])
    best = complete(stack, best_of=3, seed=5, **SAMPLED)
    assert texts(best) == [candidates[order[0]].choices[0].text]
    assert best.choices[0].logprobs is None  # ranked by logprobs, shown only when asked
    assert best.usage.completion_tokens == 3 * MAX  # every candidate was generated
    two = complete(stack, best_of=3, n=2, seed=5, logprobs=1, **SAMPLED)
    assert texts(two) == [candidates[i].choices[0].text for i in order[:2]]
    assert [sum(choice.logprobs.token_logprobs) for choice in two.choices] == pytest.approx(
        [scores[i] for i in order[:2]], abs=1e-4)


# --- speculation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, dict(seed=9, **SAMPLED)], ids=["greedy", "seeded"])
def test_a_speculative_policy_gives_target_only_text_for_every_choice(stack, sampling):
    answers = {policy: complete(stack, n=3, policy=policy, **sampling) for policy in ("none", "static:4")}
    assert texts(answers["static:4"]) == texts(answers["none"])
    assert answers["static:4"].model_extra["speculation"]["draft_tokens"] > 0
    if not sampling:  # greedy choices are simply identical
        assert len(set(texts(answers["none"]))) == 1


# --- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    (dict(n=0), "n"),
    (dict(n=17), "n"),
    (dict(n=5, prompt=["a", "b", "c", "d"]), "n"),
    (dict(prompt=["a"] * 17), "prompt"),
    (dict(best_of=2, n=3), "best_of"),
    (dict(best_of=3, stream=True), "best_of"),
    (dict(best_of=17), "best_of"),
    (dict(best_of=0), "best_of"),
    (dict(prompt=["a", ""]), "prompt"),
    (dict(prompt=["a", [1, 2]]), "prompt"),
])
def test_bad_values_are_a_400_naming_the_field(stack, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        result = complete(stack, **{"prompt": fields.pop("prompt", PROMPT), **fields})
        list(result)  # a stream that was (wrongly) accepted
    error = raised.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_chat_has_no_best_of(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        stack.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                             extra_body={"best_of": 2})
    error = raised.value.response.json()["error"]
    assert error["param"] == "best_of" and "not supported yet" in error["message"]


def wait_idle(stack, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while (active := stack.grpc.info()["active_sessions"]) != {"orchestrator": 0, "draft": 0, "target": 0}:
        assert time.monotonic() < deadline, f"sessions still held: {active}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_failing_output_fails_the_request_and_frees_every_session(stack, stream):
    too_long = [1] * (stack.grpc.info()["limits"]["max_context"] + 1)
    with pytest.raises(openai.BadRequestError) as raised:
        list(complete(stack, prompt=[[5, 6, 7], too_long], n=2, max_tokens=200, stream=stream))
    assert raised.value.response.json()["error"]["param"] == "prompt"
    wait_idle(stack)
    assert texts(complete(stack, n=2))  # the gateway and its places are fine


def test_a_request_takes_one_place_per_output(stack):
    gateway = start_in_thread(HttpConfig(stack.orch.address, port=0, max_concurrent=2))
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        with pytest.raises(openai.BadRequestError) as raised:  # could never run at once: refused outright
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=3)
        assert raised.value.response.json()["error"]["param"] == "n"
        assert len(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2).choices) == 2
    finally:
        gateway.stop()


# --- the machinery by hand ---------------------------------------------------------------------------


def test_admission_takes_every_place_at_once_first_come_first_served():
    async def scenario():
        admission = Admission(max_concurrent=3, max_queue=2)
        first = await admission.wait(2)
        big = admission.wait(2)  # 1 place free: waits, holding none
        small = admission.wait(1)  # fits, but does not overtake the one ahead of it
        await asyncio.sleep(0)
        assert not big.done() and not small.done() and admission.running == 2
        with pytest.raises(ApiError) as raised:  # the queue is full
            admission.wait(1)
        assert raised.value.status == 429
        first.release()
        (await big).release()
        (await small).release()
        await asyncio.sleep(0)
        assert admission.running == 0 and admission.waiting == 0
        # A request that leaves the queue lets the ones behind it start.
        held = await admission.wait(3)
        leaving, behind = admission.wait(3), admission.wait(1)
        leaving.cancel()
        await asyncio.sleep(0)
        assert not behind.done()
        held.release()
        (await behind).release()
        with pytest.raises(ValueError):
            admission.wait(4)

    asyncio.run(scenario())


def test_the_first_failure_cancels_the_other_calls():
    async def scenario():
        cancelled = []

        async def slow(index):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(index)
                raise

        async def failing():
            await asyncio.sleep(0.01)
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            await all_or_none([slow(0), failing(), slow(2)])
        await asyncio.sleep(0)
        assert sorted(cancelled) == [0, 2]
        assert await all_or_none([asyncio.sleep(0, result=i) for i in range(3)]) == [0, 1, 2]

    asyncio.run(scenario())


class FakeStream:
    """An :class:`~orchestrator.client.AsyncGenerationStream` of ``chunks`` (an exception: raised there)."""

    def __init__(self, chunks, delay=0.0):
        self.chunks, self.delay, self.result, self.cancelled = chunks, delay, None, False

    async def __aiter__(self):
        for chunk in self.chunks:
            await asyncio.sleep(self.delay)
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk
        self.result = "done"

    def cancel(self):
        self.cancelled = True


def test_streams_are_read_together_and_a_failure_cancels_the_others():
    async def read(streams):
        together = ChoiceStreams(streams)
        await together.start()
        events = []
        try:
            async for index, chunk in together.events():
                events.append((index, chunk))
        finally:
            together.cancel()
        return events

    async def scenario():
        events = await read([FakeStream(["a", "b"], 0.01), FakeStream(["c", "d", "e"], 0.003)])
        assert [e for e in events if e[0] == 0] == [(0, "a"), (0, "b"), (0, ENDED)]
        assert [e for e in events if e[0] == 1] == [(1, "c"), (1, "d"), (1, "e"), (1, ENDED)]
        assert events[:2] == [(0, "a"), (1, "c")]  # the first chunks first, then as they come
        healthy, failing = FakeStream(["a"] * 50, 0.01), FakeStream(["c", RuntimeError("mid-stream")], 0.001)
        with pytest.raises(RuntimeError, match="mid-stream"):
            await read([healthy, failing])
        assert healthy.cancelled and healthy.result is None

    asyncio.run(scenario())
