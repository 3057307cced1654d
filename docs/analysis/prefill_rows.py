"""Prefill time of the target engine and whether a batched prefill gives each prompt the
cache it gets alone (docs/engines.md has the results).

Loads the default target as the engine does (``--dtype``, row-stable linears where the
machine needs them; ``--plain`` skips that step to compare with the plain kernels), then:

* ``prefill_ms``: ``TargetEngine.start_session`` for random prompts of each length, the
  minimum of ``--repeats`` runs after one warm-up;
* ``batched_equals_alone``: the prompts prefilled at once (one packed forward, as
  concurrent requests are) against each alone: every layer's keys and values bit-identical.

Usage (default pair, prepared by ``disco models prepare``)::

    .venv/bin/python docs/analysis/prefill_rows.py --threads 2 [--plain] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disco.platform import tune_cpu_math_env  # noqa: E402

tune_cpu_math_env()

import torch  # noqa: E402

from disco.config import ModelConfig, SamplingParams  # noqa: E402
from disco.engines.target import TargetEngine  # noqa: E402
from disco.models import row_stable  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402


def _cache(engine: TargetEngine, session_id: str) -> list[torch.Tensor]:
    cache = engine.sessions.get(session_id).sequence.cache
    return [layer.keys.clone() for layer in cache.layers] + [layer.values.clone() for layer in cache.layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="20,64,200", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plain", action="store_true", help="keep the plain linear kernels (no row-stable step)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.plain:
        row_stable.stabilize = lambda model: "plain linear kernels (--plain)"
    loaded = load_model(ModelConfig(dtype=args.dtype), "target", disco_home(), progress=True)
    engine = TargetEngine(loaded.model)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    prompts = {n: torch.randint(100, min(vocab, 20_000), (n,), generator=generator).tolist()
               for n in map(int, args.lengths.split(","))}
    sampling = SamplingParams(max_new_tokens=16)

    rows = []
    for length, prompt in prompts.items():
        times = []
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            engine.start_session(f"time-{length}-{repeat}", prompt, sampling)
            if repeat:
                times.append(time.perf_counter() - started)
            engine.end_session(f"time-{length}-{repeat}")
        rows.append({"prompt_tokens": length, "prefill_ms": round(min(times) * 1000, 1)})
        print(f"prefill {length:5d} tokens: {rows[-1]['prefill_ms']:8.1f} ms (min of {args.repeats})", flush=True)

    alone = {}
    for length, prompt in prompts.items():
        engine.start_session(f"alone-{length}", prompt, sampling)
        alone[length] = _cache(engine, f"alone-{length}")
        engine.end_session(f"alone-{length}")
    threads = [threading.Thread(target=engine.start_session, args=(f"batched-{n}", p, sampling))
               for n, p in prompts.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for row in rows:
        length = row["prompt_tokens"]
        batched = _cache(engine, f"batched-{length}")
        row["batched_equals_alone"] = all(torch.equal(a, b) for a, b in zip(batched, alone[length]))
        print(f"prompt {length:5d} tokens: batched prefill cache bit-identical to alone: "
              f"{row['batched_equals_alone']}")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "threads": args.threads, "plain": args.plain,
                                         "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
