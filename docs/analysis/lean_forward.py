"""Issue 39, item 1: the lean decoder against the HF decoder, per forward, on the same weights.

Loads a model as the services do (``--dtype``, the default pair's ``--role``), prefills a
``--context``-token cache, then times ``--steps`` packed forwards over ``--new-tokens`` new
tokens (1: decoding; more: a verification block, rolled back after) through the HF decoder
and through the lean decoder, alternately, in one process. Then the same with the q4 x q8
kernel's calls replaced by a zero result of the right shape: what the forward costs besides
its weight GEMMs (ops, Python). Prints the medians.

Usage: python docs/analysis/lean_forward.py [--role draft] [--dtype int4] [--new-tokens 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()

import torch  # noqa: E402

from disco.config import ModelConfig  # noqa: E402
from disco.engines.packed_forward import SessionRows, describe_forward, packed_forward  # noqa: E402
from disco.engines.kv_pool import PoolCache  # noqa: E402
from disco.models import q4q8  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="draft")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=1)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(spec=None, dtype=args.dtype), args.role, disco_home())
    model, block = loaded.model, args.new_tokens
    print(f"{loaded.name} ({loaded.engine}, {args.threads} threads): {describe_forward(model)}")
    tokens = [(i * 7919) % (loaded.vocab_size - 1) + 1 for i in range(args.context + args.steps + block)]

    def median_ms(lean: bool) -> float:
        cache = PoolCache.for_model(model, len(tokens))
        packed_forward(model, [SessionRows(cache, 0, tokens[:args.context], 0)], lean=None if lean else False)
        length, seconds = args.context, []
        for _ in range(args.steps):
            started = time.perf_counter()
            packed_forward(model, [SessionRows(cache, length, tokens[length: length + block], block)],
                           lean=None if lean else False)
            seconds.append(time.perf_counter() - started)
            if block > 1:
                cache.crop(-(block - 1))
            length += 1
        return statistics.median(seconds) * 1e3

    timed = {lean: median_ms(lean) for lean in (False, True, False, True)}  # the second run of each kept
    real_mm, zeros = q4q8.mm, {}

    def no_gemm(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        key = (rows.shape[0], out_features)
        if key not in zeros:
            zeros[key] = torch.zeros(key, dtype=torch.bfloat16)
        return zeros[key]

    q4q8.mm = no_gemm
    try:
        without = {lean: median_ms(lean) for lean in (False, True)}
    finally:
        q4q8.mm = real_mm
    for lean, label in ((False, "HF decoder"), (True, "lean decoder")):
        print(f"  {label:<13} {timed[lean]:6.1f} ms per forward over {block} new token(s) after {args.context}; "
              f"without the q4 x q8 GEMMs {without[lean]:5.1f} ms")


if __name__ == "__main__":
    main()
