"""In one process, interleaved: the same decoder's forward with its session in a 4,096-position chunk of
the KV pool (strided views) and in a chunk of exactly its run (the per-session buffer layout before the pool).

    .venv/bin/python docs/analysis/kv_pool_layout_ab.py draft|target [rounds]
"""
import sys, time, torch
from disco.config import ModelConfig
from disco.models.loading import load_model, disco_home
from disco.engines.kv import CachedSequence
from disco.engines import kv_pool
role = sys.argv[1]
model = load_model(ModelConfig(spec=None, dtype="int4", device="cpu"), role, disco_home(), progress=False).model
ctx = [(i * 7919) % 151000 + 1 for i in range(200)]
seqs = {}
for name, chunk in (("pool", 4096), ("own", 256)):
    kv_pool.CHUNK_POSITIONS = chunk
    from disco.engines.engine_state import engine_state; engine_state(model).kv_pool = None
    s = CachedSequence(model, [*ctx, ctx[-1]], capacity=256); s.prefill(); s.truncate(200)
    print(name, "chunk positions", s.cache.run.chunk.keys[0].shape[1], "stride", s.cache.run.keys[0].stride())
    seqs[name] = s
times = {n: {1: [], 5: []} for n in seqs}
with torch.inference_mode():
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
        for name, seq in seqs.items():
            for k in (1, 5):
                seq.tokens.extend(range(100 + r, 100 + r + k))
                t = time.perf_counter(); seq.forward(k); times[name][k].append(time.perf_counter() - t)
                seq.truncate(200)
for name in times:
    print(role, name, {k: round(1000 * sorted(v)[len(v) // 5], 2) for k, v in times[name].items()},
          {k: round(1000 * min(v), 2) for k, v in times[name].items()})
