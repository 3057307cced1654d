"""One forward of the default target or draft (int4) timed after a 200-token context, 1 and 5 new
tokens, 25 repeats each (20th percentile and median, ms): run it alternately from two checkouts to
compare their forward path without the rest of `disco models calibrate` (issue 49's CPU check).

    (cd OLD && PYTHONPATH=OLD python /path/to/forward_ab.py old [target|draft])
    PYTHONPATH=. python docs/analysis/forward_ab.py new [target|draft]
"""
import sys, time, statistics, torch
from disco.config import ModelConfig
from disco.models.loading import load_model, disco_home
from disco.engines.kv import CachedSequence
role = sys.argv[2] if len(sys.argv) > 2 else "target"
loaded = load_model(ModelConfig(spec=None, dtype="int4", device="cpu"), role, disco_home(), progress=False)
model = loaded.model
ctx = [(i * 7919) % 151000 + 1 for i in range(200)]
seq = CachedSequence(model, [*ctx, ctx[-1]]); seq.prefill(); seq.truncate(200)
times = {1: [], 5: []}
with torch.inference_mode():
    for r in range(25):
        for k in (1, 5):
            seq.tokens.extend(range(100 + r, 100 + r + k))
            t = time.perf_counter(); seq.forward(k); times[k].append(time.perf_counter() - t)
            seq.truncate(200)
print(sys.argv[1], role, {k: round(1000 * sorted(v)[len(v) // 5], 2) for k, v in times.items()},
      {k: round(1000 * statistics.median(v), 2) for k, v in times.items()})
