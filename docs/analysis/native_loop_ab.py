"""Issue 50, item 3: the lean decoder's layer loop in C++ against the Python loop, same process.

Loads a model as the services do (``--dtype``, the default pair's ``--role`` unless
``--model``), fills a ``--context``-token cache, then times forwards over 1..``--max-new``
new tokens through :func:`disco.engines.packed_forward.packed_forward` with the model's lean
decoder (the C++ loop where it runs) and with the same decoder's Python loop, interleaved
round by round (best of ``--rounds``), and checks the logits are equal bit for bit. Prints a
table and one JSON line.

Usage: python docs/analysis/native_loop_ab.py [--role draft] [--dtype int4] [--rounds 15] [--max-new 5]
"""

from __future__ import annotations

import argparse
import json
import time

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()

import torch  # noqa: E402

from disco.config import ModelConfig  # noqa: E402
from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward  # noqa: E402
from disco.engines.kv_pool import PoolCache  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--role", default="draft")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-new", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(spec=args.model, dtype=args.dtype), args.role, disco_home())
    model, vocab = loaded.model, loaded.vocab_size
    lean = lean_decoder_for(model)
    if lean is None or lean.native is None:
        raise SystemExit(f"no C++ loop for this model: {lean.describe() if lean else 'no lean decoder'}")
    print(lean.describe(), flush=True)
    context = [(i * 7919) % (vocab - 1) + 1 for i in range(args.context)]
    cache = PoolCache.for_model(model, args.context + 64)
    packed_forward(model, [SessionRows(cache, 0, context, 0)])
    native = lean.native
    best: dict[tuple[str, int], float] = {}
    equal = True
    for _ in range(args.rounds):
        for rows in range(1, args.max_new + 1):
            tokens = [(17 * rows + i) % vocab for i in range(rows)]
            logits = {}
            for name in ("C++", "Python"):
                lean.native = native if name == "C++" else None
                started = time.perf_counter()
                logits[name] = packed_forward(model, [SessionRows(cache, args.context, tokens, rows)])[0][0]
                elapsed = time.perf_counter() - started
                cache.crop(-rows)
                best[name, rows] = min(best.get((name, rows), elapsed), elapsed)
            equal &= torch.equal(logits["C++"], logits["Python"])
    lean.native = native
    print(f"{loaded.name} ({loaded.engine}, {args.threads} threads), {args.context}-token context, best of {args.rounds}:")
    print("| new tokens | Python loop ms | C++ loop ms | ratio |")
    print("|---:|---:|---:|---:|")
    for rows in range(1, args.max_new + 1):
        python_ms, native_ms = best["Python", rows] * 1e3, best["C++", rows] * 1e3
        print(f"| {rows} | {python_ms:.2f} | {native_ms:.2f} | {python_ms / native_ms:.3f}x |")
    print(f"logits equal bit for bit: {equal}")
    print(json.dumps({"model": loaded.name, "engine": loaded.engine, "threads": args.threads, "equal": equal,
                      "ms": {f"{name}:{rows}": round(value * 1e3, 3) for (name, rows), value in best.items()}}))


if __name__ == "__main__":
    main()
