"""A prompt's prefill on the dense GEMMs against the quantized row kernel (issue 50; docs/engines.md,
"Prefill rows on the kernel"): the default pair's int4 target and draft, loaded as the services load
them, prefilled from nothing with prompts of 64 / 128 / 256 tokens, min of 3 interleaved runs (ms).
``dense``: blocks of at least DENSE_MIN_ROWS tokens as GEMMs (the dtype chosen at load) — what ran
before ``choose_prefill_path``; ``kernel``: every row on the quantized kernel in the row plan's calls.

    .venv/bin/python docs/analysis/prefill_kernel.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disco.platform import tune_cpu_math_env  # noqa: E402

tune_cpu_math_env()

import torch  # noqa: E402

from disco.config import ModelConfig  # noqa: E402
from disco.engines.kv import CachedSequence  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402
from disco.models.weight_only import WeightOnlyLinear  # noqa: E402

for role in ("target", "draft"):
    model = load_model(ModelConfig(spec=None, dtype="int4", device="cpu"), role, disco_home(), progress=False).model
    linears = [module for module in model.modules() if isinstance(module, WeightOnlyLinear)]
    chosen = linears[0].dense_dtype
    dense = chosen if chosen is not None else torch.bfloat16
    for tokens in (64, 128, 256):
        prompt = [(index * 7919) % 151000 + 1 for index in range(tokens)]
        best = {}
        for _ in range(3):
            for path, dtype in (("dense", dense), ("kernel", None)):
                for module in linears:
                    module.dense_dtype = dtype
                started = time.perf_counter()
                CachedSequence(model, prompt).prefill()
                elapsed = (time.perf_counter() - started) * 1e3
                best[path] = min(best.get(path, elapsed), elapsed)
        print(f"{role} {tokens} tokens: dense ({str(dense).removeprefix('torch.')}) {best['dense']:.1f} ms, "
              f"kernel {best['kernel']:.1f} ms ({best['dense'] / best['kernel']:.2f}x)", flush=True)
    for module in linears:
        module.dense_dtype = chosen
