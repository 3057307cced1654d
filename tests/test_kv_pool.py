"""The KV pool (disco.engines.kv_pool): one storage for every session of a model, one length record.

Runs placed first-fit in chunks, grown in place or moved (prefix kept), released when their cache
is freed (also from a finalizer while the pool's lock is held), chunks dropped when empty but one;
the static path's slots are fixed runs of one chunk, seen as [slots, kv_heads, capacity, head_dim];
a session's cache_len is read off its run; a forked cache is a copy.
"""

from __future__ import annotations

import gc

import pytest
import torch

from disco.engines.decoder_shape import DecoderShape
from disco.engines.kv import CachedSequence
from disco.engines import kv_pool
from disco.engines.kv_pool import CHUNK_POSITIONS, PAGE, KVPool, KVPoolExhausted, PoolCache, is_out_of_memory
from disco.engines.static_step import StaticCaches
from disco.errors import ResourceExhausted

SHAPE = DecoderShape(layers=3, heads=4, kv_heads=2, head_dim=8)


def _pool() -> KVPool:
    return KVPool(SHAPE, torch.float32, torch.device("cpu"))


def _write(cache: PoolCache, states: torch.Tensor) -> None:
    for layer in range(SHAPE.layers):
        cache.update(states + layer, states, layer)


def test_runs_are_placed_first_fit_and_pages_come_back_when_a_cache_is_freed():
    pool = _pool()
    a, b = PoolCache(pool, pool.allocate(100)), PoolCache(pool, pool.allocate(PAGE))
    assert (a.run.first, a.run.pages, b.run.first, b.run.pages) == (0, 2, 2, 1)
    assert a.run.chunk is b.run.chunk and pool.nbytes == a.run.chunk.nbytes
    del a
    gc.collect()
    c = PoolCache(pool, pool.allocate(2 * PAGE))  # the freed pages, reused
    assert c.run.first == 0 and c.run.chunk is b.run.chunk


def test_the_last_layer_moves_the_one_length_and_a_failed_forward_leaves_it():
    pool = _pool()
    cache = PoolCache(pool, pool.allocate(16))
    states = torch.randn(1, 2, 5, 8)
    keys, _ = cache.update(states, states, 0)
    assert keys.shape[2] == 5 and cache.get_seq_length() == 0  # layer 0 written, the length not yet moved
    cache.update(states, states, 1)  # the forward "fails" here: the length stays
    assert cache.get_seq_length() == 0 and {layer.get_seq_length() for layer in cache.layers} == {0}
    _write(cache, states)
    assert cache.get_seq_length() == 5 and all(torch.equal(layer.keys, states + index)
                                               for index, layer in enumerate(cache.layers))
    with pytest.raises(TypeError):
        cache.update(states.double(), states.double(), 0)  # another dtype than the pool's: refused, not cast
    with pytest.raises(TypeError):
        cache.layers[0].crop(-1)  # one length for every layer: crop the cache


def test_a_run_grows_in_place_when_it_can_else_moves_with_its_prefix():
    pool = _pool()
    cache = PoolCache(pool, pool.allocate(PAGE))
    first = torch.randn(1, 2, 40, 8)
    _write(cache, first)
    start = cache.run.keys[0].data_ptr()
    _write(cache, first)  # 80 > 64: the next pages are free, the run extends in place
    assert cache.capacity == 2 * PAGE and cache.run.keys[0].data_ptr() == start
    blocker = PoolCache(pool, pool.allocate(PAGE))  # right after the run
    assert blocker.run.first == cache.run.first + cache.run.pages
    _write(cache, first[:, :, :30])  # 110 fits; then 150 > 128: moves
    _write(cache, first)
    assert cache.capacity == 4 * PAGE and cache.run.first != 0
    expected = torch.cat([first, first, first[:, :, :30], first], dim=2)
    assert all(torch.equal(layer.keys, expected + index) for index, layer in enumerate(cache.layers))
    assert pool.allocate(2 * PAGE).first == 0  # the old pages came back


def test_a_run_larger_than_a_chunk_gets_its_own_and_empty_chunks_are_dropped_but_one():
    pool = _pool()
    small = PoolCache(pool, pool.allocate(10))
    big = PoolCache(pool, pool.allocate(CHUNK_POSITIONS + 1))
    assert big.run.chunk is not small.run.chunk and big.capacity == CHUNK_POSITIONS + PAGE
    other = PoolCache(pool, pool.allocate(CHUNK_POSITIONS))  # no room left in either: a third chunk
    assert len({id(c.run.chunk) for c in (small, big, other)}) == 3
    del small, big, other
    gc.collect()
    assert len(pool._chunks) == 1  # one empty chunk kept for the next session


def test_a_finalizer_inside_the_pool_s_lock_does_not_deadlock():
    pool = _pool()
    cache = PoolCache(pool, pool.allocate(10))
    run = cache.run
    with pool._lock:  # as if a garbage collection ran inside allocate()
        del cache
        gc.collect()
        assert run in pool._released
    assert PoolCache(pool, pool.allocate(10)).run.first == 0  # drained at the next allocation


