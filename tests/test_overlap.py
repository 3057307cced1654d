"""Overlapped drafting (disco.engines.predraft): the draft engine pre-drafts the next block while
the target verifies, guessing that the whole block is accepted. Output must stay exact
(greedy == target-only, sampling keeps the target distribution), a pre-draft must be used
only on a right guess, and no worker thread may outlive its session."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.draft import DraftEngine
from disco.engines.in_process import make_decode
from disco.engines.target import TargetEngine
from disco.errors import InvalidRequest, SessionNotFound
from disco.interfaces import DraftSummary, DraftToken, Feedback
from disco.speculation.loop import SpeculativeGenerator
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.learned import make_learned_loader
from disco.speculation.sampling import logits_to_probs
from disco.stats import RequestStats
from tests import tiny
from tests.helpers import EOS_ID, PROMPTS, local_generator

#: The last one: DISCO's classifier under the rate rule (as the loop sends it where costs are measured).
POLICIES = ("none", "static:1", "static:4", "heuristic:2", "confidence:0.4", "disco:default",
            "disco:default@td=10,tv=60/60/60/60/60,rtt=5")
PROMPT = [5, 17, 300, 42, 7, 99, 3]


def greedy(max_new_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


class _Recording:
    """A drafter that keeps every DraftSummary it passes on."""

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.summaries: list[DraftSummary] = []

    def start_session(self, *args, **kwargs):
        return self.engine.start_session(*args, **kwargs)

    def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)

    def draft(self, session_id, feedback, max_lookahead):
        for event in self.engine.draft(session_id, feedback, max_lookahead):
            if isinstance(event, DraftSummary):
                self.summaries.append(event)
            yield event

    def total(self, name: str) -> int:
        return sum(int(getattr(summary, name)) for summary in self.summaries)


class _Patient:
    """A target that is slow enough for every pre-draft to finish (deterministic hits)."""

    def __init__(self, verifier: TargetEngine, drafter: DraftEngine) -> None:
        self.verifier, self.drafter = verifier, drafter

    def start_session(self, *args, **kwargs):
        return self.verifier.start_session(*args, **kwargs)

    def end_session(self, session_id: str) -> None:
        self.verifier.end_session(session_id)

    def verify(self, session_id, draft_token_ids, draft_probs):
        try:
            predraft = self.drafter.sessions.get(session_id).predraft
        except SessionNotFound:  # no draft session (target-only)
            predraft = None
        if predraft is not None:
            predraft.thread.join(timeout=10)
        return self.verifier.verify(session_id, draft_token_ids, draft_probs)


def overlap_generator(target, draft, tokenizer, patient: bool = True, policy_factory=None, eos=(EOS_ID,)
                      ) -> tuple[SpeculativeGenerator, _Recording]:
    engine = DraftEngine(draft, policy_factory or PolicyFactory(make_learned_loader()), overlap=True)
    drafter = _Recording(engine)
    verifier = _Patient(TargetEngine(target), engine) if patient else TargetEngine(target)
    return SpeculativeGenerator(drafter, verifier, make_decode(tokenizer), eos), drafter


def predraft_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("predraft")]


@pytest.fixture(scope="module")
def references(target_model, tokenizer):
    generator = SpeculativeGenerator(None, TargetEngine(target_model), make_decode(tokenizer), (EOS_ID,))
    return {prompt: generator.generate(tokenizer(prompt)["input_ids"], greedy(), SpeculationConfig(policy="none")
                                       ).token_ids for prompt in PROMPTS}


# -- (1) greedy exactness ---------------------------------------------------------------

@pytest.mark.parametrize("draft_name", ["same", "noisy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_with_overlap_equals_target_only(draft_name, policy, drafts, target_model, tokenizer, references):
    """Exact output, and the very blocks drafting without overlap makes (same tokens, same
    stop decisions): a pre-draft is only ever used where it is what drafting would give."""
    generator, drafter = overlap_generator(target_model, drafts[draft_name], tokenizer)
    plain = local_generator(target_model, drafts[draft_name], tokenizer, PolicyFactory(make_learned_loader()))
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt)["input_ids"]
        result = generator.generate(ids, greedy(), SpeculationConfig(policy=policy))
        assert result.token_ids == references[prompt], (draft_name, policy, prompt)
        expected = plain.generate(ids, greedy(), SpeculationConfig(policy=policy)).stats
        assert (result.stats.lookaheads, result.stats.accepted_per_position) == (
            expected.lookaheads, expected.accepted_per_position)
    if policy == "none":
        assert not drafter.summaries
        return
    if draft_name == "same":  # the guess is the target's own choice: hits, and used pre-drafts
        assert drafter.total("overlap_hit") > 0 and drafter.total("predrafted_used") > 0
    else:
        assert drafter.total("overlap_miss") > 0 and drafter.total("predrafted_wasted") > 0
    assert not predraft_threads()


# -- (2) sampling keeps the target distribution -----------------------------------------

def test_seeded_sampling_gives_the_same_tokens_with_and_without_overlap(drafts, target_model, tokenizer):
    """The worker samples on a clone of the session's generator, adopted only on a hit: a
    seeded request's draft tokens, hence its output, do not depend on overlap."""
    plain = SpeculativeGenerator(DraftEngine(drafts["noisy"], PolicyFactory()), TargetEngine(target_model),
                                 make_decode(tokenizer), (EOS_ID,))
    overlapped, drafter = overlap_generator(target_model, drafts["noisy"], tokenizer, patient=False)
    for seed, (prompt, policy) in enumerate(itertools.product(PROMPTS[:2], ("static:4", "heuristic:2"))):
        ids = tokenizer(prompt)["input_ids"]
        sampling = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        expected = plain.generate(ids, sampling, SpeculationConfig(policy=policy)).token_ids
        assert overlapped.generate(ids, sampling, SpeculationConfig(policy=policy)).token_ids == expected
    assert drafter.total("overlap_hit") > 0


