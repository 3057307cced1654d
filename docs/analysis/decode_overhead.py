"""Issue 39, item 2: where one target-only token goes in the local loop, by part.

Loads the target as the services do (``--dtype``, the default pair unless ``--model``), then
generates ``--tokens`` tokens target-only (``none``) from a ``--context``-token prompt through
the in-process path (:func:`disco.engines.in_process.build_local_pipeline`: the loop, the target
engine, its batcher, the packed forward). Each part is timed by wrapping the function that
does it (perf_counter, no profiler):

* the forward's decoder (the lean decoder or HF's) and the rest of the packed forward (inputs,
  the LM head, the float32 copy of the logits);
* the batcher around the forward (queueing, the round bookkeeping, live costs);
* the target engine's verify around the batcher (the accept rule, the cache's truncate);
* the loop around verify (the detokenizer, stats, events).

Usage: python docs/analysis/decode_overhead.py [--dtype int4] [--tokens 64] [--context 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()

import torch  # noqa: E402

from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig  # noqa: E402
from disco.engines import batching, draft, kv, lean_decoder, packed_forward, target  # noqa: E402
from disco.engines.in_process import build_local_pipeline  # noqa: E402
from disco.models.loading import disco_home  # noqa: E402
from disco.speculation import loop  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)


def timed(owner, name: str, label: str, is_prefill=lambda *args, **kwargs: False) -> None:
    """Wrap ``owner.name`` so that its calls add their wall time to ``SPENT[label]``; a call
    that ``is_prefill`` says is the prompt's prefill is not counted, nor anything timed inside it."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if is_prefill(*args, **kwargs):
            before = dict(SPENT)
            try:
                return original(*args, **kwargs)
            finally:
                SPENT.clear()
                SPENT.update(before)
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", default="none", help="none, or a drafting policy (static:3): its draft step too")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = PairConfig(target=ModelConfig(spec=args.model, dtype=args.dtype), draft=ModelConfig(dtype=args.dtype))
    pipeline = build_local_pipeline(pair, disco_home(), need_draft=args.policy != "none")
    vocab = pipeline.target.vocab_size
    prompt = [(i * 7919) % (vocab - 1) + 1 for i in range(args.context)]
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    speculation = SpeculationConfig(policy=args.policy)
    pipeline.generator.generate(prompt, sampling, speculation)  # warm-up (and the engine's start-up proofs)

    timed(lean_decoder.LeanDecoder, "__call__", "decoder")
    timed(kv, "packed_forward", "packed forward")  # the name the sequences call
    timed(batching.ForwardBatcher, "forward", "batcher",
          is_prefill=lambda self, sequence, num_logits, *rest, **kwargs: num_logits == 0)
    timed(target.TargetEngine, "verify", "verify")
    drafter = pipeline.generator.drafter
    if drafter is not None:  # the draft engine's step, and its batcher's forward (an instance of its own)
        timed(draft.DraftEngine, "_step", "draft step")
        timed(drafter.batcher, "forward", "draft forward",
              is_prefill=lambda sequence, num_logits, *rest, **kwargs: num_logits == 0)
    best = None
    for _ in range(args.repeats):
        SPENT.clear()
        result = pipeline.generator.generate(prompt, sampling, speculation)
        decode_s = result.stats.wall_s - result.stats.prefill_s
        parts = dict(SPENT)
        if best is None or decode_s < best[0]:
            best = (decode_s, parts, result.stats.generated_tokens, result.stats)
    decode_s, parts, tokens, stats = best
    if drafter is None:
        per_token = {
            "decoder forward": parts.get("decoder", 0.0),
            "rest of the packed forward (inputs, LM head, logits to float32)":
                parts["packed forward"] - parts.get("decoder", 0.0),
            "batcher around the forward": parts["batcher"] - parts["packed forward"],
            "target engine around the batcher": parts["verify"] - parts["batcher"],
            "loop around verify (detokenizer, stats, events)": decode_s - parts["verify"],
        }
    else:  # the shared classes' timers hold both models' forwards: per engine only
        per_token = {
            "target verify (its forward included)": parts["verify"],
            "draft forwards (batcher included)": parts["draft forward"],
            "draft steps around their forward (argmax, signals, policy, host transfer)":
                parts["draft step"] - parts["draft forward"],
            "loop around drafting and verify (detokenizer, stats, events)":
                decode_s - parts["verify"] - parts["draft step"],
        }
    print(f"{pipeline.target.name} ({pipeline.target.engine}, {args.threads} threads), {args.policy}, "
          f"{tokens} tokens after {args.context}: {decode_s / tokens * 1e3:.2f} ms per generated token")
    print(f"  (forwards: {packed_forward.describe_forward(pipeline.target.model)})")
    rows = {label: seconds / tokens * 1e3 for label, seconds in per_token.items()}
    for label, ms in rows.items():
        print(f"  {label:<76} {ms:7.2f} ms")
    if drafter is not None and stats.draft_forwards:
        print(f"  per draft forward ({stats.draft_forwards}): {parts['draft forward'] / stats.draft_forwards * 1e3:.2f} ms "
              f"forward, {(parts['draft step'] - parts['draft forward']) / stats.draft_forwards * 1e3:.2f} ms around it; "
              f"per verification ({stats.iterations}): {parts['verify'] / stats.iterations * 1e3:.2f} ms; "
              f"acceptance {stats.accepted_tokens}/{stats.draft_tokens}")
    if args.json:
        args.json.write_text(json.dumps({"model": pipeline.target.name, "engine": pipeline.target.engine,
                                         "threads": args.threads, "tokens": tokens, "context": args.context,
                                         "ms_per_token": decode_s / tokens * 1e3, "parts_ms": rows}, indent=1))


if __name__ == "__main__":
    main()
