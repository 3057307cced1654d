"""Issue 50, item 1: the roofline of the machine at hand and each engine forward's distance from it.

1. The peaks (``disco.engines.roofline.measure_peaks``): read bandwidth and the q4 x q8 build's
   int8 peak, for ``--threads``.
2. The q4 x q8 kernel alone, per linear shape of the default pair, at 1..8 rows (random weights:
   the speed does not depend on them): ms per call, the one-row call against the bandwidth floor,
   and the share of the int8 peak the rows past the first run at (``(t(8) - t(1)) / 7`` against
   one row's multiply-adds at the peak) — the kernel's own measure for item 2.
3. With ``--engines``: the prepared default pair loaded on those engines (``disco models
   prepare`` first), its target forwards over 1..``--rows`` new tokens after a 128-token context
   and the draft's one-token forward (``measure_forward_costs``, the engines' timing harness),
   against the same floors.

Each timing is the minimum of ``--repeats`` (the least disturbed run); run on a quiet machine.
Usage: python docs/analysis/roofline.py [--threads 2] [--repeats 9] [--engines int4] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

from disco.config import ModelConfig
from disco.engines.engine_costs import CostRequest, measure_forward_costs
from disco.engines.roofline import ForwardWork, distances, extra_row_fraction, forward_work, measure_peaks
from disco.models import q4q8
from disco.models.architectures import default_pair_architectures
from disco.models.loading import disco_home, load_model



def shapes(architecture) -> dict:
    """``{label: ((out_features, in_features), calls per forward)}`` of a Qwen2 architecture's linears."""
    hidden, inner, layers = architecture.hidden_size, architecture.intermediate_size, architecture.num_hidden_layers
    kv = hidden // architecture.num_attention_heads * architecture.num_key_value_heads
    return {f"q/o {hidden}x{hidden}": ((hidden, hidden), 2 * layers), f"k/v {kv}x{hidden}": ((kv, hidden), 2 * layers),
            f"gate/up {inner}x{hidden}": ((inner, hidden), 2 * layers), f"down {hidden}x{inner}": ((hidden, inner), layers),
            f"lm_head {architecture.vocab_size}x{hidden}": ((architecture.vocab_size, hidden), 1)}


SHAPES = {role: shapes(architecture) for role, architecture in default_pair_architectures().items()}
ROWS = tuple(range(1, 9))


def best_time(call, repeats: int) -> float:
    call()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return min(timings)


def kernel_rows(peaks, repeats: int) -> dict:
    """Part 2: the q4 x q8 kernel per shape and rows."""
    results = {}
    generator = torch.Generator().manual_seed(0)
    for role, shapes in SHAPES.items():
        print(f"\n{role}: q4 x q8 ms per call at rows {', '.join(map(str, ROWS))}; one row / bandwidth floor; "
              "extra rows' share of the int8 peak")
        for label, ((out_features, in_features), per_forward) in shapes.items():
            q4 = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
            scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
            packed = q4q8.pack(q4, scales, scales)
            seconds = [best_time(lambda n=n: q4q8.mm(torch.randn(n, in_features).to(torch.bfloat16), packed,
                                                     out_features), repeats) for n in ROWS]
            work = ForwardWork(packed.numel(), out_features * in_features, (q4q8.loaded_kernel(),))
            rows = distances(work, peaks, seconds)
            share = extra_row_fraction(work, peaks, seconds)
            results.setdefault(role, {})[label] = {
                "ms": [round(s * 1000, 4) for s in seconds], "per_forward": per_forward,
                "one_row_over_floor": round(rows[0].ratio, 3), "extra_row_peak_share": share and round(share, 3)}
            print(f"  {label:<22}" + " ".join(f"{s * 1000:7.3f}" for s in seconds)
                  + f"   {rows[0].ratio:5.2f}x  " + (f"{share:.0%}" if share else "-"))
        total = [sum(results[role][label]["ms"][i] * results[role][label]["per_forward"] for label in shapes)
                 for i in range(len(ROWS))]
        macs = sum(o * i * n for (o, i), n in shapes.values())
        share = macs / (peaks.int8_gmac_s * 1e9) / ((total[-1] - total[0]) / 1000 / (len(ROWS) - 1))
        results[role]["forward_linears_ms"] = [round(t, 3) for t in total]
        results[role]["forward_extra_row_peak_share"] = round(share, 3)
        print(f"  {role} forward's linears (sum x count): " + " ".join(f"{t:7.2f}" for t in total)
              + f" ms; extra rows at {share:.0%} of the int8 peak")
    return results


def engine_rows(peaks, engines: list[str], rows: int, repeats: int) -> dict:
    """Part 3: the prepared pair's forwards on each engine against the floors."""
    results = {}
    home = disco_home()
    for engine in engines:
        results[engine] = {}
        for role, tokens in (("target", rows), ("draft", 1)):
            loaded = load_model(ModelConfig(spec=None, dtype=engine, device="cpu"), role, home)
            costs = measure_forward_costs(loaded.model, CostRequest(max_new_tokens=tokens, context_tokens=128,
                                                                    repeats=repeats), progress=True)
            work = forward_work(loaded.model)
            found = distances(work, peaks, costs.forward_s)
            share = extra_row_fraction(work, peaks, costs.forward_s)
            results[engine][role] = {"weight_bytes": work.weight_bytes, "macs_per_row": work.macs_per_row,
                                     "kernels": list(work.kernels), "rows": [d.to_json() for d in found],
                                     "extra_row_peak_share": share and round(share, 3)}
            print(f"\n{engine} {role} ({work.weight_bytes / 1e9:.3f} GB, {work.macs_per_row / 1e9:.3f} G "
                  f"multiply-adds a row, {', '.join(work.kernels)}):")
            for d in found:
                compute = f"{d.compute_floor_s * 1000:7.2f}" if d.compute_floor_s is not None else "      -"
                print(f"  {d.rows} rows: {d.measured_s * 1000:7.2f} ms; floors: read {d.bandwidth_floor_s * 1000:6.2f}, "
                      f"int8 {compute} ms; {d.ratio:.2f}x the floor")
            if share:
                print(f"  extra rows at {share:.0%} of the int8 peak")
            del loaded
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--engines", default="", help="comma-separated engines of the prepared pair (e.g. int4)")
    parser.add_argument("--rows", type=int, default=5, help="target forwards over 1..ROWS new tokens")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = measure_peaks(disco_home(), args.threads)
    print(f"peaks: {peaks.describe()}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {"machine": platform.processor() or platform.machine(), "commit": commit, "torch": torch.__version__,
               "peaks": peaks.to_json(), "repeats": args.repeats}
    with torch.inference_mode():
        if peaks.int8_gmac_s is not None:
            results["kernel"] = kernel_rows(peaks, args.repeats)
        if args.engines:
            results["engines"] = engine_rows(peaks, args.engines.split(","), args.rows, args.repeats)
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
