"""Speed and quality of the int8 engine against the bfloat16 one, on real models
(docs/engines.md has the results and the commands).

``speed``: one forward over k new tokens after a context of C tokens (default 200), for
every engine variant of the target and the draft, timed round-robin (each round times
every variant at every k, so load from other processes hits them alike); prints the
median ms.

``quality``: on N HumanEval prompts of the *train* split, the bf16 target's greedy
continuation (T tokens), then per int8 variant of the target:

* ``agree``: teacher-forced greedy agreement: the share of positions where the variant's
  argmax (given the bf16 continuation so far) is the bf16 token;
* ``loglik``: mean log-probability (nats/token) of the bf16 continuation under the
  variant, next to the bf16 model's own (teacher-forced the same way);
* ``identical`` / ``first_div``: of its own free-running greedy continuation, the share
  of prompts identical to bf16's and the mean first position where they differ.

Variants: ``bf16`` (dense), ``int8`` (every linear int8, the LM head too: the engine
``--dtype int8`` loads), ``int8-densehead`` (the LM head kept bf16).

Usage (default pair, prepared by ``disco models prepare``)::

    .venv/bin/python docs/analysis/int8_engine.py speed --threads 2 --rounds 7
    .venv/bin/python docs/analysis/int8_engine.py quality --threads 2 --prompts 20 --new-tokens 32
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from disco.platform import tune_cpu_math_env  # noqa: E402

tune_cpu_math_env()  # before torch, as the CLI does

import torch  # noqa: E402

from disco.config import ModelConfig  # noqa: E402
from disco.engines.kv import CachedSequence  # noqa: E402
from disco.models.loading import disco_home, load_model  # noqa: E402
from disco.models.quantize import quantize_model  # noqa: E402
from disco.offline.datasets import load_dataset  # noqa: E402

VARIANTS = ("bf16", "int8", "int8-densehead")


def _variants(role: str, spec: str | None, names: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    home = disco_home()
    models = {}
    dense = load_model(ModelConfig(spec=spec, dtype="bfloat16"), role, home, progress=False)
    if "int8-densehead" in names:
        models["int8-densehead"] = quantize_model(copy.deepcopy(dense.model), lm_head=False)
    if "int8" in names:
        models["int8"] = load_model(ModelConfig(spec=spec, dtype="int8"), role, home, progress=False).model
    if "bf16" in names:
        models["bf16"] = dense.model
    return {name: models[name] for name in names}


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def speed(args: argparse.Namespace) -> dict:
    ks = [int(k) for k in args.ks.split(",")]
    models = {}
    for role, spec in (("target", args.target), ("draft", args.draft)):
        for name, model in _variants(role, spec, tuple(args.variants.split(","))).items():
            models[f"{role} {name}"] = model
        gc.collect()
    context = [(i * 7919) % 150000 + 1 for i in range(args.context)]
    sequences = {}
    for label, model in models.items():
        _log(f"prefilling {label} ({args.context} tokens)")
        sequence = CachedSequence(model, [*context, context[-1]])
        started = time.perf_counter()
        sequence.prefill()
        _log(f"  {time.perf_counter() - started:.1f} s")
        sequence.truncate(args.context)
        sequences[label] = sequence
    samples = {label: {k: [] for k in ks} for label in models}
    with torch.inference_mode():
        for round_index in range(args.rounds + 1):  # round 0 warms up
            for k in ks:
                for label, sequence in sequences.items():
                    sequence.tokens.extend((args.context + round_index + i) % 150000 + 1 for i in range(k))
                    started = time.perf_counter()
                    sequence.forward(k)
                    elapsed = time.perf_counter() - started
                    sequence.truncate(args.context)
                    if round_index:
                        samples[label][k].append(elapsed * 1000)
            _log(f"round {round_index} done")
    table = {label: {k: round(statistics.median(v), 1) for k, v in by_k.items()} for label, by_k in samples.items()}
    print(f"ms per forward over k new tokens after {args.context} tokens, {torch.get_num_threads()} threads, "
          f"median of {args.rounds}")
    print(f"{'model engine':<26}" + "".join(f"{f'k={k}':>9}" for k in ks))
    for label, by_k in table.items():
        print(f"{label:<26}" + "".join(f"{by_k[k]:>9.1f}" for k in ks))
    return {"context": args.context, "threads": torch.get_num_threads(), "rounds": args.rounds, "ms": table}


def _greedy(sequence: CachedSequence, new_tokens: int) -> list[int]:
    """Greedy continuation from a prefilled sequence; the sequence is rolled back after."""
    base, out = len(sequence), []
    for _ in range(new_tokens):
        logits, _ = sequence.forward(1)
        token = int(logits[0].argmax())
        out.append(token)
        sequence.tokens.append(token)
    _roll_back(sequence, base)
    return out


def _roll_back(sequence: CachedSequence, length: int) -> None:
    """Back to ``tokens[:length]`` with the last token pending again (as after prefill)."""
    last = sequence.tokens[length - 1]
    sequence.truncate(length - 1)
    sequence.tokens.append(last)


def _teacher_forced(sequence: CachedSequence, continuation: list[int]) -> tuple[float, float]:
    """(mean log-prob of ``continuation``, share of positions whose argmax is the token),
    from a prefilled sequence (one forward over the continuation; rolled back after)."""
    base = len(sequence)
    sequence.tokens.extend(continuation[:-1])
    logits, _ = sequence.forward(len(continuation))  # [len(continuation), vocab]
    _roll_back(sequence, base)
    targets = torch.tensor(continuation)
    logprobs = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(continuation)), targets]
    agree = (logits.argmax(dim=-1) == targets).float().mean()
    return float(logprobs.mean()), float(agree)


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def quality(args: argparse.Namespace) -> dict:
    models = _variants("target", args.target, VARIANTS)  # bf16 first
    tokenizer = load_model(ModelConfig(spec=args.target, dtype="int8"), "target", disco_home(),
                           progress=False).tokenizer
    dataset = load_dataset("humaneval:train", args.prompts)
    rows = []
    with torch.inference_mode():
        for index, item in enumerate(dataset.items):
            prompt = item.encode(tokenizer)
            row, reference = {"id": item.id, "prompt_tokens": len(prompt)}, None
            for name, model in models.items():  # bf16 first: its greedy output is the reference
                sequence = CachedSequence(model, prompt)
                sequence.prefill()  # once per model and prompt; each pass below rolls back to it
                own = _greedy(sequence, args.new_tokens)
                reference = reference or own
                loglik, agree = _teacher_forced(sequence, reference)
                row[name] = {"loglik": loglik, "agree": agree}
                if name != "bf16":
                    row[name]["first_div"] = _first_divergence(own, reference)
                    row[name]["identical"] = own == reference
            rows.append(row)
            _log(f"{index + 1}/{len(dataset.items)} {item.id}: " + ", ".join(
                f"{n} agree {row[n]['agree']:.3f} loglik {row[n]['loglik']:.3f}" for n in models))
    summary = {}
    for name in models:
        values = [row[name] for row in rows]
        summary[name] = {"agree": statistics.mean(v["agree"] for v in values),
                         "loglik": statistics.mean(v["loglik"] for v in values)}
        if name != "bf16":
            summary[name]["identical"] = statistics.mean(float(v["identical"]) for v in values)
            summary[name]["first_div"] = statistics.mean(v["first_div"] for v in values)
    print(f"HumanEval train, {len(rows)} prompts x {args.new_tokens} greedy tokens of the bf16 target")
    print(f"{'engine':<16}{'agree':>8}{'loglik':>9}{'identical':>11}{'first_div':>11}")
    for name, values in summary.items():
        print(f"{name:<16}{values['agree']:>8.4f}{values['loglik']:>9.4f}"
              f"{values.get('identical', 1.0):>11.2f}{values.get('first_div', args.new_tokens):>11.1f}")
    return {"prompts": len(rows), "new_tokens": args.new_tokens, "summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["speed", "quality"])
    parser.add_argument("--target", default=None, help="target model spec (default: the default pair's)")
    parser.add_argument("--draft", default=None, help="draft model spec (default: the default pair's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="speed: engine variants to time")
    parser.add_argument("--ks", default="1,2,4,8", help="speed: new tokens per forward")
    parser.add_argument("--context", type=int, default=200, help="speed: context tokens")
    parser.add_argument("--rounds", type=int, default=7, help="speed: timings per point")
    parser.add_argument("--prompts", type=int, default=20, help="quality: HumanEval train prompts")
    parser.add_argument("--new-tokens", type=int, default=32, help="quality: greedy tokens per prompt")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = speed(args) if args.command == "speed" else quality(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
