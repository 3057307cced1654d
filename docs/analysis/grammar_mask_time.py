"""Grammar-engine mask time per token on the real pair's tokenizer: llguidance vs xgrammar.

Structured outputs (JSON schema / json_object / regex / choice / grammar) need a grammar
engine that, before every sampled token, computes the set of allowed next tokens as a
bitmask over the vocabulary (151,936 model rows for Qwen2.5-Coder: 151,665 real tokenizer
entries, which the GGUF-converted tokenizer pads with 271 "[PADn]" fillers). This script measures, for each engine, on the default pair's tokenizer:

* one-off cost: building the engine's tokenizer info from the HF tokenizer;
* per request: grammar compile time (schema -> matcher ready), and the first mask;
* per token: the time to fill the next-token bitmask while walking a fixed valid answer
  (tokenized with the real tokenizer, ending with EOS), consuming each token after its
  mask; median and p90 in microseconds (plus the time to consume a token);
* a speculative step: k + 1 masks along k draft tokens (mask, consume, mask, ... mask),
  then a rollback of k tokens, for k = 4 and 8 (a Python loop over each engine's API;
  the engines' own batched draft calls are reported next to it);
* turning a bitmask into a torch bool mask and applying it to a [vocab] float32 logits
  tensor (engine-independent: both engines fill the same int32 bitmask layout), at 1 and
  2 torch threads;
* untimed, that both engines allow the same tokens along the answer (where they differ,
  llguidance's mask is the tighter one: it drops non-canonical splits of forced text).

Each request (round) compiles the grammar afresh (xgrammar's compiler cache is off) and
walks it with fresh matchers, as a served request would. The engines alternate within
each round of each workload (the order flips every round), so that contention from other
processes hits both alike: on a shared machine the ratio is what counts.

Usage (the default pair's tokenizer from ``disco_home()``; xgrammar installed aside)::

    /work/main/.venv/bin/pip install --target /tmp/xgr_pkgs --no-deps xgrammar apache-tvm-ffi
    .venv/bin/python docs/analysis/grammar_mask_time.py --xgrammar-path /tmp/xgr_pkgs \\
        --rounds 10 --json-out docs/bench/structured/epyc_mask_time.json

Without xgrammar importable, only llguidance is measured (its column says so).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from disco.platform import tune_cpu_math_env  # noqa: E402

tune_cpu_math_env()  # before torch, as the CLI does

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

# ---------------------------------------------------------------------------- workloads

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

CHOICES = [
    "accept the pull request as it is",
    "request changes to the unit tests",
    "request changes to the documentation",
    "close it as a duplicate of an open issue",
    "escalate it to a maintainer for a second review",
]

ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""

ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""

ISO_DATETIME = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z"


def _choice_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices) + "\n"


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices) + "\n"


@dataclass(frozen=True)
class Workload:
    """One structured-output request kind, and a valid answer to walk."""

    name: str
    kind: str  # json_schema | regex | grammar
    spec: Any  # schema dict, regex string
    answer: str
    lark: str = ""  # kind == "grammar": llguidance's Lark source
    ebnf: str = ""  # kind == "grammar": xgrammar's EBNF source
    what: str = ""


WORKLOADS = [
    Workload("tool_call", "json_schema", TOOL_SCHEMA,
             '{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3}}',
             what="JSON schema of a tool call (enum, nested object, bounded integer)"),
    Workload("json_object", "json_schema", {"type": "object"},
             '{"id": 1842, "title": "Fix the tokenizer cache", "tags": ["bug", "tokenizer", "p1"], '
             '"assignee": {"login": "octocat", "admin": false}, "estimate": 2.5, "closed": null, '
             '"comments": [{"author": "alice", "body": "Reproduced on main."}, '
             '{"author": "bob", "body": "Fixed in #1843."}]}',
             what='any JSON object (json_object mode: schema {"type": "object"})'),
    Workload("regex_datetime", "regex", ISO_DATETIME, "2024-05-17T09:30:00Z",
             what=f"regex, ISO 8601 date-time: {ISO_DATETIME}"),
    Workload("choice5", "grammar", None, CHOICES[3], lark=_choice_lark(CHOICES),
             ebnf=_choice_ebnf(CHOICES), what="choice among 5 strings (an alternation grammar)"),
    Workload("arith_grammar", "grammar", None, "(12+34)*5-(678/(9+10))*11-2*(3+4*(5-6))",
             lark=ARITH_LARK, ebnf=ARITH_EBNF,
             what="context-free grammar of arithmetic expressions (Lark / EBNF)"),
]

# ------------------------------------------------------------------------------ engines


class Engine:
    """What the benchmark needs from a grammar engine."""

    name = ""
    version = ""
    info_s = 0.0  # tokenizer-info build time (one-off)
    thread_setting = ""

    def compile(self, workload: Workload) -> Any:
        """Schema -> a ready matcher (this is the timed per-request compile)."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher of a compiled grammar (for the speculative walks)."""
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int = 0) -> None:
        raise NotImplementedError

    def consume(self, matcher: Any, token: int) -> None:
        raise NotImplementedError

    def rollback(self, matcher: Any, count: int) -> None:
        raise NotImplementedError

    def native_draft(self, matcher: Any, drafts: list[int], bitmask: torch.Tensor) -> None:
        """The engine's own call filling k + 1 masks along ``drafts``, state left unchanged."""
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_ids: list[int], threads: int) -> None:
        import llguidance  # noqa: PLC0415
        import llguidance.hf  # noqa: PLC0415
        import llguidance.torch  # noqa: PLC0415

        self._llg = llguidance
        self.version = importlib.metadata.version("llguidance")
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_ids)
        self.info_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.thread_setting = (f"LLExecutor(num_threads={threads}) for the batched draft call; "
                               "masks on the caller's thread")
        self.mask_bytes = (n_vocab + 31) // 32 * 4

    def _grammar(self, workload: Workload) -> str:
        m = self._llg.LLMatcher
        if workload.kind == "json_schema":
            return m.grammar_from_json_schema(workload.spec)
        if workload.kind == "regex":
            return m.grammar_from_regex(workload.spec)
        return m.grammar_from_lark(workload.lark)

    def compile(self, workload: Workload) -> Any:
        grammar = self._grammar(workload)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {workload.name}: {matcher.get_error()}")
        return grammar, matcher

    def matcher(self, compiled: Any) -> Any:
        return self._llg.LLMatcher(self.tokenizer, compiled[0], log_level=0)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int = 0) -> None:
        # what llguidance.torch.fill_next_token_bitmask does, without its per-call asserts
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * self.mask_bytes, self.mask_bytes)

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance rejected token {token}: {matcher.get_error()}")

    def rollback(self, matcher: Any, count: int) -> None:
        if not matcher.rollback(count):
            raise RuntimeError(f"llguidance could not roll back {count}: {matcher.get_error()}")

    def native_draft(self, matcher: Any, drafts: list[int], bitmask: torch.Tensor) -> None:
        self._llg.torch.fill_next_token_bitmask_par_with_draft_tokens(
            self.executor, [(matcher, 0, drafts)], bitmask)


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_ids: list[int], threads: int) -> None:
        import xgrammar  # noqa: PLC0415

        self._xgr = xgrammar
        try:
            self.version = importlib.metadata.version("xgrammar")
        except importlib.metadata.PackageNotFoundError:
            self.version = getattr(xgrammar, "__version__", "?")
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=n_vocab, stop_token_ids=eos_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.info_s = time.perf_counter() - started
        self.thread_setting = f"GrammarCompiler(max_threads={threads}, cache_enabled=False)"

    def compile(self, workload: Workload) -> Any:
        c = self.compiler
        if workload.kind == "json_schema":
            compiled = c.compile_json_schema(workload.spec)  # any_whitespace=True, strict_mode=True
        elif workload.kind == "regex":
            compiled = c.compile_regex(workload.spec)
        else:
            compiled = c.compile_grammar(workload.ebnf)
        return compiled, self._xgr.GrammarMatcher(compiled)

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled[0])

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token}")

    def rollback(self, matcher: Any, count: int) -> None:
        matcher.rollback(count)

    def native_draft(self, matcher: Any, drafts: list[int], bitmask: torch.Tensor) -> None:
        # a chain "tree": node 0 is the current position, node i + 1 the i-th draft token
        nodes = len(drafts) + 1
        nxt = torch.arange(1, nodes + 1, dtype=torch.int64)
        nxt[-1] = -1
        sibling = torch.full((nodes,), -1, dtype=torch.int64)
        tokens = torch.tensor([0, *drafts], dtype=torch.int64)
        matcher.traverse_draft_tree(nxt, sibling, tokens, bitmask)


