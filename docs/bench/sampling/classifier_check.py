"""Does the shipped DISCO classifier still predict acceptance for sampled requests (issue 47, item 4)?

``disco:default`` was trained on greedy oracle records (a draft token is accepted iff the draft's
argmax is the target's argmax). Sampled requests are now verified by drafter-invariant sampling:
the draft proposes the Gumbel-max sample of its warped distribution under the noise of (seed,
position) and the target accepts it iff it is its own Gumbel-max sample there
(docs/exactness.md, "Sampling"). This script measures, on the real default pair (``--dtype auto``
engines, as ``disco generate`` builds them), how well the classifier's predictions match the
acceptance the target actually gives at temperature 0 (the training condition) and under sampling.

Every request runs through the in-process speculative generator with a fixed block
(``static:6``). The session's policy is the static one wrapped in an observer that also feeds
every draft token to a live :class:`~disco.speculation.policies.learned.DiscoPolicy` built by the
same loader ``disco:default`` uses (so the features are the live extractor's, computed from the
drafting loop's own signals) and records its calibrated probability, its rule statistic and
whether the tuned threshold would stop there; a wrapper around the target engine records each
verdict. Labels are training's (:mod:`disco.offline.training`):

* ``current`` — token j of a block is positive iff it and every token before it in the block
  were accepted (tokens after the first rejection are negative);
* ``conditional`` — token j is accepted given tokens 0..j-1 were (undefined, left out, after the
  first rejection): what the shipped classifier (label ``conditional``) predicts per token and
  what ``auto``'s rate rule reads.

The shipped rule is ``cumulative``: its statistic ``C_j = p_0 ... p_j`` estimates P(current) and
the block stops where ``C_j`` < the tuned threshold. Reported per temperature: tokens, base
acceptance, ROC AUC of ``C_j`` against ``current`` and of ``p_j`` against ``conditional`` (with a
90% bootstrap interval over prompts), mean predicted vs observed acceptance in 5 equal-width
probability bins, and what the tuned threshold does on these tokens (fraction of tokens at which
it stops; precision and recall of "continue" as a prediction of ``current``).

Run (held-out prompts only: ``humaneval:test``; nothing here is tuned)::

    nice -n 5 python docs/bench/sampling/classifier_check.py --limit 8 --max-new-tokens 48 \
        --json-out docs/bench/sampling/epyc_classifier_check.json

``--artifacts default,new.disco`` judges several artifacts on the same drafted tokens (the block
is the fixed policy's, so the tokens and verdicts do not depend on the artifacts); the JSON then
keys ``summary`` and ``tokens`` by artifact (``epyc_classifier_check.json`` predates this: one
artifact, ``summary`` keyed by temperature).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

import disco
from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig
from disco.engines.engine_choice import choose_engine
from disco.engines.in_process import build_local_pipeline, default_learned_loader
from disco.models.loading import disco_home
from disco.offline.classifiers import auc
from disco.offline.datasets import load_dataset
from disco.speculation.policies import Decision, PolicyFactory, StopPolicy
from disco.speculation.policies.learned import DiscoPolicy
from disco.speculation.signals import TokenSignals

BINS = np.linspace(0.0, 1.0, 6)  # 5 equal-width probability bins


# --- observing the live policy and the target's verdicts --------------------------------------------------


@dataclass
class Block:
    """What the observed DISCO policy said about each token of one drafted block."""

    probability: list[float] = field(default_factory=list)  # p_j, calibrated (label "conditional")
    statistic: list[float] = field(default_factory=list)  # the rule's statistic (cumulative: C_j)
    stop: list[bool] = field(default_factory=list)  # the tuned threshold would stop after this token
    token_prob: list[float] = field(default_factory=list)  # draft probability (T=1) of the drafted token
    top1: list[bool] = field(default_factory=list)  # the drafted token is the draft's argmax


class ObservingPolicy(StopPolicy):
    """Drafts as ``inner`` (a static block) and asks each DISCO policy about every token,
    recording what it predicts; each gets the same call sequence as when it runs the session
    itself. ``blocks[name]`` holds what the policy of artifact ``name`` said, block by block."""

    needs_signals = True

    def __init__(self, inner: StopPolicy, disco_policies: dict[str, DiscoPolicy],
                 blocks: dict[str, list[Block]]) -> None:
        self.inner, self.discos, self.blocks = inner, disco_policies, blocks
        self.needs_hidden = any(policy.needs_hidden for policy in disco_policies.values())

    def begin_block(self, max_lookahead: int) -> int:
        for name, policy in self.discos.items():
            policy.begin_block(max_lookahead)
            self.blocks[name].append(Block())
        return self.inner.begin_block(max_lookahead)

    def after_token(self, position: int, token_id: int, signals: TokenSignals | None) -> Decision:
        assert signals is not None
        for name, policy in self.discos.items():
            decision = policy.after_token(position, token_id, signals)
            block = self.blocks[name][-1]
            block.probability.append(float(policy.last_probability))
            block.statistic.append(float(policy.last_statistic))
            block.stop.append(decision is not Decision.CONTINUE)
            block.token_prob.append(signals.token_prob)
            block.top1.append(signals.token_prob >= signals.topk_probs[0])
        return self.inner.after_token(position, token_id, signals)

    def on_feedback(self, num_drafted: int, num_accepted: int) -> None:
        for policy in self.discos.values():
            policy.on_feedback(num_drafted, num_accepted)
        self.inner.on_feedback(num_drafted, num_accepted)

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        for policy in self.discos.values():
            policy.observe_verification(num_drafted, num_accepted)
        self.inner.observe_verification(num_drafted, num_accepted)


class ObservingFactory(PolicyFactory):
    """The drafter's policy factory, except that ``spec`` sessions run an :class:`ObservingPolicy`
    over a fresh policy of every artifact in ``disco_factories``."""

    def __init__(self, base: PolicyFactory, spec: str, disco_factories: dict,
                 blocks: dict[str, list[Block]]) -> None:
        super().__init__()
        self.base, self.spec, self.disco_factories, self.blocks = base, spec, disco_factories, blocks

    def build(self, spec: str, reference_ids: Sequence[int] | None = None) -> StopPolicy:
        policy = self.base.build(spec, reference_ids)
        if spec != self.spec:
            return policy
        return ObservingPolicy(policy, {name: factory() for name, factory in self.disco_factories.items()},
                               self.blocks)


class RecordingVerifier:
    """The target engine, recording ``(drafted, accepted)`` of every verification of a non-empty block."""

    def __init__(self, engine) -> None:
        self.engine, self.verdicts = engine, []

    def verify(self, session_id, draft_token_ids, *args, **kwargs):
        verdict = self.engine.verify(session_id, draft_token_ids, *args, **kwargs)
        if len(draft_token_ids):
            self.verdicts.append((len(draft_token_ids), verdict.num_accepted))
        return verdict

    def __getattr__(self, name):
        return getattr(self.engine, name)


# --- metrics ------------------------------------------------------------------------------------------------


def bootstrap_auc(y: np.ndarray, p: np.ndarray, groups: np.ndarray, rounds: int = 1000) -> list[float]:
    """90% interval of the AUC, resampling whole prompts (tokens of one prompt are not independent)."""
    rng = np.random.default_rng(0)
    ids = np.unique(groups)
    index = {g: np.flatnonzero(groups == g) for g in ids}
    values = []
    for _ in range(rounds):
        pick = np.concatenate([index[g] for g in rng.choice(ids, len(ids))])
        value = auc(y[pick], p[pick])
        if value == value:
            values.append(value)
    return [round(float(np.percentile(values, 5)), 4), round(float(np.percentile(values, 95)), 4)] if values else []


def calibration(y: np.ndarray, p: np.ndarray) -> tuple[list[dict], float]:
    """Mean predicted vs observed in the 5 equal-width bins, and the calibration error (ECE)."""
    bins, ece = [], 0.0
    which = np.clip(np.digitize(p, BINS[1:-1]), 0, len(BINS) - 2)
    for b in range(len(BINS) - 1):
        mask = which == b
        n = int(mask.sum())
        row = {"bin": f"{BINS[b]:.1f}-{BINS[b + 1]:.1f}", "n": n}
        if n:
            row["predicted"], row["observed"] = round(float(p[mask].mean()), 4), round(float(y[mask].mean()), 4)
            ece += n / len(y) * abs(row["predicted"] - row["observed"])
        bins.append(row)
    return bins, round(ece, 4)


def summarize(tokens: list[dict], threshold: float) -> dict:
    y_cur = np.asarray([t["current"] for t in tokens], dtype=np.int64)
    y_cond = np.asarray([t["conditional"] for t in tokens], dtype=np.int64)  # -1: not judged
    stat = np.asarray([t["statistic"] for t in tokens])
    prob = np.asarray([t["probability"] for t in tokens])
    groups = np.asarray([t["prompt"] for t in tokens])
    judged = y_cond >= 0
    stop = np.asarray([t["stop"] for t in tokens], dtype=bool)
    go = ~stop
    true_go = int((go & (y_cur == 1)).sum())
    cal_cum, ece_cum = calibration(y_cur, stat)
    cal_cond, ece_cond = calibration(y_cond[judged], prob[judged])
    token_prob = np.asarray([t["token_prob"] for t in tokens])
    top1 = np.asarray([t["top1"] for t in tokens], dtype=bool)
    # Blocks: accepted tokens vs what the tuned threshold would have drafted (up to its first stop).
    blocks: dict[tuple, list[dict]] = {}
    for t in tokens:
        blocks.setdefault((t["prompt"], t["block"]), []).append(t)
    would_draft = [next((i + 1 for i, t in enumerate(b) if t["stop"]), len(b)) for b in blocks.values()]
    accepted = [sum(t["current"] for t in b) for b in blocks.values()]
    return {
        "tokens": len(tokens), "blocks": len(blocks), "prompts": int(len(np.unique(groups))),
        "acceptance": round(float(y_cur.mean()), 4),  # accepted / drafted, as the request stats count it
        "conditional_acceptance": round(float(y_cond[judged].mean()), 4), "judged_tokens": int(judged.sum()),
        "auc_cumulative_vs_current": round(auc(y_cur, stat), 4),
        "auc_cumulative_vs_current_90ci": bootstrap_auc(y_cur, stat, groups),
        "auc_probability_vs_conditional": round(auc(y_cond, prob), 4),
        "auc_probability_vs_conditional_90ci": bootstrap_auc(y_cond[judged], prob[judged], groups[judged]),
        "mean_predicted_cumulative": round(float(stat.mean()), 4),
        "mean_predicted_conditional": round(float(prob[judged].mean()), 4),
        "calibration_cumulative_vs_current": cal_cum, "ece_cumulative": ece_cum,
        "calibration_probability_vs_conditional": cal_cond, "ece_conditional": ece_cond,
        "threshold": threshold,
        "stop_fraction": round(float(stop.mean()), 4),
        "continue_precision": round(true_go / max(int(go.sum()), 1), 4),
        "continue_recall": round(true_go / max(int((y_cur == 1).sum()), 1), 4),
        "mean_accepted_per_block": round(float(np.mean(accepted)), 4),
        "mean_tuned_block": round(float(np.mean(would_draft)), 4),
        # Diagnostics, not features of the shipped classifier: the drafted token's own draft
        # probability (T=1) and whether it is the draft's argmax (always, greedy).
        "auc_token_prob_vs_conditional": round(auc(y_cond, token_prob), 4),
        "drafted_not_argmax": round(float((~top1).mean()), 4),
        "conditional_acceptance_argmax": (round(float(y_cond[judged & top1].mean()), 4)
                                          if (judged & top1).any() else None),
        "conditional_acceptance_not_argmax": (round(float(y_cond[judged & ~top1].mean()), 4)
                                              if (judged & ~top1).any() else None),
    }


# --- the run ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="humaneval:test")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument("--policy", default="static:6", help="the fixed block every request drafts")
    parser.add_argument("--artifacts", default="default",
                        help="comma-separated DISCO artifacts (names or .disco paths) judged on the same tokens")
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    home = disco_home()
    pair = PairConfig(target=ModelConfig(dtype=choose_engine("auto", None, "target", "cpu", home)),
                      draft=ModelConfig(dtype=choose_engine("auto", None, "draft", "cpu", home)))
    pipeline = build_local_pipeline(pair, home)
    generator, tokenizer = pipeline.generator, pipeline.tokenizer
    # Each artifact through the loader the draft engine uses (it refuses one trained for another draft).
    loader = default_learned_loader(pipeline.draft)
    factories = {name: loader(name) for name in args.artifacts.split(",")}
    artifacts = {name: factory().artifact for name, factory in factories.items()}
    blocks: dict[str, list[Block]] = {name: [] for name in factories}
    generator.drafter.policy_factory = ObservingFactory(generator.drafter.policy_factory, args.policy,
                                                        factories, blocks)
    verifier = generator.verifier = RecordingVerifier(generator.verifier)
    prompts = [item.encode(tokenizer) for item in load_dataset(args.dataset, args.limit).items]
    temperatures = [float(value) for value in args.temperatures.split(",")]
    for name, artifact in artifacts.items():
        print(f"artifact {name}: {artifact.path} ({artifact.classifier.kind}, groups {artifact.spec.groups}, "
              f"label {artifact.label}, rule {artifact.rule}, threshold {artifact.threshold})")
    print(f"loaded in {time.perf_counter() - started:.0f} s: engines {pair.engine}; {len(temperatures)} "
          f"temperatures x {len(prompts)} prompts x {args.max_new_tokens} tokens, {args.policy}", flush=True)
    generator.generate(prompts[0], SamplingParams(max_new_tokens=4), SpeculationConfig(policy="none"))  # warm-up
    tokens: dict[str, list[dict]] = {name: [] for name in factories}
    summary: dict[str, dict[str, dict]] = {name: {} for name in factories}
    runs, done = len(temperatures) * len(prompts), 0
    run_started = time.perf_counter()
    for temperature in temperatures:
        for index, ids in enumerate(prompts):
            for observed in blocks.values():
                observed.clear()
            verifier.verdicts.clear()
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=1.0,
                                    seed=index, ignore_eos=True)
            request_started = time.perf_counter()
            result = generator.generate(ids, params, SpeculationConfig(policy=args.policy))
            for name, observed in blocks.items():
                drafted = [b for b in observed if b.probability]
                if [len(b.probability) for b in drafted] != [k for k, _ in verifier.verdicts]:
                    sys.exit("observed blocks and verifications do not line up")
                for number, (block, (_, accepted)) in enumerate(zip(drafted, verifier.verdicts)):
                    for j in range(len(block.probability)):
                        tokens[name].append({
                            "temperature": temperature, "prompt": index, "block": number, "position": j,
                            "probability": round(block.probability[j], 5),
                            "statistic": round(block.statistic[j], 5), "stop": block.stop[j],
                            "token_prob": round(block.token_prob[j], 5), "top1": block.top1[j],
                            "current": int(j < accepted),
                            "conditional": 1 if j < accepted else 0 if j == accepted else -1})
            done += 1
            elapsed = time.perf_counter() - run_started
            stats = result.stats
            print(f"[{done}/{runs}] T={temperature} prompt {index}: {len(result.token_ids)} tokens, "
                  f"{stats.draft_tokens} drafted, acceptance {stats.accepted_tokens / max(stats.draft_tokens, 1):.3f}, "
                  f"{time.perf_counter() - request_started:.1f} s; elapsed {elapsed / 60:.1f} min, "
                  f"ETA {elapsed / done * (runs - done) / 60:.1f} min", flush=True)
        for name, artifact in artifacts.items():
            summary[name][str(temperature)] = summarize(
                [t for t in tokens[name] if t["temperature"] == temperature], artifact.threshold)
        write(args, pair, artifacts, summary, tokens, started)
    for name in artifacts:
        print(f"\n== artifact {name}")
        print_table(summary[name])
    print(f"wall {time.perf_counter() - started:.0f} s; wrote {args.json_out}")


def write(args, pair: PairConfig, artifacts: dict, summary: dict, tokens: dict, started: float) -> None:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[3]).stdout.strip()
    out = {"code": disco.__file__, "commit": commit, "date": time.strftime("%Y-%m-%d"), "engines": pair.engine,
           "machine": model, "platform": platform.platform(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "prompts": f"{args.dataset}[:{args.limit}]",
           "max_new_tokens": args.max_new_tokens, "policy": args.policy, "top_p": 1.0, "seeds": "prompt index",
           "artifacts": {name: {"path": str(a.path), "classifier": a.classifier.kind, "groups": list(a.spec.groups),
                                "label": a.label, "rule": a.rule, "threshold": a.threshold}
                         for name, a in artifacts.items()},
           "wall_s": round(time.perf_counter() - started, 1), "summary": summary, "tokens": tokens}
    with open(args.json_out, "w") as handle:
        json.dump(out, handle, indent=1)


def print_table(summary: dict) -> None:
    rows = [
        ("tokens (blocks)", lambda s: f"{s['tokens']} ({s['blocks']})"),
        ("acceptance (current)", lambda s: f"{s['acceptance']:.3f}"),
        ("acceptance (conditional)", lambda s: f"{s['conditional_acceptance']:.3f}"),
        ("AUC C_j vs current [90% CI]",
         lambda s: f"{s['auc_cumulative_vs_current']:.3f} {s['auc_cumulative_vs_current_90ci']}"),
        ("AUC p_j vs conditional [90% CI]",
         lambda s: f"{s['auc_probability_vs_conditional']:.3f} {s['auc_probability_vs_conditional_90ci']}"),
        ("mean C_j / observed current", lambda s: f"{s['mean_predicted_cumulative']:.3f} / {s['acceptance']:.3f}"),
        ("mean p_j / observed conditional",
         lambda s: f"{s['mean_predicted_conditional']:.3f} / {s['conditional_acceptance']:.3f}"),
        ("ECE C_j / p_j", lambda s: f"{s['ece_cumulative']:.3f} / {s['ece_conditional']:.3f}"),
        ("tuned threshold: stop fraction", lambda s: f"{s['stop_fraction']:.3f}"),
        ("continue precision / recall", lambda s: f"{s['continue_precision']:.3f} / {s['continue_recall']:.3f}"),
        ("block: accepted / tuned would draft",
         lambda s: f"{s['mean_accepted_per_block']:.2f} / {s['mean_tuned_block']:.2f}"),
        ("drafted token not draft argmax", lambda s: f"{s['drafted_not_argmax']:.3f}"),
        ("AUC draft token prob vs conditional", lambda s: f"{s['auc_token_prob_vs_conditional']:.3f}"),
    ]
    temps = list(summary)
    width = max(len(name) for name, _ in rows)
    print(f"{'T':<{width}}  " + "  ".join(f"{t:>26}" for t in temps))
    for name, cell in rows:
        print(f"{name:<{width}}  " + "  ".join(f"{cell(summary[t]):>26}" for t in temps))
    for label, key in (("C_j vs current", "calibration_cumulative_vs_current"),
                       ("p_j vs conditional", "calibration_probability_vs_conditional")):
        print(f"calibration {label} (bin: n, predicted -> observed)")
        for t in temps:
            cells = [f"{b['bin']}: {b['n']}" + (f", {b['predicted']:.2f}->{b['observed']:.2f}" if b["n"] else "")
                     for b in summary[t][key]]
            print(f"  T={t}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
