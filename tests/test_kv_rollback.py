"""After a rejection, the rolled-back KV cache behaves exactly like a fresh prefill of
the accepted prefix."""

import torch

from disco.config import SamplingParams
from disco.engines.draft import DraftEngine
from disco.engines.kv import CachedSequence
from disco.interfaces import DraftToken, Feedback
from disco.speculation.policies import PolicyFactory

PROMPT = [11, 57, 203, 9, 140, 77, 5]


def test_truncated_cache_equals_fresh_forward(target_model):
    sequence = CachedSequence(target_model, PROMPT)
    sequence.prefill()
    sequence.tokens.extend([300, 301, 302, 303])  # a draft block
    sequence.forward(5)
    sequence.truncate(len(PROMPT) + 1)  # one accepted
    sequence.tokens.append(42)  # correction
    logits, _ = sequence.forward(1)
    with torch.inference_mode():
        fresh = target_model(torch.tensor([PROMPT + [300, 42]])).logits[0, -1].float()
    assert sequence.cache.get_seq_length() == len(PROMPT) + 2 == sequence.cache_len
    torch.testing.assert_close(logits[0], fresh, rtol=1e-5, atol=1e-5)


def _draft_block(engine, session_id, feedback, k):
    return [e.token_id for e in engine.draft(session_id, feedback, k) if isinstance(e, DraftToken)]


def test_draft_engine_rollback_matches_fresh_session(drafts):
    draft = drafts["noisy"]
    engine = DraftEngine(draft, PolicyFactory())
    greedy = SamplingParams(max_new_tokens=64)
    engine.start_session("a", PROMPT, greedy, "static:5")
    first_block = _draft_block(engine, "a", None, 5)
    assert len(first_block) == 5
    correction = (first_block[2] + 1) % 500
    after_rollback = _draft_block(engine, "a", Feedback(num_accepted=2, next_token_id=correction), 5)

    engine.start_session("b", PROMPT + first_block[:2] + [correction], greedy, "static:5")
    fresh = _draft_block(engine, "b", None, 5)
    assert after_rollback == fresh


def test_feedback_is_validated(drafts):
    import pytest

    from disco.errors import InvalidRequest
    engine = DraftEngine(drafts["noisy"], PolicyFactory())
    engine.start_session("s", PROMPT, SamplingParams(), "static:3")
    with pytest.raises(InvalidRequest, match="no draft block"):
        _draft_block(engine, "s", Feedback(0, 1), 3)
    _draft_block(engine, "s", None, 3)
    with pytest.raises(InvalidRequest, match="feedback of the previous verification is required"):
        _draft_block(engine, "s", None, 3)
    with pytest.raises(InvalidRequest, match="accepts 4 tokens of a block of 3"):
        _draft_block(engine, "s", Feedback(4, 1), 3)
    assert len(_draft_block(engine, "s", Feedback(3, 1), 3)) == 3  # still usable after bad input