class _TinyVocabTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_sampling_with_overlap_matches_target_distribution():
    """Four tokens over a vocabulary of 4 with static:1: after a fully accepted first block,
    the third token is drafted during the first verification (a hit when the bonus is the
    draft's guess). The empirical joint of the third and fourth tokens must be the target's
    exact joint (enumerated), as in test_sampled.py."""
    vocab, trials = 4, 300
    target = tiny.qwen2(seed=21, vocab_size=vocab, hidden=16, layers=1)
    draft = tiny.noisy_copy(target, scale=0.1, seed=22)  # close enough for hits, with rejections
    prompt = [1, 2, 3]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)
    with torch.inference_mode():
        prefixes = torch.tensor([prompt + list(rest) for rest in itertools.product(range(vocab), repeat=3)])
        probs = logits_to_probs(target(prefixes).logits[:, len(prompt) - 1:], params).double()  # [vocab^3, 4, vocab]
    joint = np.zeros((vocab, vocab))  # P(token 3, token 4)
    for index, (a, b, c) in enumerate(itertools.product(range(vocab), repeat=3)):
        row = probs[index]
        joint[c] += float(row[0, a] * row[1, b] * row[2, c]) * row[3].numpy()
    generator, drafter = overlap_generator(target, draft, _TinyVocabTokenizer(), policy_factory=PolicyFactory(),
                                           eos=())
    counts = np.zeros((vocab, vocab))
    for seed in range(trials):
        result = generator.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}),
                                    SpeculationConfig(policy="static:1"))
        counts[result.token_ids[2], result.token_ids[3]] += 1
    assert drafter.total("overlap_hit") > 10 and drafter.total("predrafted_used") > 10
    assert drafter.total("overlap_miss") > 10
    expected, observed = joint.reshape(-1) * trials / joint.sum(), counts.reshape(-1)
    assert observed[expected == 0].sum() == 0
    order = np.argsort(expected)
    expected, observed = expected[order], observed[order]
    rare = np.cumsum(expected) < 25  # pool rare cells so the chi-square approximation holds
    expected = np.append(expected[~rare], expected[rare].sum())
    observed = np.append(observed[~rare], observed[rare].sum())
    assert chisquare(observed, expected).pvalue > 1e-3


# -- (3) threads: ending sessions, worker errors, concurrent sessions ---------------------

def _slow_forwards(engine: DraftEngine, delay_s: float, fail_in_worker: bool = False) -> None:
    forward = engine.batcher.forward

    def slow(*args, **kwargs):
        if threading.current_thread().name.startswith("predraft"):
            time.sleep(delay_s)
            if fail_in_worker:
                raise RuntimeError("injected pre-draft failure")
        return forward(*args, **kwargs)

    engine.batcher.forward = slow


def test_ending_a_session_stops_its_worker(drafts, monkeypatch):
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    engine = DraftEngine(drafts["noisy"], PolicyFactory(), overlap=True)
    _slow_forwards(engine, 0.05)
    engine.start_session("s", PROMPT, greedy(), "static:8")
    assert len([e for e in engine.draft("s", None, 8) if isinstance(e, DraftToken)]) == 8
    predraft = engine.sessions.get("s").predraft
    assert predraft is not None and predraft.thread.is_alive()
    engine.end_session("s")
    assert not predraft.thread.is_alive() and not predraft_threads()
    assert predraft.error is None and predraft.forwards < 9 and not errors
    assert engine.active_sessions() == 0


def test_a_failing_worker_is_a_miss(drafts, target_model, tokenizer, references):
    generator, drafter = overlap_generator(target_model, drafts["same"], tokenizer)
    _slow_forwards(drafter.engine, 0.0, fail_in_worker=True)
    prompt = PROMPTS[0]
    result = generator.generate(tokenizer(prompt)["input_ids"], greedy(), SpeculationConfig(policy="static:4"))
    assert result.token_ids == references[prompt]
    assert drafter.total("overlap_miss") == len(drafter.summaries) - 1 > 0  # all but the first block
    assert drafter.total("overlap_hit") == 0 and not predraft_threads()


