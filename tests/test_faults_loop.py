"""The loop's token list is the source of truth: lost sessions are re-prefilled and a
failing draft service degrades the request to target-only — output stays exact."""

from disco.config import SamplingParams, SpeculationConfig
from disco.errors import Unavailable
from tests.helpers import PROMPTS, local_generator

SAMPLING = SamplingParams(max_new_tokens=40, ignore_eos=True)


class FlakyDrafter:
    """Wraps a real drafter; from the n-th draft call on, the service is 'down'."""

    def __init__(self, drafter, fail_from_call):
        self.inner, self.fail_from_call, self.calls = drafter, fail_from_call, 0

    def start_session(self, *args, **kwargs):
        if self.calls >= self.fail_from_call:
            raise Unavailable("draft service down")
        return self.inner.start_session(*args, **kwargs)

    def draft(self, session_id, feedback, max_lookahead):
        self.calls += 1
        if self.calls >= self.fail_from_call:
            raise Unavailable("draft service down")
        return self.inner.draft(session_id, feedback, max_lookahead)

    def end_session(self, session_id):
        return self.inner.end_session(session_id)


class SessionDroppingVerifier:
    """Wraps a real verifier and forgets the session before the n-th verify (a restart)."""

    def __init__(self, verifier, drop_before_call):
        self.inner, self.drop_before_call, self.calls = verifier, drop_before_call, 0

    def start_session(self, *args, **kwargs):
        return self.inner.start_session(*args, **kwargs)

    def verify(self, session_id, draft_ids, draft_probs):
        self.calls += 1
        if self.calls == self.drop_before_call:
            self.inner.end_session(session_id)
        return self.inner.verify(session_id, draft_ids, draft_probs)

    def end_session(self, session_id):
        return self.inner.end_session(session_id)


def _reference(target_model, tokenizer, ids):
    return local_generator(target_model, None, tokenizer).generate(ids, SAMPLING, SpeculationConfig("none")).token_ids


