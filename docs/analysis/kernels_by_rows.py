"""Issue 28, item 2: the CPU GEMM candidates for the default pair's linear shapes, by rows.

For each linear shape of the target (Qwen2.5-Coder-1.5B) and the draft (0.5B) — the
attention projections, the MLP and the LM head — times one call at 1, 2, 4, 8 and 16 rows
(decoding, verification blocks) and at 200 rows (a prefill) for:

* ``bf16``: ``F.linear`` on bfloat16 weights (the target's engine today on AVX-512-BF16/AMX);
* ``int8``: ``torch._weight_int8pack_mm`` (int8 weights, per-channel scales, bf16 activations);
* ``int4-gG``: ``torch._weight_int4pack_mm_for_cpu`` with groups of G input features
  (G = 32 is a GGUF Q4_K sub-block; 64 is the draft's engine today);
* ``q4q8``: the int4 engine's q4 x q8 VNNI kernel (``disco.models.q4q8``, groups of 32,
  activations quantized to int8 per row and group), where the CPU has AVX-512 VNNI.

Weights are random (the kernels' speed does not depend on the values). Each point is the
minimum of ``--repeats`` timings after a warm-up (the least disturbed run on a shared
machine). Also prints the weight bytes each call reads and the bandwidth that implies:
a one-row call that reads its weights at the machine's memory bandwidth is as fast as
that kernel can be.

Usage: python docs/analysis/kernels_by_rows.py [--threads 2] [--repeats 7] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from disco.models import q4q8
from disco.models.loading import disco_home

SHAPES = {  # (out_features, in_features) per linear, and how many of it one forward runs
    "target": {"q/o 1536x1536": ((1536, 1536), 2 * 28), "k/v 256x1536": ((256, 1536), 2 * 28),
               "gate/up 8960x1536": ((8960, 1536), 2 * 28), "down 1536x8960": ((1536, 8960), 28),
               "lm_head 151936x1536": ((151936, 1536), 1)},
    "draft": {"q/o 896x896": ((896, 896), 2 * 24), "k/v 128x896": ((128, 896), 2 * 24),
              "gate/up 4864x896": ((4864, 896), 2 * 24), "down 896x4864": ((896, 4864), 24),
              "lm_head 151936x896": ((151936, 896), 1)},
}
ROWS = (1, 2, 4, 8, 16, 200)


def candidates(out_features: int, in_features: int) -> dict:
    """``{name: (call(rows) -> out, weight bytes)}`` for one shape."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    dense = weight.to(torch.bfloat16)
    found = {"bf16": (lambda x: torch.nn.functional.linear(x, dense), dense.numel() * 2)}
    int8 = (weight / (weight.abs().amax(dim=1, keepdim=True) / 127)).round().clamp(-127, 127).to(torch.int8)
    scales = (weight.abs().amax(dim=1) / 127).to(torch.bfloat16)
    found["int8"] = (lambda x: torch._weight_int8pack_mm(x, int8, scales), int8.numel() + scales.numel() * 2)
    for group in (32, 64, 128):
        if in_features % group:
            continue
        q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_zeros = (torch.rand(in_features // group, out_features, 2, generator=generator) * 0.01).to(
            torch.bfloat16)
        found[f"int4-g{group}"] = (
            lambda x, p=packed, g=group, sz=scales_zeros: torch._weight_int4pack_mm_for_cpu(x, p, g, sz),
            packed.numel() + scales_zeros.numel() * 2)
    if q4q8.ops_loaded() and in_features % 32 == 0 and out_features % 16 == 0:
        q4 = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
        group_scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
        repacked = q4q8.pack(q4, group_scales, group_scales)
        found["q4q8"] = (lambda x, p=repacked, n=out_features: q4q8.mm(x, p, n), repacked.numel())
    return found


def best_time(call, rows: torch.Tensor, repeats: int) -> float:
    call(rows)  # warm-up
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(rows)
        timings.append(time.perf_counter() - started)
    return min(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--roles", default="target,draft")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if (why_not := q4q8.load(disco_home())) is not None:
        print(f"q4q8: not measured ({why_not})")
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads": args.threads, "repeats": args.repeats, "rows": ROWS, "shapes": {}}
    with torch.inference_mode():
        for role in args.roles.split(","):
            print(f"\n{role}: ms per call (rows: {', '.join(map(str, ROWS))}); GB/s at 1 row; per forward at 1 row")
            for label, ((out_features, in_features), per_forward) in SHAPES[role].items():
                for name, (call, weight_bytes) in candidates(out_features, in_features).items():
                    ms = [best_time(call, torch.randn(n, in_features).to(torch.bfloat16), args.repeats) * 1000
                          for n in ROWS]
                    gbps = weight_bytes / (ms[0] / 1000) / 1e9
                    results["shapes"].setdefault(role, {}).setdefault(label, {})[name] = {
                        "ms": [round(v, 3) for v in ms], "weight_mb": round(weight_bytes / 1e6, 2),
                        "gb_per_s_one_row": round(gbps, 1), "per_forward": per_forward}
                    print(f"  {label:<22} {name:<9} " + " ".join(f"{v:8.2f}" for v in ms)
                          + f"   {weight_bytes / 1e6:7.1f} MB {gbps:6.1f} GB/s  x{per_forward} = "
                            f"{ms[0] * per_forward:7.1f} ms")
            for name in ("bf16", "int8", "int4-g32", "int4-g64", "int4-g128", "q4q8"):
                total = sum(shape[name]["ms"][0] * shape[name]["per_forward"]
                            for shape in results["shapes"][role].values() if name in shape)
                print(f"  {role} one-token forward, linears only, {name}: {total:.1f} ms")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
