"""The one-call packed attention (disco.engines.varlen_attention) and the preallocated KV
cache (disco.engines.kv_pool).

The one call is exact *within itself*: a query gets the same bits alone (decoding) as inside a
packed batch or a verification block, whatever its neighbours' lengths, in float32 and bf16.
It is not bit-identical to the per-query reference (padding to 64-key granules changes which
exponentials the CPU kernel vectorises): it is checked against the reference within rounding.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import DynamicCache

from disco.engines.kv import CachedSequence
from disco.engines.packed_forward import SessionRows, packed_forward
from disco.engines.kv_pool import PAGE, PoolCache
from disco.models.row_stable import stabilize
from disco.engines.batch_layout import packed_layout
from disco.engines.varlen_attention import ONE_CALL_CPU, REFERENCE_CPU, AttentionPlan, attention_plan, one_call_attention

DTYPES = [torch.float32, torch.bfloat16]


def _model(target_model, dtype):
    """The tiny target in ``dtype``, its bf16 linears given row plans as the engines load them."""
    if dtype == torch.float32:
        return target_model
    model = copy.deepcopy(target_model).to(dtype)
    stabilize(model)
    return model


def _assert_same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit in bf16; in float32 within 1e-4 — the model's float32 linears are not
    row-invariant on every CPU (tests/test_batch_exactness.py); the attention itself is checked
    bit for bit in float32 by the unit tests above."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(a, b), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def _one_call(sessions, dtype):
    """sessions: (keys [1, kv, n, d], values, queries [1, heads, k, d]); the last k keys are the queries'."""
    queries = torch.cat([q for _, _, q in sessions], dim=2)
    kv_heads, heads = sessions[0][0].shape[1], queries.shape[1]
    layout = packed_layout([k.shape[2] - q.shape[2] for k, _, q in sessions], [q.shape[2] for _, _, q in sessions],
                           [True] * len(sessions), kv_heads, heads // kv_heads, ONE_CALL_CPU.key_granule, "cpu")
    return one_call_attention(queries, [k for k, _, _ in sessions], [v for _, v, _ in sessions], layout,
                              0.125, ONE_CALL_CPU)  # [1, queries, heads, dim]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gets_its_solo_bits_whatever_its_neighbours(dtype):
    """Sessions of 1-300 keys with blocks of 1-5 queries, in one call, against each query
    alone (one session, one query, its keys up to its position): bit for bit. Close to the
    reference (not equal: the reference is unpadded)."""
    rng = random.Random(0)
    torch.manual_seed(0)
    sessions = []
    for _ in range(7):
        queries = rng.randint(1, 5)
        keys = rng.randint(queries, 300)
        sessions.append((torch.randn(1, 2, keys, 16, dtype=dtype), torch.randn(1, 2, keys, 16, dtype=dtype),
                         torch.randn(1, 6, queries, 16, dtype=dtype)))
    together = _one_call(sessions, dtype)[0]
    row = 0
    for keys, values, queries in sessions:
        count, first = queries.shape[2], keys.shape[2] - queries.shape[2] + 1
        for i in range(count):
            alone = _one_call([(keys[:, :, :first + i], values[:, :, :first + i], queries[:, :, i: i + 1])], dtype)
            assert torch.equal(together[row], alone[0, 0]), (row, keys.shape[2])
            reference = torch.nn.functional.scaled_dot_product_attention(
                queries[:, :, i: i + 1].float(), keys[:, :, :first + i].float(), values[:, :, :first + i].float(),
                scale=0.125, enable_gqa=True)[0, :, 0]  # [heads, dim]
            torch.testing.assert_close(together[row].float(), reference, rtol=0, atol=2e-6 if dtype == torch.float32
                                       else 1e-2)
            row += 1
    # Other neighbours (a subset, one much longer session): the same bits.
    longer = (torch.randn(1, 2, 700, 16, dtype=dtype), torch.randn(1, 2, 700, 16, dtype=dtype),
              torch.randn(1, 6, 2, 16, dtype=dtype))
    again = _one_call([longer, sessions[3]], dtype)[0, 2:]
    start = sum(q.shape[2] for _, _, q in sessions[:3])
    assert torch.equal(again, together[start: start + sessions[3][2].shape[2]])


def _rows(sequence: CachedSequence, count: int) -> SessionRows:
    end = len(sequence.tokens) - 1 if count == 0 else len(sequence.tokens)
    return SessionRows(sequence.cache, sequence.cache_len, sequence.tokens[sequence.cache_len:end], count)


def _forward(model, sequences, counts, plan):
    rows = [_rows(s, c) for s, c in zip(sequences, counts)]
    results = packed_forward(model, rows, plan)  # each cache's length moves: the sequences' cache_len
    return [logits for logits, _ in results]


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_call_forward_is_exact_packed_and_block_vs_decoding(target_model, dtype):
    """Through the model, with the one-call plan: a mixed batch (a prefill, a decode, two
    verification blocks) gives each session its solo logits (bit for bit in bf16); a verified block
    gives the logits of token-by-token decoding; rollback then continue keeps both; and the
    logits stay within rounding of the reference plan's (same argmax)."""
    model = _model(target_model, dtype)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (9, 40, 3, 70)]
    blocks = [[rng.randrange(1, 500) for _ in range(n)] for n in (1, 5, 4)]

    def run(plan, batched):
        sequences = [CachedSequence(model, p, plan=plan) for p in prompts]
        if batched:
            _forward(model, sequences[:3], [0, 0, 0], plan)
        else:
            for sequence in sequences[:3]:
                sequence.prefill()
        for s, block in zip(sequences[:3], blocks):
            s.tokens.extend(block)
        # session 3 prefills while 0-2 decode / verify
        counts = [len(blocks[0]) + 1, len(blocks[1]) + 1, len(blocks[2]) + 1, 0]
        if batched:
            logits = _forward(model, sequences, counts, plan)
        else:
            logits = [_forward(model, [s], [c], plan)[0] for s, c in zip(sequences, counts)]
        sequences[1].truncate(len(prompts[1]) + 2)  # two of five accepted
        sequences[1].tokens.append(7)
        sequences[3].tokens.extend([8, 9])
        more = (_forward(model, [sequences[1], sequences[3]], [1, 3], plan) if batched
                else [_forward(model, [s], [c], plan)[0] for s, c in ((sequences[1], 1), (sequences[3], 3))])
        return logits[:3] + more

    packed, alone = run(ONE_CALL_CPU, True), run(ONE_CALL_CPU, False)
    for a, b in zip(packed, alone):
        _assert_same(a, b, dtype)
    # token by token: session 1's verified block against decoding its tokens one at a time
    # (prefilled as in the runs: all prompt tokens but the last)
    sequence = CachedSequence(model, prompts[1], plan=ONE_CALL_CPU)
    sequence.prefill()
    decoded = [sequence.forward(1)[0]]
    for token in blocks[1]:
        sequence.tokens.append(token)
        decoded.append(sequence.forward(1)[0])
    _assert_same(torch.cat(decoded), alone[1], dtype)  # logits after the prompt and each block token
    reference = run(REFERENCE_CPU, True)
    for a, b in zip(packed, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 if dtype == torch.float32 else 0.1)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_plans_are_explicit_per_device():
    assert attention_plan("cpu") == REFERENCE_CPU  # measured faster on the CPU
    cuda = attention_plan("cuda")
    assert cuda.one_call and cuda.compute_dtype is None and not cuda.kernel_gqa
    with pytest.raises(Exception):
        cuda.one_call = False  # frozen


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_kv_heads_give_the_same_bits_as_kernel_gqa(dtype):
    """The CUDA plan's device-generic part (keys repeated per query head instead of GQA in the
    kernel), run on the CPU: a query alone and packed agree bit for bit too."""
    plan = AttentionPlan(one_call=True, compute_dtype=None, kernel_gqa=False)
    torch.manual_seed(3)
    keys, values = torch.randn(1, 2, 90, 16, dtype=dtype), torch.randn(1, 2, 90, 16, dtype=dtype)
    other = torch.randn(1, 2, 300, 16, dtype=dtype)
    queries = torch.randn(1, 6, 3, 16, dtype=dtype)
    both = one_call_attention(torch.cat([queries, queries[:, :, :1]], dim=2), [keys, other], [values, other],
                              packed_layout([87, 299], [3, 1], [True, True], 2, 3, 64, "cpu"), 0.25, plan)
    alone = one_call_attention(queries[:, :, 2:], [keys], [values],
                               packed_layout([89], [1], [True], 2, 3, 64, "cpu"), 0.25, plan)
    assert torch.equal(both[0, 2], alone[0, 0])


