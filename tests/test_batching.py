"""Cross-session batching: a padded batch computes what each session computes alone."""

import threading
import time

import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.engines.batching import ForwardBatcher
from disco.engines.kv import CachedSequence
from tests.helpers import generate_at_once, local_generator

PROMPTS = ([5, 9, 11, 40, 7, 3], [8, 100, 22], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
PENDING = ([17, 18], [19], [20, 21, 22])


def _sequences(model):
    sequences = []
    for prompt, pending in zip(PROMPTS, PENDING):
        sequence = CachedSequence(model, prompt)
        sequence.prefill()
        sequence.forward(1)
        sequence.tokens.extend(pending)
        sequences.append(sequence)
    return sequences


def test_packed_forward_matches_each_session_alone(target_model):
    alone, batched = _sequences(target_model), _sequences(target_model)
    expected = [s.forward(len(p)) for s, p in zip(alone, PENDING)]
    results = CachedSequence.forward_batch(batched, [len(p) for p in PENDING], [True] * len(batched))
    for (expected_logits, _), (logits, hidden) in zip(expected, results):
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
        assert hidden.shape == (logits.shape[0], target_model.config.hidden_size)
    for a, b in zip(alone, batched):  # caches come back per session and stay usable
        assert a.cache_len == b.cache_len == b.cache.get_seq_length()
        a.tokens.append(33)
        b.tokens.append(33)
        torch.testing.assert_close(a.forward(1)[0], b.forward(1)[0], rtol=1e-4, atol=1e-4)


def test_concurrent_sessions_are_batched_and_exact(target_model, drafts, tokenizer):
    generator = local_generator(target_model, drafts["noisy"], tokenizer)
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    jobs = [(tokenizer(f"def f{i}(x):\n    return x * {i}")["input_ids"], policy)
            for i, policy in enumerate(["static:3", "none", "heuristic:2", "static:5", "confidence:0.2",
                                        "static:1", "static:4", "none"])]
    alone = [generator.generate(ids, sampling, SpeculationConfig(policy=policy)).token_ids for ids, policy in jobs]
    target_only = [generator.generate(ids, sampling, SpeculationConfig(policy="none")).token_ids for ids, _ in jobs]
    assert alone == target_only
    generator.verifier.batcher.batch_sizes.clear()
    assert generate_at_once(generator, jobs, sampling) == alone
    assert max(generator.verifier.batcher.batch_sizes) > 1, "concurrent verifications were never batched"
    assert generator.verifier.active_sessions() == 0 and generator.drafter.active_sessions() == 0


def test_errors_reach_the_caller(target_model):
    batcher = ForwardBatcher(target_model)
    sequence = CachedSequence(target_model, [1, 2, 3])
    sequence.prefill()
    try:
        batcher.forward(sequence, 5)  # more logits than pending tokens
    except AssertionError:
        pass
    else:
        raise AssertionError("expected the forward's error")
    assert batcher.forward(sequence, 1)[0].shape[0] == 1  # the batcher still works


def test_prefills_and_mixed_batches_match_each_session_alone(target_model):
    """Prefills (no logits), a 1-token prompt (empty cache) and a decode step in one batch."""
    prompts = ([5, 9, 11, 40, 7, 3], [8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    alone = [CachedSequence(target_model, p) for p in prompts]
    for sequence in alone:
        sequence.prefill()
    expected = [sequence.forward(1)[0] for sequence in alone]

    batched = [CachedSequence(target_model, p) for p in prompts]
    decoding = CachedSequence(target_model, [4, 4, 2])
    decoding.prefill()
    results = CachedSequence.forward_batch([batched[0], batched[2], decoding], [0, 0, 1], [False] * 3)
    assert results[0][0].numel() == 0 and results[1][0].numel() == 0
    assert [s.cache_len for s in batched] == [5, 0, 9] and decoding.cache_len == 3
    # Next step: the 1-token prompt (empty cache) batched with the two prefilled sessions.
    results = CachedSequence.forward_batch(batched, [1, 1, 1], [False] * 3)
    for (logits, _), expected_logits, sequence in zip(results, expected, batched):
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        assert sequence.cache_len == len(sequence.tokens) == sequence.cache.get_seq_length()


def test_window_gathers_peers_that_come_back_a_little_later(target_model):
    """After a batch of 4, the next step waits briefly for all 4 instead of running 1 + 3."""
    batcher = ForwardBatcher(target_model, max_wait_s=0.5, wait_fraction=1e6)
    sequences = [CachedSequence(target_model, [3 + i, 7, 9 + i]) for i in range(4)]
    barrier = threading.Barrier(4)

    def worker(index):
        batcher.prefill(sequences[index])
        for step in range(3):
            barrier.wait()
            time.sleep(0.02 * index)  # staggered returns, well inside the window
            sequences[index].tokens.append(11 + step)
            batcher.forward(sequences[index], 1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # the first step may split (no batch of 4 seen yet); afterwards every step is one batch of 4
    assert batcher.batch_sizes[-2:] == [4, 4], batcher.batch_sizes


def test_a_lone_stream_does_not_wait_for_sessions_that_ended(target_model):
    batcher = ForwardBatcher(target_model, max_wait_s=2.0, wait_fraction=1e6)
    burst = [CachedSequence(target_model, [3 + i, 7, 9]) for i in range(3)]
    threads = [threading.Thread(target=lambda s=s: [batcher.prefill(s), batcher.forward(s, 1)]) for s in burst]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    del burst, threads  # the sessions ended: their sequences are freed
    lone = CachedSequence(target_model, [5, 6, 7])
    batcher.prefill(lone)
    started = time.monotonic()
    for step in range(3):
        lone.tokens.append(8 + step)
        batcher.forward(lone, 1)
    assert time.monotonic() - started < 1.0  # no 2 s window spent waiting for the ended sessions