def test_concurrent_sessions_with_overlap_equal_their_solo_output(drafts, target_model, tokenizer):
    generator, drafter = overlap_generator(target_model, drafts["noisy"], tokenizer, patient=False)
    sampled = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    jobs = [(PROMPTS[i % 3], policy, sampled if i >= 6 else greedy())
            for i, policy in enumerate(("static:4", "heuristic:2", "confidence:0.4", "disco:default") * 2)]

    def run(job):
        prompt, policy, sampling = job
        return generator.generate(tokenizer(prompt)["input_ids"], sampling, SpeculationConfig(policy=policy)).token_ids

    solo = [run(job) for job in jobs]
    together: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def worker(index: int) -> None:
        barrier.wait()
        together[index] = run(jobs[index])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == solo
    assert drafter.engine.active_sessions() == 0 and not predraft_threads()


# -- (4) hit/miss semantics and the new fields -------------------------------------------

def _block(engine, session_id, feedback, max_lookahead) -> tuple[list[int], DraftSummary]:
    events = list(engine.draft(session_id, feedback, max_lookahead))
    return [e.token_id for e in events if isinstance(e, DraftToken)], events[-1]


def _fresh_block(model, prompt, max_lookahead, policy="static:3") -> list[int]:
    engine = DraftEngine(model, PolicyFactory())
    engine.start_session("fresh", prompt, greedy(), policy)
    return _block(engine, "fresh", None, max_lookahead)[0]


def _finished_predraft(engine, session_id):
    predraft = engine.sessions.get(session_id).predraft
    predraft.thread.join()
    return predraft


def test_hits_use_the_predraft_and_misses_drop_it(drafts):
    model = drafts["noisy"]
    engine = DraftEngine(model, PolicyFactory(), overlap=True)
    engine.start_session("s", PROMPT, greedy(), "static:3")
    first, summary = _block(engine, "s", None, 3)
    assert summary.overlap_hit is summary.overlap_miss is False and summary.predrafted_used == 0
    # A hit: the pre-drafted block is streamed as it is, without a forward in the call.
    guess = _finished_predraft(engine, "s").guess
    with pytest.raises(InvalidRequest):  # bad feedback keeps the pre-draft for the retry
        _block(engine, "s", Feedback(4, guess), 3)
    second, summary = _block(engine, "s", Feedback(3, guess), 3)
    context = PROMPT + first + [guess]
    assert second == _fresh_block(model, context, 3)
    assert (summary.overlap_hit, summary.predrafted_used, summary.predrafted_wasted) == (True, 3, 0)
    assert summary.forwards == 4  # the guess + 3 tokens, all in the background
    # A hit under a smaller cap: the extra pre-drafted token is dropped.
    guess = _finished_predraft(engine, "s").guess
    third, summary = _block(engine, "s", Feedback(3, guess), 2)
    context += second + [guess]
    assert third == _fresh_block(model, context, 2)
    assert (summary.overlap_hit, summary.predrafted_used, summary.predrafted_wasted) == (True, 2, 1)
    # A miss: the rollback is the usual one.
    predraft = _finished_predraft(engine, "s")
    bonus = (predraft.guess + 1) % 500
    fourth, summary = _block(engine, "s", Feedback(1, bonus), 3)
    assert fourth == _fresh_block(model, context + third[:1] + [bonus], 3)
    assert (summary.overlap_miss, summary.overlap_hit, summary.predrafted_wasted) == (True, False, 2)
    engine.end_session("s")


def test_the_new_fields_have_defaults_and_round_trip():
    assert DraftSummary(forwards=1, elapsed_ns=2, stop_reason="policy") == DraftSummary(
        1, 2, "policy", predrafted_used=0, predrafted_wasted=0, overlap_hit=False, overlap_miss=False)
    stats = RequestStats(overlap_hits=2, overlap_misses=3, predrafted_used=5, predrafted_wasted=7)
    data = stats.to_dict()
    assert {key: data[key] for key in ("overlap_hits", "overlap_misses", "predrafted_used", "predrafted_wasted")} \
        == {"overlap_hits": 2, "overlap_misses": 3, "predrafted_used": 5, "predrafted_wasted": 7}
    assert RequestStats.from_dict(data) == stats


def test_the_oracle_is_never_predrafted(drafts, target_model, tokenizer, references):
    generator, drafter = overlap_generator(target_model, drafts["noisy"], tokenizer)
    prompt = PROMPTS[0]
    result = generator.generate(tokenizer(prompt)["input_ids"], greedy(), SpeculationConfig(policy="oracle"))
    assert result.token_ids == references[prompt]
    assert drafter.total("overlap_hit") == drafter.total("overlap_miss") == 0
