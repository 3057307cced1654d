"""The fixed-shape step over static per-slot caches (:mod:`disco.engines.static_step`), eager
on the CPU: each session's logits equal the packed forward's under the one-call attention
plan bit for bit, whatever its bucket, its slot and the other slots; verified blocks equal
decoding; bad steps are refused with a message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward, supports_packing
from disco.engines.kv_pool import PoolCache
from disco.engines.static_step import Bucket, StaticCaches, StaticStep, bucket_for
from disco.engines.varlen_attention import ONE_CALL_CPU, REFERENCE_CPU
from disco.errors import InvalidRequest
from disco.models import q4q8, row_stable
from disco.models.int4 import Int4Linear
from disco.models.quantize import quantize_model
from tests import tiny

HOME = Path(os.environ.get("DISCO_HOME", "/tmp/disco_q4q8_tests"))

PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 7, 7], [300, 2, 2, 77], list(range(40, 110))]


@pytest.fixture(scope="module", params=["bfloat16", "int4"])
def model(request):
    """Low-precision engines with row-invariant linears (bf16 under the CPU's row plans, the
    q4 x q8 kernel); float32 GEMMs are not row-invariant on CPUs (rows within ~1e-6), as on
    the packed path (docs/exactness.md)."""
    if request.param == "int4":
        if not q4q8.cpu_supports() or q4q8.load(HOME) is not None:
            pytest.skip("no q4 x q8 kernel on this CPU")
        model = quantize_model(tiny.qwen2(11), engine="int4")
        for module in model.modules():
            if isinstance(module, Int4Linear):
                module.use_kernel(q4q8.loaded_kernel())
    else:
        model = tiny.qwen2(11).to(torch.bfloat16)
        row_stable.stabilize(model)
    assert supports_packing(model) and lean_decoder_for(model) is not None
    return model


class Sessions:
    """The same sessions twice: on the packed path (reference) and in static slots."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], slots: list[int], capacity: int = 128):
        self.model, self.slots = model, slots
        self.caches = [PoolCache.for_model(model, capacity) for _ in prompts]
        packed_forward(model, [SessionRows(c, 0, p, 0) for c, p in zip(self.caches, prompts)], ONE_CALL_CPU)
        self.lengths = [len(p) for p in prompts]
        self.static = StaticCaches(model, 8, capacity)
        for slot, cache, length in zip(slots, self.caches, self.lengths):
            self.static.load(slot, cache, length)

    def packed(self, blocks: list[list[int]]) -> list[torch.Tensor]:
        rows = [SessionRows(c, n, b, len(b)) for c, n, b in zip(self.caches, self.lengths, blocks)]
        return [logits for logits, _ in packed_forward(self.model, rows, ONE_CALL_CPU)]

    def static_step(self, blocks: list[list[int]], bucket: Bucket | None = None) -> list[torch.Tensor]:
        bucket = bucket or bucket_for(max(self.slots) + 1, max(len(b) for b in blocks))
        step = StaticStep(lean_decoder_for(self.model), self.static, bucket, ONE_CALL_CPU)
        return step.forward([self.static.session_rows(slot, block) for slot, block in zip(self.slots, blocks)])

    def commit(self, blocks: list[list[int]], keep: list[int]) -> None:
        """Keep the first ``keep[i]`` tokens of each block (the rest rejected: rolled back)."""
        for index, (block, kept) in enumerate(zip(blocks, keep)):
            self.lengths[index] += kept
            self.caches[index].crop(-(len(block) - kept))
            self.static.runs[self.slots[index]].length = self.lengths[index]


def assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and torch.equal(a, b), index


def test_static_steps_give_the_packed_forward_s_bits(model):
    sessions = Sessions(model, PROMPTS, slots=[0, 1, 2])
    for blocks, keep in (([[1], [2, 3, 4, 5], [6, 7]], [1, 2, 2]),  # verification blocks of mixed sizes
                         ([[9], [10], [11]], [1, 1, 1]),  # decoding
                         ([[12, 13, 14], [15], [16, 17, 18, 19, 20, 21]], [0, 1, 3])):
        expected = sessions.packed(blocks)
        assert_equal(sessions.static_step(blocks), expected)
        sessions.commit(blocks, keep)


def test_a_session_s_bits_do_not_depend_on_its_bucket_slot_or_neighbours(model):
    alone = Sessions(model, PROMPTS[:1], slots=[0])
    expected = alone.static_step([[3, 4]], Bucket(1, 2))
    assert_equal(alone.static_step([[3, 4]], Bucket(4, 8)), expected)  # padded slots and queries
    crowded = Sessions(model, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], slots=[0, 3, 1])
    got = crowded.static_step([[8, 9, 10], [3, 4], [1]], Bucket(8, 4))
    assert_equal(got[1:2], expected)