def _write(cache: PoolCache, states: torch.Tensor) -> None:
    """One forward's writes: every layer in order (the last one moves the length)."""
    for layer in range(len(cache.layers)):
        cache.update(states, states, layer)


def test_pool_cache_writes_in_place_grows_and_rolls_back_by_length(target_model):
    cache = PoolCache.for_model(target_model, capacity=10)
    first = torch.randn(1, 2, 50, 16)
    _write(cache, first)
    layer = cache.layers[0]
    buffer = cache.run.keys[0].data_ptr()
    assert cache.capacity == PAGE and cache.get_seq_length(0) == 50 and layer.get_seq_length() == 50
    _write(cache, first[:, :, :10])  # 60 of 64: no move
    assert cache.run.keys[0].data_ptr() == buffer
    cache.crop(-20)  # rollback = a length
    assert cache.get_seq_length(0) == 40 and cache.run.keys[0].data_ptr() == buffer
    assert torch.equal(layer.keys, first[:, :, :40])
    _write(cache, first)  # 90 > 64: doubled to 128, prefix kept
    assert cache.capacity == 128 and torch.equal(layer.keys[:, :, 40:], first)
    assert torch.equal(layer.keys[:, :, :40], first[:, :, :40])
    with pytest.raises(ValueError):
        cache.crop(3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_cache_rollback_equals_a_fresh_prefill(target_model, dtype):
    """Prefill, verify a block, roll back, continue: the preallocated cache gives the logits and
    keys a DynamicCache gives (bit for bit), and equals a fresh sequence prefilled with the
    accepted prefix (bit for bit in bf16 wherever rows are stable: within 1e-5 here)."""
    model = _model(target_model, dtype)
    prompt = [11, 57, 203, 9, 140, 77, 5]
    results = {}
    for kind in ("static", "dynamic"):
        sequence = CachedSequence(model, prompt, capacity=8)
        if kind == "dynamic":
            sequence.cache = DynamicCache(config=model.config)
        sequence.prefill()
        sequence.tokens.extend([300, 301, 302, 303])
        block = sequence.forward(5)[0]
        sequence.truncate(len(prompt) + 1)
        sequence.tokens.extend([42, 43])
        after = sequence.forward(2)[0]
        keys = [layer.keys.clone() for layer in sequence.cache.layers]
        results[kind] = (block, after, keys, sequence)
    assert isinstance(results["static"][3].cache, PoolCache)
    for a, b in zip(results["static"][:2], results["dynamic"][:2]):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(results["static"][2], results["dynamic"][2]))
    assert results["static"][3].cache.get_seq_length() == len(prompt) + 3
    fresh = CachedSequence(model, prompt + [300, 42, 43])
    fresh.prefill()
    torch.testing.assert_close(fresh.forward(1)[0], results["static"][1][-1:], rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 0.1)
