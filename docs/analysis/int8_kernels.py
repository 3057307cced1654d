"""Kernel timings behind the int8 engine's design (docs/engines.md).

Times one linear layer, eager mode, at a few row counts (a decode step is 1 row, a
verification block k + 1 rows), interleaving the engines round-robin so contention from
other processes hits all of them alike, and prints the median per engine and row count:

* ``bf16``: ``F.linear`` with bfloat16 weights and activations (the dense engine);
* ``int8pack``: ``torch._weight_int8pack_mm`` called directly (int8 weights, bf16 activations);
* ``Int8Linear``: :class:`disco.models.quantize.Int8Linear` (the module over that op);
* ``torchao``: ``torchao.quantization.Int8WeightOnlyConfig`` applied with ``quantize_``
  (what transformers' ``TorchAoConfig("int8_weight_only")`` runs), when torchao imports;
* ``deq-fp32`` (with ``--dequant``): dequantize the int8 weight to float32 on every call
  and run an fp32 GEMM (a candidate for long prefills, where the int8 kernel scales
  linearly with the rows).

Usage (2 threads, the MLP up-projection of Qwen2.5-1.5B and its LM head)::

    .venv/bin/python docs/analysis/int8_kernels.py --threads 2 --shape 1536x8960 --rounds 200
    .venv/bin/python docs/analysis/int8_kernels.py --threads 2 --shape 1536x151936 --rounds 20 --no-torchao

torchao is not a dependency of disco-serve; to include it without touching the
environment: ``pip install --no-deps --target /tmp/torchao_site torchao`` and run with
``PYTHONPATH=/tmp/torchao_site``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disco.platform import tune_cpu_math_env  # noqa: E402

tune_cpu_math_env()  # before torch, as the CLI does

import torch  # noqa: E402

from disco.models.quantize import Int8Linear, quantize_weight  # noqa: E402


def _engines(linear: torch.nn.Linear, with_torchao: bool,
             with_dequant: bool = False) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    weight = linear.weight.detach()
    quantized, scales = quantize_weight(weight)
    module = Int8Linear.from_weight(weight)
    engines = {
        "bf16": lambda x: torch.nn.functional.linear(x, weight),
        "int8pack": lambda x: torch._weight_int8pack_mm(x, quantized, scales),
        "Int8Linear": module,
    }
    if with_dequant:
        engines["deq-fp32"] = lambda x: torch.nn.functional.linear(
            x.float(), quantized.float() * scales.float()[:, None]).to(x.dtype)
    if with_torchao:
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: PLC0415
        except ImportError as error:
            print(f"torchao not importable ({error}); skipping it")
        else:
            ao = copy.deepcopy(linear)
            quantize_(ao, Int8WeightOnlyConfig())
            engines["torchao"] = ao
    return engines


def measure(shape: tuple[int, int], rows: list[int], rounds: int, with_torchao: bool,
            with_dequant: bool = False) -> dict:
    in_features, out_features = shape
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16).eval()
    engines = _engines(linear, with_torchao, with_dequant)
    inputs = {n: torch.randn(n, in_features, dtype=torch.bfloat16) for n in rows}
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in engines}
    with torch.inference_mode():
        for name, engine in engines.items():  # warm-up, and a sanity check of the outputs
            reference = torch.nn.functional.linear(inputs[rows[0]].float(), linear.weight.float())
            error = (engine(inputs[rows[0]]).float() - reference).norm() / reference.norm()
            print(f"{name}: relative output error {error:.4f}")
        for _ in range(rounds):
            for n in rows:
                for name, engine in engines.items():
                    started = time.perf_counter()
                    engine(inputs[n])
                    samples[name][n].append(time.perf_counter() - started)
    return {name: {n: statistics.median(values) * 1000 for n, values in by_rows.items()}
            for name, by_rows in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1536x8960", help="IN x OUT features (default 1536x8960)")
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=200, help="timings per engine and row count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--dequant", action="store_true", help="also time the dequantize + fp32 GEMM path")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    rows = [int(v) for v in args.rows.split(",")]
    result = measure(shape, rows, args.rounds, not args.no_torchao, args.dequant)
    if args.json:
        print(json.dumps({"shape": shape, "threads": args.threads, "rounds": args.rounds, "ms": result}))
        return
    print(f"linear {shape[0]}->{shape[1]}, {args.threads} threads, median of {args.rounds} (ms)")
    print(f"{'engine':<12}" + "".join(f"{f'{n} rows':>10}" for n in rows))
    for name, by_rows in result.items():
        print(f"{name:<12}" + "".join(f"{by_rows[n]:>10.2f}" for n in rows))


if __name__ == "__main__":
    main()
