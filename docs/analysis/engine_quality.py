"""Issue 28, item 5: how close each engine's target is to the dequantized bf16 reference.

For each engine (``--engines``, default ``bfloat16,int4,int8``), on the first ``--limit``
HumanEval **train** prompts, ``--max-new-tokens`` greedy tokens:

* **teacher-forced agreement**: the reference's greedy continuation is fed to the engine in
  one forward; the share of positions whose argmax equals the reference's token (1.0: the
  engine would choose every token the reference chose, given the same prefix);
* **identical**: the share of prompts whose greedy continuation equals the reference's;
* **mean log-likelihood**: of the engine's own greedy continuation, per token, under the
  reference model (higher: text the reference finds as likely as its own; the reference's
  own value is the ceiling).

The reference is the ``bfloat16`` engine (the GGUF dequantized to bf16). Prints a table;
``--json-out`` writes the rows.

Usage: python docs/analysis/engine_quality.py [--engines bfloat16,int4] [--limit 20] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import time

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()

import torch  # noqa: E402

from disco.config import ModelConfig  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402
from disco.offline.datasets import load_dataset  # noqa: E402


def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def logits_over(model, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(continuation), vocab]``: position i predicts continuation[i]."""
    ids = torch.tensor([prompt_ids + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(continuation)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="bfloat16,int4,int8")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    home = disco_home()
    dataset = load_dataset("humaneval:train", limit=args.limit)
    reference = load_model(ModelConfig(spec=None, dtype="bfloat16", device="cpu"), "target", home, progress=False)
    prompts = [item.encode(reference.tokenizer) for item in dataset.items]
    started = time.perf_counter()
    reference_tokens = [greedy(reference.model, ids, args.max_new_tokens) for ids in prompts]
    print(f"reference: {len(prompts)} prompts in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for engine in args.engines.split(","):
        loaded = reference if engine == "bfloat16" else load_model(
            ModelConfig(spec=None, dtype=engine, device="cpu"), "target", home, progress=False)
        agree = total = identical = 0
        log_likelihoods = []
        for ids, expected in zip(prompts, reference_tokens):
            predicted = logits_over(loaded.model, ids, expected).argmax(dim=-1).tolist()
            agree += sum(a == b for a, b in zip(predicted, expected))
            total += len(expected)
            own = expected if loaded is reference else greedy(loaded.model, ids, args.max_new_tokens)
            identical += own == expected
            log_probs = torch.log_softmax(logits_over(reference.model, ids, own), dim=-1)
            log_likelihoods.append(float(log_probs[torch.arange(len(own)), torch.tensor(own)].mean()))
        rows.append({"engine": engine, "prompts": len(prompts), "tokens": total,
                     "teacher_forced_agreement": agree / total, "identical": identical / len(prompts),
                     "mean_log_likelihood": sum(log_likelihoods) / len(log_likelihoods)})
        print(rows[-1], flush=True)
        if loaded is not reference:
            del loaded
    print("\n| engine | teacher-forced agreement | identical continuations | mean log-likelihood (under bf16) |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['engine']} | {row['teacher_forced_agreement']:.3f} | {row['identical']:.2f} "
              f"| {row['mean_log_likelihood']:.3f} |")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"dataset": dataset.name, "max_new_tokens": args.max_new_tokens, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
