"""Issue 40: what a step of the static path costs, eager and as a CUDA graph, per bucket.

Random weights of the default pair's architectures (``disco.models.architectures``; speed does
not depend on the values), in ``--dtype`` with the row plans of the device
(:func:`disco.models.row_stable.stabilize`, norms too on a GPU), static caches of ``--slots``
slots whose first ``sessions`` hold ``--context`` positions of random keys and values. For each
model and bucket (sessions x block) it times the eager step and, on CUDA, the graph replay
(median of ``--repeats``, the device synchronised), and reports the capture's time and memory.
Prints a table; ``--json`` writes it. On a CPU it runs the eager steps only (a dry run of the
script; the GPU check runs it on the device).

Usage: python docs/analysis/static_step_speed.py [--device cuda] [--buckets 1x1,1x4,1x8,8x1,32x1,32x4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from disco.engines.packed_forward import lean_decoder_for, supports_packing
from disco.engines.static_step import Bucket, StaticCaches, StaticStep
from disco.engines.varlen_attention import ONE_CALL_CPU, ONE_CALL_CUDA
from disco.models import row_stable
from disco.models.architectures import default_pair_architectures


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(run, device: torch.device, repeats: int) -> float:
    run()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--roles", default="target,draft")
    parser.add_argument("--buckets", default="1x1,1x4,1x8,8x1,8x4,32x1,32x4")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    buckets = [Bucket(*map(int, text.split("x"))) for text in args.buckets.split(",")]
    plan = ONE_CALL_CUDA if device.type == "cuda" else ONE_CALL_CPU
    results = []
    for role in args.roles.split(","):
        architecture = default_pair_architectures()[role]
        model = architecture.random_model(seed=0, dtype=dtype).to(device)
        if dtype != torch.float32:
            if device.type == "cuda":
                row_stable.stabilize_norms(model)
            row_stable.stabilize(model)
        assert supports_packing(model)
        lean = lean_decoder_for(model)
        if lean is None:
            raise SystemExit(f"{role}: no lean decoder (see the log)")
        caches = StaticCaches(model, args.slots, args.context + max(bucket.block for bucket in buckets))
        steps = {bucket: StaticStep(lean, caches, bucket, plan) for bucket in buckets}
        graphed, report = {}, None
        if device.type == "cuda":
            from disco.engines.step_runner import capture_buckets  # noqa: PLC0415

            graphed, report = capture_buckets(steps.values())  # before the slots hold anything
            print(f"{role}: {report.describe()}")
        generator = torch.Generator(device="cpu").manual_seed(1)
        for keys, values in zip(caches.keys, caches.values):  # random context in every slot
            keys[:, :, : args.context] = torch.randn(keys[:, :, : args.context].shape, generator=generator).to(keys)
            values[:, :, : args.context] = torch.randn(values[:, :, : args.context].shape, generator=generator).to(values)
        for run in caches.runs:
            run.length = args.context
        for bucket in buckets:
            rows = [caches.session_rows(slot, [7] * bucket.block) for slot in range(bucket.sessions)]
            eager = median_ms(lambda: steps[bucket].forward(rows), device, args.repeats)
            replay = median_ms(lambda: graphed[bucket].forward(rows), device, args.repeats) if graphed else None
            results.append({"role": role, "sessions": bucket.sessions, "block": bucket.block, "eager_ms": eager,
                            "graph_ms": replay, "tokens_per_s_graph": bucket.rows / replay * 1e3 if replay else None,
                            "capture_s": report.seconds if report else None,
                            "capture_mib": report.memory_bytes / 2**20 if report else None,
                            "cache_mib": caches.nbytes / 2**20})
            print(f"{role:<6} {bucket.sessions:>3} x {bucket.block:<2} eager {eager:8.2f} ms   graph "
                  f"{'-' if replay is None else f'{replay:8.2f} ms'}")
        del model, caches, steps, graphed
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "dtype": args.dtype, "context": args.context,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