def test_a_verified_block_gives_decoding_s_logits(model):
    block = [21, 22, 23, 24]
    verified = Sessions(model, PROMPTS[:2], slots=[0, 1])
    logits = verified.static_step([block, [5]])[0]
    decoded = Sessions(model, PROMPTS[:2], slots=[0, 1])
    for index, token in enumerate(block):
        step = decoded.static_step([[token], [5]])[0]
        assert torch.equal(step[0], logits[index]), index
        decoded.commit([[token], [5]], [1, 0])


def test_float32_steps_stay_within_float32_rounding_of_the_packed_forward():
    model = tiny.qwen2(11)
    assert supports_packing(model)
    sessions = Sessions(model, PROMPTS, slots=[0, 1, 2])
    blocks = [[1], [2, 3, 4, 5], [6, 7]]
    for got, expected in zip(sessions.static_step(blocks, Bucket(8, 8)), sessions.packed(blocks)):
        assert torch.allclose(got, expected, rtol=0, atol=1e-4)


def test_buckets_round_up_and_refuse_what_does_not_fit(model):
    assert bucket_for(3, 5) == Bucket(4, 8) and bucket_for(1, 1) == Bucket(1, 1)
    with pytest.raises(InvalidRequest, match="no bucket"):
        bucket_for(33, 1)
    sessions = Sessions(model, PROMPTS[:1], slots=[0], capacity=64)
    lean = lean_decoder_for(model)
    with pytest.raises(InvalidRequest, match="one-call plan"):
        StaticStep(lean, sessions.static, Bucket(1, 1), REFERENCE_CPU)
    step = StaticStep(lean, sessions.static, Bucket(1, 2), ONE_CALL_CPU)
    with pytest.raises(InvalidRequest, match="does not fit the bucket"):
        step.forward([sessions.static.session_rows(0, [1, 2, 3])])
    sessions.static.runs[0].length = 63
    with pytest.raises(InvalidRequest, match="capacity of 64"):
        step.forward([sessions.static.session_rows(0, [1, 2])])
    # keys and values x 2 layers x 8 slots x 2 KV heads x 64 positions x head_dim 16
    assert sessions.static.nbytes == 2 * 2 * 8 * 2 * 64 * 16 * model.get_input_embeddings().weight.element_size()


def test_a_step_takes_the_packed_forwards_rows_and_refuses_rows_that_are_not_its_slots(model):
    """The static step reads the packed forward's SessionRows: logits for the last num_logits tokens;
    a cache that is not one of its slots, a length other than the slot's, or hidden states: refused."""
    sessions = Sessions(model, PROMPTS[:2], slots=[0, 1], capacity=64)
    step = StaticStep(lean_decoder_for(model), sessions.static, Bucket(2, 4), ONE_CALL_CPU)
    whole = step.forward([sessions.static.session_rows(0, [1, 2, 3]), sessions.static.session_rows(1, [4])])
    rows = sessions.static.session_rows(0, [1, 2, 3])
    rows.num_logits = 2
    last_two = step.forward([rows, sessions.static.session_rows(1, [4])])
    assert torch.equal(last_two[0], whole[0][1:]) and torch.equal(last_two[1], whole[1])
    with pytest.raises(InvalidRequest, match="not this step's slot"):
        step.forward([SessionRows(PoolCache.for_model(model, 64), 0, [1], 1)])
    other = StaticCaches(model, 8, 64)
    with pytest.raises(InvalidRequest, match="not this step's slot"):
        step.forward([other.session_rows(0, [1])])
    rows = sessions.static.session_rows(0, [1])
    rows.cache_len += 1
    with pytest.raises(InvalidRequest, match="positions, not the"):
        step.forward([rows])
    rows = sessions.static.session_rows(0, [1])
    rows.want_hidden = True
    with pytest.raises(InvalidRequest, match="hidden states"):
        step.forward([rows])


def test_graph_capture_is_refused_for_a_cpu_step(model):
    from disco.engines.step_runner import GraphedStep, capture_buckets

    sessions = Sessions(model, PROMPTS[:1], slots=[0], capacity=64)
    step = StaticStep(lean_decoder_for(model), sessions.static, Bucket(1, 1), ONE_CALL_CPU)
    with pytest.raises(ValueError, match="need a CUDA step"):
        GraphedStep(step)
    assert capture_buckets([])[1].graphs == 0
