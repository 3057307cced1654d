"""Out of memory in a packed forward fails only the session that does not fit alone (issue 30, item 4).

Fault injection on the CPU: a pre-hook on the tiny target's second decoder layer raises
``torch.OutOfMemoryError`` (what ``torch.cuda.OutOfMemoryError`` is) when the forward has more
than ``MAX_ROWS`` rows, after the first layer has already extended every session's cache, so
the roll-back is exercised too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from disco.config import SamplingParams
from disco.engines.batching import ForwardBatcher, _Request, is_out_of_memory, roll_back
from disco.engines.kv import CachedSequence
from disco.engines.target import TargetEngine
from disco.errors import ResourceExhausted

MAX_ROWS = 5
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46], [26, 43, 38], [32, 79, 50, 28, 84, 19, 71])
BLOCKS = ([5, 6], [7, 8], [9], [10, 11, 12, 13, 14])  # the last one (6 rows) does not fit alone


@contextlib.contextmanager
def out_of_memory_above(model, max_rows: int, error=torch.OutOfMemoryError):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["input"]  # [1, rows, intermediate]
        if hidden.shape[-2] > max_rows:
            raise error(f"CUDA out of memory. Tried to allocate {hidden.shape[-2]} rows (injected)")

    # On a linear of the second layer: the lean decoder calls the layers' linears, not the layers.
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _sequences(model) -> list[CachedSequence]:
    sequences = []
    for prompt, block in zip(PROMPTS, BLOCKS):
        sequence = CachedSequence(model, prompt)
        sequence.prefill()
        sequence.tokens.extend(block)  # the last prompt token + the block are pending
        sequences.append(sequence)
    return sequences


def _layer_lengths(sequence: CachedSequence) -> set[int]:
    return {layer.get_seq_length() for layer in sequence.cache.layers}


def test_only_the_session_that_does_not_fit_alone_fails(target_model):
    batcher = ForwardBatcher(target_model, max_batch=len(PROMPTS))
    assert batcher.packed
    solo = [sequence.step(len(block) + 1) for sequence, block in zip(_sequences(target_model), BLOCKS)]
    sequences = _sequences(target_model)
    marks = [sequence.cache_len for sequence in sequences]
    requests = [_Request(sequence, len(block) + 1, False) for sequence, block in zip(sequences, BLOCKS)]
    with out_of_memory_above(target_model, MAX_ROWS):
        batcher._run(requests)
    for index, request in enumerate(requests[:-1]):
        assert request.error is None, request.error
        assert torch.equal(request.result[0], solo[index][0]), f"session {index} differs from its solo forward"
        assert sequences[index].cache_len == len(sequences[index].tokens)
        assert _layer_lengths(sequences[index]) == {sequences[index].cache_len}
    failed = requests[-1]
    assert isinstance(failed.error, ResourceExhausted) and failed.result is None
    assert "out of memory" in str(failed.error) and "alone" in str(failed.error)
    # Nothing of the failed forward is left: cache back where it was, tokens still pending.
    assert sequences[-1].cache_len == marks[-1] and _layer_lengths(sequences[-1]) == {marks[-1]}
    assert sequences[-1].tokens == PROMPTS[-1] + BLOCKS[-1]
    # ...so it computes its solo bits once memory allows.
    assert torch.equal(sequences[-1].step(len(BLOCKS[-1]) + 1)[0], solo[-1][0])


def test_another_error_fails_the_batch_with_every_cache_rolled_back(target_model):
    batcher = ForwardBatcher(target_model, max_batch=len(PROMPTS))
    sequences = _sequences(target_model)[:3]
    marks = [sequence.cache_len for sequence in sequences]
    requests = [_Request(sequence, len(block) + 1, False) for sequence, block in zip(sequences, BLOCKS)]
    with out_of_memory_above(target_model, MAX_ROWS, error=ValueError):
        batcher._run(requests)
    assert all(isinstance(request.error, ValueError) for request in requests)
    for sequence, mark in zip(sequences, marks):
        assert sequence.cache_len == mark and _layer_lengths(sequence) == {mark}


def test_a_verification_out_of_memory_alone_is_resource_exhausted_and_leaves_the_session_usable(target_model):
    engine = TargetEngine(target_model)
    reference = TargetEngine(target_model)
    for store in (engine, reference):
        store.start_session("s", PROMPTS[3], SamplingParams(max_new_tokens=32))
    session = engine.sessions.get("s")
    before = (list(session.sequence.tokens), session.sequence.cache_len, engine.sessions.kv_bytes_in_use)
    with out_of_memory_above(target_model, MAX_ROWS):
        with pytest.raises(ResourceExhausted, match="out of memory"):
            engine.verify("s", BLOCKS[3], None)
    assert (list(session.sequence.tokens), session.sequence.cache_len, engine.sessions.kv_bytes_in_use) == before
    assert _layer_lengths(session.sequence) == {session.sequence.cache_len}
    retried, expected = engine.verify("s", BLOCKS[3], None), reference.verify("s", BLOCKS[3], None)
    assert (retried.num_accepted, retried.next_token_id) == (expected.num_accepted, expected.next_token_id)
    engine.end_session("s")
    assert engine.sessions.kv_bytes_in_use == 0


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 123 bytes"), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("out of memory"), False),
])
def test_is_out_of_memory(error, expected):
    assert is_out_of_memory(error) is expected


@pytest.mark.parametrize("cache", ["pool", "dynamic"])
def test_roll_back_cuts_each_layer_to_the_mark(target_model, cache):
    sequence = CachedSequence(target_model, PROMPTS[0])
    if cache == "dynamic":
        sequence.cache = DynamicCache(config=target_model.config)
    sequence.prefill()
    mark = sequence.cache_len
    sequence.tokens.extend([1, 2])
    sequence.step(3)
    if cache == "dynamic":
        sequence.cache.layers[1].crop(-2)  # as if the forward had stopped before the last layer's update
    # a pool cache moves its one length after the last layer: a forward that failed later (the head) rolls back
    roll_back(sequence, mark)
    assert sequence.cache_len == mark and _layer_lengths(sequence) == {mark}