# ------------------------------------------------------------------------------ timing


def _us(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"n": 0}
    a = np.asarray(seconds) * 1e6
    return {"n": int(a.size), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "mean": float(a.mean()), "max": float(a.max())}


def _ms(seconds: list[float]) -> dict[str, float]:
    a = np.asarray(seconds) * 1e3
    return {"n": int(a.size), "median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def _walk(engine: Engine, matcher: Any, tokens: list[int], bitmask: torch.Tensor,
          masks: list[float], consumes: list[float]) -> None:
    clock = time.perf_counter
    for token in tokens:
        started = clock()
        engine.fill(matcher, bitmask)
        masked = clock()
        engine.consume(matcher, token)
        consumes.append(clock() - masked)
        masks.append(masked - started)
        if not bitmask[0, token >> 5].item() >> (token & 31) & 1:
            raise RuntimeError(f"{engine.name}: the mask forbids the answer's token {token}")


def _spec_walk(engine: Engine, matcher: Any, tokens: list[int], k: int, bitmask: torch.Tensor,
               steps: list[float]) -> None:
    """At every position with k draft tokens left: k + 1 masks along them, roll back k, accept 1.

    NOTE: ``tokens`` excludes the final EOS. llguidance 1.9.1 does not record an EOS consumed
    by a matcher that the grammar already stopped (stop reason NoExtension, e.g. after the
    closing brace of a schema'd object), so a later ``rollback(k)`` over it undoes one real
    token too many; xgrammar counts it. An integration must roll back only what the matcher
    recorded (or not feed EOS to a stopped matcher).
    """
    clock = time.perf_counter
    for position in range(len(tokens) - k + 1):
        drafts = tokens[position:position + k]
        started = clock()
        for row, token in enumerate(drafts):
            engine.fill(matcher, bitmask, row)
            engine.consume(matcher, token)
        engine.fill(matcher, bitmask, k)
        engine.rollback(matcher, k)
        steps.append(clock() - started)
        engine.consume(matcher, tokens[position])


