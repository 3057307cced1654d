"""The lean decoder's layer loop in C++ (:mod:`disco.engines.native_loop`): the Python loop's bits
(and so the HF forward's) for decoding and verification rows, alone and packed, caches included;
the forwards it does not cover take the Python loop; a loop whose bits differ is switched off."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from disco.engines import lean_decoder, native_loop
from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward
from disco.engines.kv_pool import PoolCache
from disco.engines.varlen_attention import ONE_CALL_CPU
from tests.test_lean_decoder import PROMPTS, assert_same, ops, q4q8_model, run  # noqa: F401 (ops: a fixture)


@pytest.fixture
def covered(monkeypatch) -> list[bool]:
    """Whether each forward's layers ran in the C++ loop (True) or fell back (False)."""
    ran: list[bool] = []
    real = native_loop.NativeLoop.run

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(native_loop.NativeLoop, "run", counted)
    return ran


def python_loop(lean: lean_decoder.LeanDecoder) -> lean_decoder.LeanDecoder:
    """The same decoder (same fused weights) without its C++ loop."""
    other = copy.copy(lean)
    other.native = None
    return other


def test_the_cpp_loop_gives_the_python_loops_bits_alone_and_packed(ops, covered):
    model = q4q8_model(11)
    lean = lean_decoder_for(model)
    assert lean.native is not None and "layer loop in C++" in lean.describe()
    for prompts, blocks in ((PROMPTS[:1], [1]), (PROMPTS, [1, 4, 2]), (PROMPTS[1:], [5, 3])):
        covered.clear()
        got = run(model, lean, prompts, blocks)
        assert covered == [False, True, True, True]  # the prefill takes the Python loop (no logits)
        expected = run(model, python_loop(lean), prompts, blocks)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same(model, PROMPTS, [2, 1, 3])  # and the HF forward's


def test_the_caches_hold_the_same_keys_and_values_and_grow_where_needed(ops, covered):
    model = q4q8_model(12)
    lean = lean_decoder_for(model)
    covered.clear()  # the start-up check's forwards
    prompt = [(5 * i) % 400 + 1 for i in range(62)]
    caches = []
    for decoder in (lean, python_loop(lean)):
        cache = PoolCache.for_model(model, len(prompt))  # 64 positions: the block below grows it
        packed_forward(model, [SessionRows(cache, 0, prompt, 0)], lean=decoder)
        packed_forward(model, [SessionRows(cache, 62, [7, 8, 9, 10], 4)], lean=decoder)
        caches.append(cache)
    assert covered == [True]  # the 62-token prefill is in dense spans: the loop is not asked
    native_cache, python_cache = caches
    for a, b in zip(native_cache.layers, python_cache.layers, strict=True):
        assert a.get_seq_length() == b.get_seq_length() == 66 and a.capacity >= 66
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_forwards_it_does_not_cover_take_the_python_loop(ops, covered):
    model = q4q8_model(13)
    lean = lean_decoder_for(model)
    covered.clear()  # the start-up check's forwards
    cache = PoolCache.for_model(model, 32)
    packed_forward(model, [SessionRows(cache, 0, PROMPTS[0], 0)], lean=lean)
    other = PoolCache.for_model(model, 32)
    # A prefill packed with a decoding row; the one-call attention plan; a session without a cache yet.
    packed_forward(model, [SessionRows(cache, 7, [3], 1), SessionRows(other, 0, [4, 5], 0)], lean=lean)
    packed_forward(model, [SessionRows(cache, 8, [6, 7], 2)], plan=ONE_CALL_CPU, lean=lean)
    packed_forward(model, [SessionRows(PoolCache.for_model(model, 8), 0, [9], 1)], lean=lean)
    assert covered == [False, False, False, False]  # the first prefill too


def test_a_cpp_loop_whose_bits_differ_is_switched_off(ops, monkeypatch, caplog):
    model = q4q8_model(14)
    real = lean_decoder.native_loop

    def off_by_epsilon(*args):
        loop, reason = real(*args)
        return (None if loop is None else
                native_loop.NativeLoop(**{**loop.__dict__, "eps": loop.eps * 1e4}), reason)

    monkeypatch.setattr(lean_decoder, "native_loop", off_by_epsilon)
    with caplog.at_level(logging.WARNING, logger="disco.engines.packed_forward"):
        lean = lean_decoder_for(model)
    assert "the C++ layer loop off" in caplog.text
    assert lean is not None and lean.native is None and lean.fused
    assert "Python layer loop" in lean.describe()


def test_bad_arguments_are_refused_with_the_reason(ops):
    model = q4q8_model(15)
    lean = lean_decoder_for(model)
    loop = lean.native
    hidden = torch.zeros(1, 2, model.config.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.ones(1, 2, 1, lean.head_dim, dtype=torch.bfloat16)
    buffer = torch.zeros(1, lean.kv_heads, 4, lean.head_dim, dtype=torch.bfloat16)
    layers = len(lean.blocks)
    call = torch.ops.disco_q4q8.decode_layers
    common = (loop.heads, loop.kv_heads, loop.head_dim, loop.eps, loop.scaling, loop.enable_gqa, torch.float32)
    with pytest.raises(RuntimeError, match="too short"):
        call(hidden, cos, sin, loop.weights, loop.out_features, [buffer] * layers, [buffer] * layers, [0, 2, 3], *common)
    with pytest.raises(RuntimeError, match="cover every row"):
        call(hidden, cos, sin, loop.weights, loop.out_features, [buffer] * layers, [buffer] * layers, [0, 1, 0], *common)
    with pytest.raises(RuntimeError, match="10 tensors per layer"):
        call(hidden, cos, sin, loop.weights[:-1], loop.out_features, [buffer] * layers, [buffer] * layers, [0, 2, 0],
             *common)
