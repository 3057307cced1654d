"""Issue 28, item 3: where a one-token forward of the default target spends its time.

Loads a model as the services do (``--dtype``, the default pair unless ``--model``), fills
a ``--context``-token KV cache, then runs ``--steps`` forwards over ``--new-tokens`` new
tokens each (1: decoding; more: a verification block, rolled back after) through the
engines' own path (:class:`disco.engines.kv.CachedSequence`) under ``torch.profiler`` and
sums the CPU self time per group of operators: the weight GEMMs (``linear``/``mm``/
``addmm`` and the weight-only kernels), attention (``scaled_dot_product_attention``), the
LM head's float32 copy of the logits, and everything else (norms, rotary embedding,
elementwise ops, cache updates, module overhead). Prints a table and the wall time per step.

Usage: python docs/analysis/forward_breakdown.py [--dtype bfloat16] [--threads 2] [--steps 10] [--new-tokens 1]
"""

from __future__ import annotations

import argparse
import collections
import time

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from disco.config import ModelConfig  # noqa: E402
from disco.engines.kv import CachedSequence  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402

GROUPS = (("weight GEMMs", ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm",
                            "aten::_weight_int4pack_mm_for_cpu", "disco_q4q8::mm", "aten::bmm", "aten::matmul")),
          ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product")),
          ("logits to float32", ("aten::_to_copy", "aten::copy_")))


def group_of(name: str) -> str:
    return next((label for label, prefixes in GROUPS if name.startswith(prefixes)), "other ops")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--role", default="target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=1, help="tokens per forward (a verification block)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(spec=args.model, dtype=args.dtype), args.role, disco_home())
    vocab = loaded.vocab_size
    sequence = CachedSequence(loaded.model, [(i * 7919) % (vocab - 1) + 1 for i in range(args.context + 1)])
    sequence.prefill()
    sequence.forward(1)
    block = args.new_tokens

    def one_forward(first_token: int) -> None:
        base = len(sequence.tokens)
        sequence.tokens.extend(first_token + i for i in range(block))
        sequence.forward(block)
        if block > 1:
            sequence.truncate(base + 1)  # the context stays ~--context tokens

    for step in range(3):  # warm-up
        one_forward(100 + step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for step in range(args.steps):
            one_forward(200 + step)
        wall = (time.perf_counter() - started) / args.steps
    totals: dict[str, float] = collections.defaultdict(float)
    top: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        totals[group_of(event.key)] += event.self_cpu_time_total / 1000 / args.steps
        top[event.key] += event.self_cpu_time_total / 1000 / args.steps
    measured = sum(totals.values())
    print(f"{loaded.name} ({loaded.engine}, {args.threads} threads): {wall * 1000:.1f} ms per forward over {block} new "
          f"token(s) after {args.context} tokens (wall); profiler self time {measured:.1f} ms")
    for label, ms in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {label:<20} {ms:8.1f} ms  {ms / measured:6.1%}")
    print("  top operators:")
    for name, ms in sorted(top.items(), key=lambda item: -item[1])[:12]:
        print(f"    {name:<40} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
