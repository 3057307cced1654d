"""Micro-benchmark behind disco.engines.varlen_attention.attention_plan and kv.cache_for: the
packed forward's attention for the queries that ask for logits (reference: one sdpa per query;
one call: every query in one batched sdpa) and the KV cache's update + rollback (DynamicCache:
``torch.cat``; PoolCache, a run of the KV pool: a slice write), at Qwen2.5-1.5B-like shapes: 12 query heads,
2 KV heads, head_dim 128, 28 layers, bf16 caches. Attention only, no projections.

    .venv/bin/python docs/analysis/packed_attention.py [--threads 1] [--repeats 3]

Prints one line per shape: milliseconds per forward (28 layers), fastest of the repeats.
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from disco.engines.packed_forward import _one_query_at_a_time
from disco.engines.decoder_shape import DecoderShape
from disco.engines.kv_pool import KVPool, PoolCache
from disco.engines.batch_layout import packed_layout
from disco.engines.varlen_attention import ONE_CALL_CPU, REFERENCE_CPU, one_call_attention

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 12, 2, 128, 28


def _median_ms(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)  # the least disturbed run: the machine is shared


def attention(sessions: int, block: int, repeats: int, rng: random.Random) -> tuple[float, float]:
    lengths = [rng.randint(100, 600) for _ in range(sessions)]
    keys = [torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=torch.bfloat16) for n in lengths]
    values = [torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=torch.bfloat16) for n in lengths]
    queries = torch.randn(1, HEADS, sessions * block, HEAD_DIM, dtype=torch.bfloat16)
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, scaling=HEAD_DIM ** -0.5)
    plan = ONE_CALL_CPU

    def reference() -> None:
        for _ in range(LAYERS):
            for s in range(sessions):
                _one_query_at_a_time(module, queries[:, :, s * block: (s + 1) * block], keys[s], values[s],
                                     REFERENCE_CPU, scaling=module.scaling)

    def one_call() -> None:
        layout = packed_layout([n - block for n in lengths], [block] * sessions, [True] * sessions, KV_HEADS,
                               HEADS // KV_HEADS, plan.key_granule, "cpu")
        for _ in range(LAYERS):
            one_call_attention(queries, keys, values, layout, module.scaling, plan)

    return _median_ms(reference, repeats), _median_ms(one_call, repeats)


def cache(length: int, block: int, accepted: int, repeats: int) -> tuple[float, float]:
    """One verification cycle: write ``block`` positions, roll back to ``accepted + 1``."""
    new = torch.randn(1, KV_HEADS, block, HEAD_DIM, dtype=torch.bfloat16)
    prompt = torch.randn(1, KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16)

    def cycle(make) -> float:
        caches = make()
        for layer in range(LAYERS):
            caches.update(prompt, prompt, layer)

        def run() -> None:
            for layer in range(LAYERS):
                caches.update(new, new, layer)
            caches.crop(-(block - accepted - 1))
        return _median_ms(run, repeats)

    return (cycle(lambda: DynamicCache()),
            cycle(lambda: _pool_cache(length + 4 * repeats * block + 64)))


def _pool_cache(capacity: int) -> PoolCache:
    pool = KVPool(DecoderShape(LAYERS, HEADS, KV_HEADS, HEAD_DIM), torch.bfloat16, torch.device("cpu"))
    return PoolCache(pool, pool.allocate(capacity))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    print(f"threads {args.threads}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    for sessions, block in ((1, 1), (1, 5), (4, 1), (8, 5), (16, 1), (16, 5)):
        reference, one_call = attention(sessions, block, args.repeats, rng)
        print(f"attention {sessions:2d} sessions x {block} queries: reference {reference:7.1f} ms, "
              f"one call {one_call:7.1f} ms per forward")
    for length in (100, 300, 600):
        dynamic, preallocated = cache(length, 5, 2, args.repeats)
        print(f"cache {length} positions, write 5 keep 3: DynamicCache {dynamic:.2f} ms, "
              f"PoolCache {preallocated:.2f} ms per cycle")


if __name__ == "__main__":
    main()