def test_draft_down_mid_request_continues_target_only(target_model, drafts, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.drafter = FlakyDrafter(generator.drafter, fail_from_call=4)
    result = generator.generate(ids, SAMPLING, SpeculationConfig("static:4"))
    assert result.token_ids == _reference(target_model, tokenizer, ids)
    assert result.stats.draft_fallbacks == 1
    assert result.stats.lookaheads[:3] == [4, 4, 4] and set(result.stats.lookaheads[3:]) == {0}


def test_draft_down_from_the_start(target_model, drafts, tokenizer):
    ids = tokenizer(PROMPTS[1])["input_ids"]
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.drafter = FlakyDrafter(generator.drafter, fail_from_call=0)
    result = generator.generate(ids, SAMPLING, SpeculationConfig("static:4"))
    assert result.token_ids == _reference(target_model, tokenizer, ids)
    assert result.stats.draft_fallbacks == 1 and result.stats.draft_tokens == 0


def test_lost_draft_session_is_reprefilled(target_model, drafts, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    real_draft = generator.drafter.draft
    calls = []

    def draft_forgetting_once(session_id, feedback, max_lookahead):
        calls.append(session_id)
        if len(calls) == 3:
            generator.drafter.end_session(session_id)  # the draft service restarted
        return real_draft(session_id, feedback, max_lookahead)

    generator.drafter.draft = draft_forgetting_once
    result = generator.generate(ids, SAMPLING, SpeculationConfig("static:3"))
    assert result.token_ids == _reference(target_model, tokenizer, ids)
    assert result.stats.draft_fallbacks == 0 and min(result.stats.lookaheads[:-1]) == 3


def test_lost_target_session_is_reprefilled(target_model, drafts, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.verifier = SessionDroppingVerifier(generator.verifier, drop_before_call=5)
    result = generator.generate(ids, SAMPLING, SpeculationConfig("static:3"))
    assert result.token_ids == _reference(target_model, tokenizer, ids)
    assert result.stats.target_reprefills == 1


def test_resumed_sampling_keeps_the_seed_and_gets_the_remaining_budget():
    """Noise is keyed by (seed, absolute position) and a re-created session starts at the
    same absolute position: the request's own seed draws fresh noise for every later token."""
    sampling = SamplingParams(max_new_tokens=20, temperature=0.8, seed=7)
    assert sampling.resumed_after(0) is sampling
    resumed = sampling.resumed_after(5)
    assert resumed.max_new_tokens == 15 and resumed.temperature == 0.8 and resumed.seed == 7
    assert SamplingParams(max_new_tokens=20).resumed_after(5).seed is None
    assert sampling.resumed_after(25).max_new_tokens == 1


def test_lost_target_session_is_reprefilled_with_the_same_seed_and_text_when_sampling(target_model, drafts,
                                                                                      tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    undisturbed = local_generator(target_model, drafts["noisy"], tokenizer).generate(
        ids, sampling, SpeculationConfig("static:3"))
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    dropping = SessionDroppingVerifier(generator.verifier, drop_before_call=4)
    starts = []
    real_start = dropping.start_session

    def recording_start(session_id, prompt_ids, sampling):
        starts.append((len(prompt_ids), sampling.seed, sampling.max_new_tokens))
        return real_start(session_id, prompt_ids, sampling)

    dropping.start_session = recording_start
    generator.verifier = dropping
    result = generator.generate(ids, sampling, SpeculationConfig("static:3"))
    assert result.stats.target_reprefills == 1 and len(result.token_ids) == 24
    (first_len, first_seed, _), (again_len, again_seed, again_budget) = starts
    committed = again_len - first_len
    assert committed > 0 and again_budget == 24 - committed
    assert first_seed == again_seed == 11
    assert result.token_ids == undisturbed.token_ids  # the same text as without the loss


class SlowStart:
    """Wraps a real drafter or verifier: ``start_session`` takes ``delay`` s longer (a
    prefill on another device), and records when it ran; optionally it then fails."""

    def __init__(self, inner, delay, fail=None):
        self.inner, self.delay, self.fail, self.spans = inner, delay, fail, []

    def start_session(self, *args, **kwargs):
        import time

        began = time.monotonic()
        time.sleep(self.delay)
        try:
            if self.fail is not None:
                raise self.fail
            return self.inner.start_session(*args, **kwargs)
        finally:
            self.spans.append((began, time.monotonic()))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_parallel_prefill_starts_both_sessions_at_once_and_stays_exact(target_model, drafts, tokenizer):
    """The orchestrator's loop (parallel_prefill) prefills the draft while the target
    prefills: the two start_session calls overlap in time, the output is target-only's."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.parallel_prefill = True
    generator.drafter = SlowStart(generator.drafter, 0.3)
    generator.verifier = SlowStart(generator.verifier, 0.3)
    result = generator.generate(ids, SAMPLING, SpeculationConfig("static:4"))
    assert result.token_ids == _reference(target_model, tokenizer, ids)
    (draft_began, draft_ended), (target_began, target_ended) = generator.drafter.spans[0], generator.verifier.spans[0]
    assert draft_began < target_ended and target_began < draft_ended  # the two prefills overlapped
    assert result.stats.draft_tokens > 0


def test_parallel_prefill_failures_end_every_session(target_model, drafts, tokenizer):
    """A target that fails while the draft prefills: the error reaches the caller once the
    draft call is over, and the draft session is ended (none leaks). A draft service that
    is down: the request goes on target-only, exact."""
    import pytest

    from disco.errors import ModelError

    ids = tokenizer(PROMPTS[1])["input_ids"]
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    generator.parallel_prefill = True
    engine = generator.drafter
    generator.drafter = SlowStart(engine, 0.2)
    generator.verifier = SlowStart(generator.verifier, 0.0, fail=ModelError("target prefill failed"))
    with pytest.raises(ModelError, match="target prefill failed"):
        generator.generate(ids, SAMPLING, SpeculationConfig("static:4"))
    assert generator.drafter.spans and engine.active_sessions() == 0
    generator.verifier = generator.verifier.inner
    generator.drafter = SlowStart(engine, 0.0, fail=Unavailable("draft service down"))
    result = generator.generate(ids, SAMPLING, SpeculationConfig("static:4"))
    assert result.token_ids == _reference(target_model, tokenizer, ids) and result.stats.draft_fallbacks == 1
    assert engine.active_sessions() == 0
