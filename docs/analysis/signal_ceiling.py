"""One-off analysis (docs/disco.md §9): is there acceptance signal beyond the draft's own
confidence? Grouped 5-fold CV (by prompt) of a logistic regression on teacher-forced
positions of the train + validation records, with and without

* context-match features (does the drafted token continue an n-gram, n = 1..4, seen
  earlier in the prompt + continuation; does a prompt-lookup 2-gram predict it), and
* the target's own signals (top-1, margin, entropy) at the previous position(s) — what the
  orchestrator could feed back to the drafter — and, as an unreachable ceiling, at the
  position itself.

Usage: python docs/analysis/signal_ceiling.py RECORDS_DIR TARGET_MODEL_DIR
(RECORDS_DIR = $DISCO_HOME/records/<pair key> of float32 records; the target forward takes
~8 s per prompt here.) Test-split records (HumanEval/n, n % 4 == 3) are skipped.
"""

from __future__ import annotations

import glob
import sys

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss, roc_auc_score
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from transformers import AutoModelForCausalLM


def target_signals(model, prompt: list[int], cont: list[int]) -> np.ndarray:  # [len(cont), 3]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + cont[:-1]])).logits[0, len(prompt) - 1:].float()
    log_probs = torch.log_softmax(logits, -1)
    probs = log_probs.exp()
    top2 = torch.topk(probs, 2).values
    entropy = -(probs * log_probs).nan_to_num().sum(-1)
    return np.stack([top2[:, 0].numpy(), (top2[:, 0] - top2[:, 1]).numpy(), entropy.numpy()], 1)


def context_matches(context: list[int], token: int) -> list[float]:
    found = []
    for n in (1, 2, 3, 4):
        pattern = context[-n:] + [token]
        found.append(float(any(context[i:i + len(pattern)] == pattern
                               for i in range(len(context) - len(pattern) + 1))))
    lookup = next((context[i + 2] for i in range(len(context) - 3, -1, -1) if context[i:i + 2] == context[-2:]), -1)
    return found + [float(lookup >= 0), float(lookup == token)]


def cv_scores(x: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> str:
    oof = np.zeros(len(labels))
    for train, test in GroupKFold(5).split(x, labels, groups):
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000)).fit(x[train], labels[train])
        oof[test] = model.predict_proba(x[test])[:, 1]
    return f"log-loss {log_loss(labels, oof):.4f}  AUC {roc_auc_score(labels, oof):.4f}"


def main(records_dir: str, target_dir: str) -> None:
    torch.set_num_threads(2)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft_rows, context_rows, previous_rows, current_rows, labels, groups = [], [], [], [], [], []
    for path in sorted(glob.glob(f"{records_dir}/*.npz")):
        record = np.load(path, allow_pickle=False)
        task = int(str(record["id"]).split("/")[1])
        if task % 4 == 3:
            continue
        prompt, cont = [int(t) for t in record["prompt_ids"]], [int(t) for t in record["continuation"]]
        signals = target_signals(target, prompt, cont)
        print(record["id"], flush=True)
        for t in range(1, len(cont)):
            probs = record["topk"][t]
            p1 = float(np.clip(probs[0], 1e-6, 1 - 1e-6))
            token = int(record["draft_tokens"][t])
            draft_rows.append([*probs, record["entropy"][t], probs[0] - probs[1], np.log(p1 / (1 - p1))])
            context_rows.append(context_matches(prompt + cont[:t], token))
            last3 = signals[max(0, t - 3):t]
            previous_rows.append([*signals[t - 1], *last3.mean(0)[[0, 2]], last3[:, 0].min()])
            current_rows.append(signals[t])
            labels.append(int(token == cont[t]))
            groups.append(task)
    draft, context, previous, current = map(np.asarray, (draft_rows, context_rows, previous_rows, current_rows))
    labels, groups = np.asarray(labels), np.asarray(groups)
    print(f"{len(labels)} positions, acceptance {labels.mean():.3f}")
    print("draft signals                 ", cv_scores(draft, labels, groups))
    print("+ context matches             ", cv_scores(np.hstack([draft, context]), labels, groups))
    print("+ target, previous positions  ", cv_scores(np.hstack([draft, previous]), labels, groups))
    print("+ target, same position (ceiling, not available live)",
          cv_scores(np.hstack([draft, current]), labels, groups))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
