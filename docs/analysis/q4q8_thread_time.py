"""The q4 x q8 kernel on one thread, timed by the thread's own CPU time (usable beside other processes).

``time.thread_time`` counts only what this thread ran, so a comparison of two builds stays
meaningful on a busy machine (docs/engines.md, "The roofline": issue 50's kernel work was measured
this way while the test suite ran beside two busy processes). Prints, for the loaded build:

* the instruction's int8 peak (``int8_peak``) and, on VNNI builds, with the kernel's float step
  per group (``int8_group_peak``);
* ``rows``: three linear shapes of the target at 1, 5 and 16 rows (weights in the caches) and the
  share of the peak the rows past the first run at;
* ``one-row``: a one-row call over the draft's 85 MB LM head (weights in memory) and two smaller
  shapes, in GB/s of weights, beside a one-thread float32 sum of 256 MiB (the memory's rate for one
  thread).

To compare two versions of ``kernels/q4q8.cpp``, run each from its own checkout with its own
``--home`` (one build per process). Usage:
python docs/analysis/q4q8_thread_time.py --home /tmp/q4q8_home [--label B]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from disco.models import q4q8


def cpu_seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        call()
        best = min(best, time.thread_time() - started)
    return best


def weights(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    q4 = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
    return q4q8.pack(q4, scales, scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", required=True, help="where this checkout's build goes")
    parser.add_argument("--label", default="")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if (why_not := q4q8.load(Path(args.home))) is not None:
        raise SystemExit(f"no q4 x q8 build: {why_not}")
    torch.set_num_threads(1)
    peak = q4q8.int8_peak(1_000_000) / cpu_seconds(lambda: q4q8.int8_peak(1_000_000), 5)
    group = q4q8.int8_group_peak(100_000)
    group_peak = group / cpu_seconds(lambda: q4q8.int8_group_peak(100_000), 5) if group > 0 else None
    print(f"{args.label} {q4q8.loaded_kernel()}: peak {peak / 1e9:.0f} G multiply-adds/s"
          + (f", with the float step per group {group_peak / peak:.0%} of it" if group_peak else ""))
    generator = torch.Generator().manual_seed(0)
    line = []
    for out_features, in_features in ((8960, 1536), (1536, 8960), (1536, 1536)):
        packed = weights(out_features, in_features, generator)
        rows = {n: torch.randn(n, in_features).to(torch.bfloat16) for n in (1, 5, 16)}
        seconds = {n: cpu_seconds(lambda n=n: [q4q8.mm(rows[n], packed, out_features) for _ in range(5)],
                                  args.repeats) / 5 for n in rows}

        def share(a: int, b: int) -> float:
            return out_features * in_features / peak / ((seconds[b] - seconds[a]) / (b - a))
        line.append(f"{out_features}x{in_features}: 1 row {seconds[1] * 1e3:.3f} ms, 5 {seconds[5] * 1e3:.3f}, "
                    f"16 {seconds[16] * 1e3:.3f}; extra rows 1->5 {share(1, 5):.0%}, 1->16 {share(1, 16):.0%}")
    print(f"{args.label} rows | " + " | ".join(line))
    buffer = torch.ones(256 * 2**20 // 4)
    line = [f"sum {buffer.nbytes / cpu_seconds(lambda: buffer.sum(), 9) / 1e9:.1f} GB/s"]
    for out_features, in_features in ((151936, 896), (4864, 896), (8960, 1536)):
        packed = weights(out_features, in_features, generator)
        row = torch.randn(1, in_features).to(torch.bfloat16)
        seconds = cpu_seconds(lambda: q4q8.mm(row, packed, out_features), 9)
        line.append(f"{out_features}x{in_features} ({packed.nbytes / 1e6:.1f} MB): {seconds * 1e3:.3f} ms = "
                    f"{packed.nbytes / seconds / 1e9:.1f} GB/s")
    print(f"{args.label} one-row | " + " | ".join(line))


if __name__ == "__main__":
    main()
