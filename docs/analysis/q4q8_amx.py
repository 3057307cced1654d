"""The q4 x q8 kernel's builds by rows: ms per call of one build, for the target's big shapes.

Loads one build (``q4q8-amx``, ``q4q8-vnni`` or ``q4q8-avx2``; one per process, since a
process loads one build) and times ``q4q8.mm`` at 1, 2, 3, 5, 9 and 16 rows on random weights
of the 1.5B target's gate/up (8960x1536), down (1536x8960) and LM head (151936x1536) shapes:
the minimum over ``--seconds`` of calls per shape after a warm-up, the rows interleaved (the
least disturbed call on a shared machine). The smaller two sit in cache (the same weights
every call); the LM head is read from memory.
``--amx-min-rows N`` builds the AMX build with its threshold set to N rows (a build of its
own, under its own hash), e.g. 1 to time its AMX path at one row.

Usage: python docs/analysis/q4q8_amx.py q4q8-amx|q4q8-vnni [--threads 2] [--seconds 10]
       [--amx-min-rows N] [--shapes 8960x1536,1536x8960,151936x1536]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from disco.models import q4q8
from disco.models.loading import disco_home

ROWS = (1, 2, 3, 5, 9, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=q4q8.KERNELS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--amx-min-rows", type=int, default=None)
    parser.add_argument("--shapes", default="8960x1536,1536x8960,151936x1536")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variant = next(v for v in q4q8.VARIANTS if v.kernel == args.kernel)
    if args.amx_min_rows is not None:
        threshold = f"-DDISCO_Q4Q8_AMX_MIN_ROWS={args.amx_min_rows}"
        variant = dataclasses.replace(variant, cflags=(*variant.cflags, threshold))
    if (why_not := q4q8.load(disco_home(), variant)) is not None:
        raise SystemExit(why_not)
    label = args.kernel + (f" (AMX from {args.amx_min_rows} rows)" if args.amx_min_rows is not None else "")
    print(f"{label}, {args.threads} threads, AMX: {q4q8.amx_refused() or 'granted'}; ms per call, "
          f"min over {args.seconds:g} s; rows {', '.join(map(str, ROWS))}")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            out_features, in_features = map(int, shape.split("x"))
            q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
            scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
            packed = q4q8.pack(q, scales, scales)
            del q
            inputs = {n: torch.randn(n, in_features, generator=generator).to(torch.bfloat16) for n in ROWS}
            best = {n: float("inf") for n in ROWS}
            for n in ROWS:
                q4q8.mm(inputs[n], packed, out_features)  # warm-up
            deadline = time.perf_counter() + args.seconds
            while time.perf_counter() < deadline:
                for n in ROWS:
                    started = time.perf_counter()
                    q4q8.mm(inputs[n], packed, out_features)
                    best[n] = min(best[n], time.perf_counter() - started)
            print(f"  {shape:<12} " + " ".join(f"{best[n] * 1e3:8.3f}" for n in ROWS))


if __name__ == "__main__":
    main()
