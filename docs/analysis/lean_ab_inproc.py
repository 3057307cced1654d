"""Two lean decoders of the default int4 pair in one process, timed alternately (issue 49's CPU
check, without the process-to-process noise of forward_ab.py): the working tree's against the
one in OLD/disco/engines/lean_decoder.py (a `git archive` of an earlier commit), over the same
model, one-token and five-token forwards after a 200-token context, 60 rounds, the order
swapped every round; prints the 20th percentile and the median (ms) and whether every logit
agreed bit for bit.

    PYTHONPATH=. python docs/analysis/lean_ab_inproc.py target|draft OLD
"""
import importlib.util, sys, time, torch
from disco.platform import tune_cpu_math_env
tune_cpu_math_env()
from disco.config import ModelConfig
from disco.models.loading import load_model, disco_home
from disco.engines.packed_forward import SessionRows, packed_forward, lean_decoder_for
from disco.engines.kv_pool import PoolCache
spec = importlib.util.spec_from_file_location("old_lean", f"{sys.argv[2]}/disco/engines/lean_decoder.py")
old_lean = importlib.util.module_from_spec(spec); sys.modules["old_lean"] = old_lean; spec.loader.exec_module(old_lean)
role = sys.argv[1] if len(sys.argv) > 1 else "target"
m = load_model(ModelConfig(spec=None, dtype="int4", device="cpu"), role, disco_home(), progress=False).model
new = lean_decoder_for(m)
old = old_lean.LeanDecoder(m)   # re-points the parts at its own fused views: same weights, same bits
ctx = [(i * 7919) % 151000 + 1 for i in range(200)]
times = {"old": {1: [], 5: []}, "new": {1: [], 5: []}}
with torch.inference_mode():
    for name, dec in (("old", old), ("new", new)):
        cache = PoolCache.for_model(m, 260)
        packed_forward(m, [SessionRows(cache, 0, ctx, 0)], lean=dec)
    caches = {}
    for name, dec in (("old", old), ("new", new)):
        caches[name] = PoolCache.for_model(m, 260); packed_forward(m, [SessionRows(caches[name], 0, ctx, 0)], lean=dec)
    outs = {}
    for r in range(60):
        for k in (1, 5):
            for name, dec in ((("old", old), ("new", new)) if r % 2 else (("new", new), ("old", old))):
                toks = list(range(100 + r, 100 + r + k))
                t = time.perf_counter()
                logits, _ = packed_forward(m, [SessionRows(caches[name], 200, toks, k)], lean=dec)[0]
                times[name][k].append(time.perf_counter() - t)
                outs[name, r, k] = logits
                for layer in caches[name].layers: layer.crop(-k)
    same = all(torch.equal(outs["old", r, k], outs["new", r, k]) for r in range(60) for k in (1, 5))
for name in times:
    print(role, name, {k: round(1000 * sorted(v)[len(v) // 5], 2) for k, v in times[name].items()},
          {k: round(1000 * sorted(v)[len(v) // 2], 2) for k, v in times[name].items()})
print("same logits:", same)
