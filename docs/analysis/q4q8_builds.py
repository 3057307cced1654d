"""Issue 28: one forward's int4 linears on each kernel build, with the default target's weights.

Loads the default target on the int4 engine with the kernel named on the command line
(``q4q8-amx``, ``q4q8-vnni``, ``q4q8-avx2`` or torch's ``int4pack``; one per process, since a
process loads one build) and times every linear of the model once per pass at 1, 5 and 9 rows
(decoding, verification blocks; ``--rows`` for others), second best of 6 passes. The weights
come from memory, as in a forward.

Usage: python docs/analysis/q4q8_builds.py q4q8-amx|q4q8-vnni|q4q8-avx2|int4pack [--threads 2] [--rows 1,5,9]
"""

from __future__ import annotations

import argparse
import time

import torch

from disco.config import ModelConfig
from disco.models import q4q8
from disco.models.int4 import Int4Linear
from disco.models.loading import disco_home, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=(*q4q8.KERNELS, q4q8.TORCH_KERNEL))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,5,9")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    home = disco_home()
    if args.kernel == q4q8.TORCH_KERNEL:
        q4q8.choose_kernel = lambda _home: q4q8.KernelChoice(q4q8.TORCH_KERNEL, "asked for")
    elif (why_not := q4q8.load(home, next(v for v in q4q8.VARIANTS if v.kernel == args.kernel))) is not None:
        raise SystemExit(why_not)
    loaded = load_model(ModelConfig(spec=None, dtype="int4"), "target", home, progress=False)
    linears = [module for module in loaded.model.modules() if isinstance(module, Int4Linear)]
    print(f"{loaded.name}: {len(linears)} int4 linears on {linears[0].kernel}, {args.threads} threads")
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            inputs = {m.in_features: torch.randn(rows, m.in_features).to(torch.bfloat16) for m in linears}
            passes = []
            for _ in range(6):
                started = time.perf_counter()
                for module in linears:
                    module._quantized(inputs[module.in_features])
                passes.append(time.perf_counter() - started)
            print(f"  {rows} rows: {sorted(passes)[1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