def test_static_slots_are_fixed_runs_of_one_chunk_seen_as_slots():
    model_pool = _pool()
    runs = model_pool.slot_runs(4, 2 * PAGE)
    slots = runs[0].chunk.keys[0].view(2, 4, 2 * PAGE, 8).transpose(0, 1)  # [slots, kv_heads, capacity, dim]
    cache = PoolCache(model_pool, runs[2])
    assert cache.slot == 2
    states = torch.randn(1, 2, 3, 8)
    for layer in range(SHAPE.layers):
        cache.update(states, states, layer)
    assert torch.equal(slots[2, :, :3], states[0]) and runs[2].length == 3
    with pytest.raises(ResourceExhausted):
        model_pool.grow(runs[2], 2 * PAGE + 1)
    del cache
    gc.collect()
    assert not model_pool._released  # a slot's run is the runner's to give back, never the pool's
    assert model_pool.allocate(10).chunk is not runs[0].chunk  # no session run is placed among the slots


def test_static_caches_are_the_model_s_pool_and_its_lengths_the_runs(target_model):
    caches = StaticCaches(target_model, 2, 100)
    assert caches.pool is KVPool.of(target_model) and caches.capacity % PAGE == 0
    caches.runs[1].length = 7
    assert caches.lengths == (0, 7)
    with pytest.raises(TypeError):
        caches.lengths[1] = 3  # one record: set it on the run


def test_cache_len_reads_the_cache_and_a_fork_is_a_copy(target_model):
    sequence = CachedSequence(target_model, [5, 6, 7, 8, 9], capacity=8)
    assert isinstance(sequence.cache, PoolCache) and sequence.cache_len == 0
    sequence.prefill()
    assert sequence.cache_len == 4 == sequence.cache.get_seq_length()
    sequence.forward(1)
    fork = sequence.fork(3)
    assert fork.cache_len == 3 and fork.tokens == [5, 6, 7] and fork.cache.run is not sequence.cache.run
    assert all(torch.equal(a.keys, b.keys[:, :, :3]) for a, b in zip(fork.cache.layers, sequence.cache.layers))
    fork.cache.layers[0].keys.zero_()
    assert sequence.cache.layers[0].keys.abs().sum() > 0  # its own storage
    sequence.truncate(2)
    assert sequence.cache_len == 2 == sequence.cache.get_seq_length()


def test_a_copied_model_starts_with_an_empty_pool(target_model):
    import copy

    PoolCache.for_model(target_model, 10)
    twin = copy.deepcopy(target_model)
    assert KVPool.of(twin) is not KVPool.of(target_model) and KVPool.of(twin).nbytes == 0


def test_a_chunk_the_allocator_cannot_give_is_resource_exhausted_and_an_out_of_memory(monkeypatch):
    pool = _pool()

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(kv_pool, "_Chunk", refuse)
    with pytest.raises(KVPoolExhausted, match="out of memory for the KV pool: a chunk of 4096 positions") as raised:
        pool.allocate(10)
    assert isinstance(raised.value, ResourceExhausted) and is_out_of_memory(raised.value)  # the batcher isolates it
    assert not pool._chunks


def test_the_services_report_the_kv_budget_reservations_and_pool_bytes_in_metrics(tokenizer):
    """``disco_kv_cache_budget_bytes``, ``disco_kv_cache_reserved_bytes`` and ``disco_kv_pool_bytes``
    of a real target and draft service on loopback: the start-up proofs' sessions leave one empty
    chunk, a session reserves its tokens and takes its run there (no second chunk), and ends."""
    import urllib.request  # noqa: PLC0415

    import grpc  # noqa: PLC0415

    import draft_service.server  # noqa: PLC0415
    import target_service.server  # noqa: PLC0415
    from disco.engines.sessions import SessionLimits, kv_bytes_per_token  # noqa: PLC0415
    from protos.disco.v1 import common_pb2, target_pb2, target_pb2_grpc  # noqa: PLC0415
    from protos.runtime.metrics import sample_value  # noqa: PLC0415
    from tests import tiny  # noqa: PLC0415
    from tests.grpc_fixtures import loaded  # noqa: PLC0415

    model, draft_model = tiny.qwen2(seed=5), tiny.qwen2(seed=6, hidden=32, layers=1)  # pools of their own
    per_token = kv_bytes_per_token(model)
    chunk, draft_chunk = CHUNK_POSITIONS * per_token, CHUNK_POSITIONS * kv_bytes_per_token(draft_model)
    limits = SessionLimits(max_kv_bytes=10**8)

    def scrape(running) -> dict[str, float | None]:
        with urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=10) as page:
            text = page.read().decode()
        return {name: sample_value(text, f"disco_kv_{name}_bytes") for name in ("cache_budget", "cache_reserved", "pool")}

    target = target_service.server.serve(loaded(model, tokenizer, "tiny-kv"), limits=limits, metrics_port=0)
    draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-kv-draft"), limits=limits, metrics_port=0)
    try:
        assert scrape(target) == {"cache_budget": 10**8, "cache_reserved": 0, "pool": chunk}
        assert scrape(draft) == {"cache_budget": 10**8, "cache_reserved": 0, "pool": draft_chunk}
        with grpc.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8, seed=1)
            stub.StartSession(target_pb2.StartTargetSessionRequest(session_id="kv", prompt_ids=[5, 6, 7],
                                                                   sampling=sampling), timeout=30)
            during = scrape(target)
            stub.EndSession(common_pb2.EndSessionRequest(session_id="kv"), timeout=30)
        gc.collect()
        after = scrape(target)
    finally:
        target.stop(0)
        draft.stop(0)
    assert during["cache_reserved"] >= (3 + 8) * per_token and during["pool"] == chunk
    assert after == {"cache_budget": 10**8, "cache_reserved": 0, "pool": chunk}  # one empty chunk kept