def _native_walk(engine: Engine, matcher: Any, tokens: list[int], k: int, bitmask: torch.Tensor,
                 steps: list[float]) -> None:
    clock = time.perf_counter
    rows = bitmask[:k + 1]  # xgrammar wants exactly one row per node
    for position in range(len(tokens) - k + 1):
        drafts = tokens[position:position + k]
        started = clock()
        engine.native_draft(matcher, drafts, rows)
        steps.append(clock() - started)
        engine.consume(matcher, tokens[position])


def _check_native(engine: Engine, compiled: Any, tokens: list[int], k: int) -> str:
    """Compare the native draft call's k + 1 masks with the loop's on the first position."""
    k = min(k, len(tokens) - 1)
    loop = torch.zeros((k + 1, BITMASK_WORDS), dtype=torch.int32)
    native = torch.zeros((k + 1, BITMASK_WORDS), dtype=torch.int32)
    m = engine.matcher(compiled)
    for row, token in enumerate(tokens[:k]):
        engine.fill(m, loop, row)
        engine.consume(m, token)
    engine.fill(m, loop, k)
    m = engine.matcher(compiled)
    engine.native_draft(m, tokens[:k], native)
    engine.consume(m, tokens[0])  # state unchanged by the call
    return "same" if torch.equal(loop, native) else "DIFFERENT"


BITMASK_WORDS = 0  # set in main from the vocabulary size
FILLER_IDS: list[int] = []  # "[PADn]" entries of the converted tokenizer, set in main


def _walk_masks(engine: Engine, workload: Workload, tokens: list[int]) -> torch.Tensor:
    """Every mask along the answer, one row per position (untimed)."""
    masks = torch.zeros((len(tokens), BITMASK_WORDS), dtype=torch.int32)
    matcher = engine.compile(workload)[1]
    for row, token in enumerate(tokens):
        engine.fill(matcher, masks, row)
        engine.consume(matcher, token)
    return masks


def _allowed(masks: torch.Tensor) -> np.ndarray:
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
    return bits[:, :BITMASK_WORDS * 32]


def mask_agreement(engines: list[Engine], workload: Workload, tokens: list[int]) -> dict[str, Any]:
    """Do the engines allow the same tokens along the answer? (Checks the comparison is fair.)"""
    allowed = {e.name: _allowed(_walk_masks(e, workload, tokens)) for e in engines}
    out: dict[str, Any] = {e: {"allowed_tokens_median": float(np.median(a.sum(axis=1))),
                               "positions_allowing_pad_fillers": int(a[:, FILLER_IDS].any(axis=1).sum())
                               if FILLER_IDS else 0}
                           for e, a in allowed.items()}
    if len(allowed) == 2:
        a, b = allowed.values()
        differ = (a != b).sum(axis=1)
        out["positions"] = len(tokens)
        out["positions_identical"] = int((differ == 0).sum())
        out["differing_tokens_max"] = int(differ.max())
    return out



def bench_workload(engines: list[Engine], workload: Workload, tokens: list[int], rounds: int,
                   ks: list[int], progress: tqdm) -> dict[str, Any]:
    clock = time.perf_counter
    rows = max(ks) + 1
    out: dict[str, Any] = {}
    samples = {e.name: {"compile": [], "first_mask": [], "mask": [], "consume": [],
                        **{f"spec_k{k}": [] for k in ks}, **{f"native_k{k}": [] for k in ks}}
               for e in engines}
    bitmasks = {e.name: torch.full((rows, BITMASK_WORDS), -1, dtype=torch.int32) for e in engines}
    compiled_of = {}
    for round_ in range(rounds):
        order = engines if round_ % 2 == 0 else engines[::-1]
        for engine in order:
            s, bitmask = samples[engine.name], bitmasks[engine.name]
            progress.set_postfix_str(f"{workload.name} / {engine.name} / round {round_ + 1}")
            started = clock()
            compiled = engine.compile(workload)
            ready = clock()
            engine.fill(compiled[1], bitmask)
            s["compile"].append(ready - started)
            s["first_mask"].append(clock() - ready)
            compiled_of[engine.name] = compiled
            _walk(engine, engine.matcher(compiled), tokens, bitmask, s["mask"], s["consume"])
            for k in ks:  # drafts never include the EOS (see _spec_walk)
                _spec_walk(engine, engine.matcher(compiled), tokens[:-1], k, bitmask, s[f"spec_k{k}"])
                _native_walk(engine, engine.matcher(compiled), tokens[:-1], k, bitmask, s[f"native_k{k}"])
            progress.update(1)
    for engine in engines:
        s = samples[engine.name]
        out[engine.name] = {
            "compile_ms": _ms(s["compile"]),
            "first_mask_us": _us(s["first_mask"]),
            "mask_us": _us(s["mask"]),
            "consume_us": _us(s["consume"]),
            **{f"spec_k{k}_us": _us(s[f"spec_k{k}"]) for k in ks},
            **{f"native_draft_k{k}_us": _us(s[f"native_k{k}"]) for k in ks},
            "native_draft_matches_loop": _check_native(engine, compiled_of[engine.name], tokens[:-1], max(ks)),
        }
    return out


def bench_apply(vocab: int, rounds: int, with_xgrammar: bool, sample_mask: torch.Tensor,
                threads_list: list[int]) -> dict[str, Any]:
    """Bitmask -> torch bool mask -> masked logits, for one [vocab] float32 row.

    Engine-independent: both engines fill the same int32 bitmask (bit j of word i allows
    token 32 i + j). Timed at each torch thread count of ``threads_list``.
    """
    base = torch.randn(vocab)
    logits = base.clone()
    shifts = torch.arange(32, dtype=torch.int32)
    bitmask = sample_mask[:1].clone()

    def torch_to_bool() -> torch.Tensor:
        return ((bitmask.view(-1, 1) >> shifts) & 1).view(-1)[:vocab].bool()

    def numpy_to_bool() -> torch.Tensor:  # zero-copy: unpackbits' 0/1 bytes viewed as bool
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab]
        return torch.from_numpy(bits.view(np.bool_))

    forbidden = ~numpy_to_bool()

    def apply_with(to_bool: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            logits.masked_fill_(~to_bool(), float("-inf"))
        return run

    methods: dict[str, Callable[[], Any]] = {
        "torch_shift_to_bool": torch_to_bool,
        "numpy_unpackbits_to_bool": numpy_to_bool,
        "masked_fill_only": lambda: logits.masked_fill_(forbidden, float("-inf")),
        "torch_shift_apply": apply_with(torch_to_bool),
        "numpy_unpackbits_apply": apply_with(numpy_to_bool),
    }
    if with_xgrammar:
        import xgrammar  # noqa: PLC0415

        methods["xgrammar_cpu_kernel_apply"] = lambda: xgrammar.apply_token_bitmask_inplace(
            logits, bitmask, backend="cpu")
    expected = None
    for name, method in methods.items():  # the same result from every applying method
        logits.copy_(base)
        method()
        if name.endswith("_apply") or name == "masked_fill_only":
            finite = torch.isfinite(logits)
            expected = finite if expected is None else expected
            if not torch.equal(expected, finite):
                raise RuntimeError(f"{name} masks differently")
    out: dict[str, Any] = {"allowed_tokens": int(expected.sum()), "by_threads": {}}
    clock = time.perf_counter
    saved = torch.get_num_threads()
    for threads in threads_list:
        torch.set_num_threads(threads)
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(rounds):
            for name, method in methods.items():
                logits.copy_(base)
                started = clock()
                method()
                samples[name].append(clock() - started)
        out["by_threads"][str(threads)] = {name: _us(v) for name, v in samples.items()}
    torch.set_num_threads(saved)
    return out


# -------------------------------------------------------------------------------- main


def _tokenizer_folder(spec: str | None) -> Path:
    if spec:
        return Path(spec).expanduser()
    from disco.models.default_pair import default_folder, default_model  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415

    return default_folder(default_model("target"), disco_home())


def _machine(threads: int) -> dict[str, Any]:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu": model, "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": threads, "commit": commit, "loadavg_at_start": list(os.getloadavg()),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _fmt(d: dict, key: str = "median") -> str:
    return f"{d[key]:.1f}" if d.get("n") else "-"


def print_table(result: dict[str, Any], engine_names: list[str]) -> None:
    ks = result["ks"]
    print()
    print("tokenizer info build (one-off): " + ", ".join(
        f"{n} {result['engines'][n]['tokenizer_info_s']:.2f} s" if "tokenizer_info_s" in result["engines"][n]
        else f"{n} {result['engines'][n]['status']}" for n in engine_names))
    header = (f"{'workload':<15}{'engine':<11}{'tok':>4}{'compile ms':>11}{'1st mask us':>12}"
              f"{'mask med':>9}{'mask p90':>9}{'consume':>8}"
              + "".join(f"{f'spec k={k} med/p90':>19}" for k in ks)
              + "".join(f"{f'native k={k}':>11}" for k in ks))
    print(header)
    print("-" * len(header))
    for wname, wres in result["workloads"].items():
        for name in engine_names:
            r = wres["engines"].get(name)
            if r is None:
                print(f"{wname:<15}{name:<11}  {result['engines'][name]['status']}")
                continue
            print(f"{wname:<15}{name:<11}{wres['tokens']:>4}{r['compile_ms']['median']:>11.2f}"
                  f"{_fmt(r['first_mask_us']):>12}{_fmt(r['mask_us']):>9}{_fmt(r['mask_us'], 'p90'):>9}"
                  f"{_fmt(r['consume_us']):>8}"
                  + "".join(f"{_fmt(r[f'spec_k{k}_us']) + ' / ' + _fmt(r[f'spec_k{k}_us'], 'p90'):>19}"
                            for k in ks)
                  + "".join(f"{_fmt(r[f'native_draft_k{k}_us']):>11}" for k in ks))
    ratio_rows = [(w, r["engines"]) for w, r in result["workloads"].items()]
    if len(engine_names) == 2 and all(len(e) == 2 for _, e in ratio_rows):
        a, b = engine_names
        print(f"\nratio {b}/{a} (median; >1 means {a} is faster):")
        for wname, e in ratio_rows:
            print(f"  {wname:<15} compile {e[b]['compile_ms']['median'] / e[a]['compile_ms']['median']:7.2f}x"
                  f"   mask {e[b]['mask_us']['median'] / e[a]['mask_us']['median']:6.2f}x"
                  + "".join(f"   spec k={k} {e[b][f'spec_k{k}_us']['median'] / e[a][f'spec_k{k}_us']['median']:6.2f}x"
                            for k in ks if e[a][f'spec_k{k}_us'].get('n')))
    print("\nmask agreement along the answer (untimed walk):")
    for wname, wres in result["workloads"].items():
        ag = wres["mask_agreement"]
        line = "  ".join(f"{n}: {ag[n]['allowed_tokens_median']:.0f} allowed (median)" for n in engine_names if n in ag)
        if "positions" in ag:
            line += f"  | identical at {ag['positions_identical']}/{ag['positions']} positions"
        print(f"  {wname:<15} {line}")
    app = result["apply"]
    print(f"\nbitmask -> bool mask / masked logits, one [{result['vocab_rows']}] float32 row "
          f"({app['allowed_tokens']} tokens allowed), us median / p90:")
    threads = list(app["by_threads"])
    print(f"  {'method':<28}" + "".join(f"{f'torch threads {t}':>24}" for t in threads))
    for name in app["by_threads"][threads[0]]:
        print(f"  {name:<28}" + "".join(
            f"{app['by_threads'][t][name]['median']:>12.1f} / {app['by_threads'][t][name]['p90']:>9.1f}"
            for t in threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="HF tokenizer folder (default: the default pair's target "
                        "under disco_home(), i.e. $DISCO_HOME or ~/.cache/disco)")
    parser.add_argument("--vocab-rows", type=int, default=0,
                        help="bitmask width: the model's vocabulary rows (default: config.json's vocab_size)")
    parser.add_argument("--rounds", type=int, default=5, help="requests (compile + walks) per engine and workload")
    parser.add_argument("--apply-rounds", type=int, default=300, help="timings per bitmask->logits method")
    parser.add_argument("--apply-threads", default="1,2",
                        help="torch thread counts for the bitmask->logits timings")
    parser.add_argument("--ks", default="4,8", help="draft lengths of the speculative step")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads, xgrammar compiler threads, llguidance executor threads")
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                        help="comma-separated subset of: " + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--xgrammar-path", help="folder to put first on sys.path to import xgrammar "
                        "(e.g. a `pip install --target` folder); default: the environment")
    parser.add_argument("--no-xgrammar", action="store_true", help="measure llguidance only")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    parser.add_argument("--json-out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    global BITMASK_WORDS  # noqa: PLW0603
    torch.set_num_threads(args.threads)
    ks = [int(v) for v in args.ks.split(",")]
    wanted = args.workloads.split(",")
    workloads = [w for w in WORKLOADS if w.name in wanted]
    if args.xgrammar_path:
        sys.path.insert(0, str(Path(args.xgrammar_path).expanduser()))

    from transformers import AutoTokenizer  # noqa: PLC0415

    folder = _tokenizer_folder(args.tokenizer)
    print(f"tokenizer: {folder}", file=sys.stderr)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = args.vocab_rows
    if not vocab:
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    BITMASK_WORDS = (vocab + 31) // 32
    global FILLER_IDS  # noqa: PLW0603
    FILLER_IDS = [i for t, i in hf_tokenizer.get_vocab().items() if re.fullmatch(r"\[PAD\d+\]", t)]
    generation = json.loads((folder / "generation_config.json").read_text()) \
        if (folder / "generation_config.json").is_file() else {}
    eos_ids = generation.get("eos_token_id") or [hf_tokenizer.eos_token_id]
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]

    engines: list[Engine] = []
    engine_meta: dict[str, dict[str, Any]] = {}
    candidates: list[tuple[str, type[Engine]]] = [("llguidance", LLGuidance)]
    if not args.no_xgrammar:
        candidates.append(("xgrammar", XGrammar))
    else:
        engine_meta["xgrammar"] = {"status": "skipped (--no-xgrammar)"}
    for name, cls in tqdm(candidates, desc="tokenizer info", file=sys.stderr):
        try:
            engine = cls(hf_tokenizer, vocab, eos_ids, args.threads)
        except ImportError as error:
            engine_meta[name] = {"status": f"not installed ({error})"}
            continue
        engines.append(engine)
        engine_meta[name] = {"status": "measured", "version": engine.version,
                             "requires": _dist_requires(name),
                             "tokenizer_info_s": engine.info_s, "threads": engine.thread_setting}
    engine_names = [n for n, _ in candidates] + (["xgrammar"] if args.no_xgrammar else [])
    if "xgrammar" in engine_meta and engine_meta["xgrammar"]["status"] == "measured":
        engine_meta["xgrammar"]["triton_imported"] = "triton" in sys.modules
        engine_meta["xgrammar"]["tvm_ffi_version"] = _dist_version("apache-tvm-ffi")

    result: dict[str, Any] = {
        "what": "grammar engine mask time per token on the default pair's tokenizer",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(args.threads),
        "note": args.note,
        "tokenizer": str(folder),
        "tokenizer_entries": len(hf_tokenizer),
        "tokenizer_pad_fillers": {"count": len(FILLER_IDS), "first": min(FILLER_IDS, default=None),
                                  "note": "'[PADn]' entries that the GGUF conversion keeps as ordinary "
                                          "vocabulary tokens; both engines see them as literal text"},
        "vocab_rows": vocab,
        "eos_ids": eos_ids,
        "rounds": args.rounds,
        "ks": ks,
        "engines": engine_meta,
        "method": ("per round (request): compile (schema -> matcher ready, compiler cache off), then a "
                   "walk of the answer + EOS with a fresh matcher (mask then consume per token), then per k "
                   "a speculative walk with a fresh matcher (k+1 masks along k drafts, rollback k, accept 1) "
                   "and the engine's native batched draft call (llguidance "
                   "fill_next_token_bitmask_par_with_draft_tokens / xgrammar traverse_draft_tree on a chain); "
                   "engines alternate within each round, order flipped every round"),
        "workloads": {},
    }
    total = len(workloads) * args.rounds * len(engines)
    with tqdm(total=total, desc="requests", file=sys.stderr) as progress:
        for workload in workloads:
            tokens = hf_tokenizer.encode(workload.answer, add_special_tokens=False) + [eos_ids[0]]
            res = bench_workload(engines, workload, tokens, args.rounds, ks, progress)
            result["workloads"][workload.name] = {
                "what": workload.what, "answer": workload.answer, "tokens": len(tokens),
                "engines": res, "mask_agreement": mask_agreement(engines, workload, tokens),
            }
    # a mid-answer mask of the tool-call schema, for the apply timings
    sample = torch.full((1, BITMASK_WORDS), -1, dtype=torch.int32)
    first = engines[0]
    compiled = first.compile(WORKLOADS[0])
    m = first.matcher(compiled)
    for token in hf_tokenizer.encode('{"name": "get_weather", "arguments": {"city": "', add_special_tokens=False):
        first.consume(m, token)
    first.fill(m, sample)
    print("timing bitmask -> logits ...", file=sys.stderr)
    result["apply"] = bench_apply(vocab, args.apply_rounds, any(e.name == "xgrammar" for e in engines), sample,
                                  [int(v) for v in args.apply_threads.split(",")])

    result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    print_table(result, engine_names)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json_out}")


def _dist_requires(name: str) -> list[str]:
    try:
        return [r for r in importlib.metadata.requires(name) or [] if "extra ==" not in r]
    except importlib.metadata.PackageNotFoundError:
        return []


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
