"""The checks of ``disco doctor``: what a user runs on a new machine (docs/cli.md).

Every check returns a :class:`CheckResult` (never raises: an error becomes a failed check
with its message), so one broken engine does not hide what the others do. Per engine the
pair runs through the project's own in-process path (:func:`disco.engines.in_process.build_local_pipeline`:
:func:`~disco.models.loading.load_model`, the target and draft engines with their packed batchers,
the speculation loop), so the doctor checks what ``disco generate`` and the services run:

- ``load``: both models on the engine, and the batchers' packing verdicts;
- ``costs``: one-token draft forwards and target forwards over 1..k new tokens after a
  context (:func:`disco.engines.engine_costs.measure_forward_costs`, not cached: the machine now);
- ``roofline`` (CPU): those forwards against the machine's read bandwidth and int8 peak
  (:mod:`disco_cli.doctor_roofline`);
- ``greedy-alone``: speculative output equals target-only output, token for token;
- ``greedy-batched``: ``sessions`` concurrent requests (one packed forward per step where the
  batcher proves packing exact), target-only and speculative, equal each other and the
  requests run alone;
- ``sampled``: a seeded sampled request gives the same tokens alone, again, and among
  ``sessions - 1`` other sampled requests (under load).

Choices (measured on the tiny models and the default pair, docs/engines.md "Checking a new
machine"): a fixed policy (``static:4``: every block drafts 4 tokens, so verification
blocks of 5 rows are always exercised, whatever the acceptance) rather than ``auto``,
whose choice depends on the measured costs; ``ignore_eos`` so that every request
generates exactly ``max_new_tokens`` tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig
from disco.engines.device_clock import now
from disco.errors import first_line
from disco.speculation.loop import GenerationResult, SpeculativeGenerator

#: Code prompts, one per concurrent session (cycled when there are more sessions).
PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "# Read a CSV file and print the sum of the second column\n",
    "def is_prime(n: int) -> bool:",
    "for i in range(10):",
    "SELECT name, COUNT(*) FROM",
    "async def fetch(session, url):",
)


@dataclass(frozen=True)
class DoctorConfig:
    """What the doctor runs (the CLI's flags).

    Attributes:
        device: ``cpu`` or ``cuda[:N]``.
        engines: the engines to check (default: every engine the device supports).
        policy: the speculative policy compared with target-only.
        max_new_tokens: tokens per request.
        sessions: concurrent requests of the batched and the under-load checks.
        alone_prompts: prompts of the greedy-alone check.
        temperature, top_p, seed: the sampled request.
        cost_context, cost_tokens, cost_repeats: the cost measurement (context tokens, the
            target's forwards over 1..``cost_tokens`` new tokens, timings per point).
    """

    device: str = "cpu"
    engines: tuple[str, ...] = ()
    policy: str = "static:4"
    max_new_tokens: int = 16
    sessions: int = 8
    alone_prompts: int = 2
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 1234
    cost_context: int = 128
    cost_tokens: int = 5
    cost_repeats: int = 3


@dataclass
class CheckResult:
    """One line of the report: ``name`` (and ``engine``), ``ok``, a one-line ``detail``,
    the seconds it took, and its figures (``data``: JSON-ready)."""

    name: str
    ok: bool
    detail: str
    engine: str | None = None
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "engine": self.engine, "seconds": round(self.seconds, 3),
                "detail": self.detail, **self.data}


Progress = Callable[[str], None]


def run_check(name: str, engine: str | None, device: str, body: Callable[[], CheckResult]) -> CheckResult:
    """``body()`` timed, with any exception turned into a failed check that says what happened."""
    started = now(device)
    try:
        result = body()
    except Exception as error:  # noqa: BLE001 - the doctor reports every failure and goes on
        result = CheckResult(name, False, f"{type(error).__name__}: {first_line(error)}")
    result.name, result.engine, result.seconds = name, engine, now(device) - started
    return result


# -- one engine ------------------------------------------------------------------------------


def check_engine(config: DoctorConfig, engine: str, folders: dict[str, str | None], home: Path,
                 progress: Progress, peaks: Callable[[], object] | None = None) -> list[CheckResult]:
    """Every per-engine check of ``engine`` (module docstring); the models are freed afterwards.
    ``peaks``: the machine's (measured once per run, :mod:`disco_cli.doctor_roofline`), on a CPU."""
    from disco.engines.in_process import build_local_pipeline  # noqa: PLC0415 - heavy

    pair = PairConfig(target=ModelConfig(spec=folders["target"], dtype=engine, device=config.device),
                      draft=ModelConfig(spec=folders["draft"], dtype=engine, device=config.device))
    holder: dict = {}

    def load() -> CheckResult:
        pipeline = holder["pipeline"] = build_local_pipeline(pair, home, need_draft=True)
        target_batching = pipeline.generator.verifier.batcher.verdict.detail
        draft_batching = pipeline.generator.drafter.batcher.verdict.detail
        exactness = exactness_statement(pipeline.target.model)
        return CheckResult("", True, f"{pipeline.target.name} + {pipeline.draft.name}; target {target_batching}"
                           + (f"; {exactness}" if exactness else ""),
                           data={"target": pipeline.target.name, "draft": pipeline.draft.name,
                                 "target_batching": target_batching, "draft_batching": draft_batching,
                                 "target_exactness": exactness})

    progress(f"[{engine}] loading the target and the draft ...")
    results = [run_check("load", engine, config.device, load)]
    if not results[0].ok:
        return results
    pipeline = holder.pop("pipeline")
    try:
        progress(f"[{engine}] measuring forward costs ...")
        results.append(run_check("costs", engine, config.device,
                                 lambda: costs_check(config, pipeline.target.model, pipeline.draft.model)))
        if peaks is not None and results[-1].ok:
            progress(f"[{engine}] the forwards against this machine's roofline ...")
            costs = results[-1].data
            results.append(run_check("roofline", engine, config.device, lambda: _roofline(
                peaks(), pipeline.target.model, pipeline.draft.model, costs["target_forward_ms"],
                costs["draft_token_ms"])))
        prompts = [encode(pipeline.tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(config.sessions)]
        alone: dict[str, list[list[int]]] = {}
        progress(f"[{engine}] greedy, {config.alone_prompts} prompts alone: target-only and {config.policy} ...")
        results.append(run_check("greedy-alone", engine, config.device,
                                 lambda: greedy_alone_check(config, pipeline.generator, prompts, alone)))
        progress(f"[{engine}] greedy, {config.sessions} concurrent sessions: target-only and {config.policy} ...")
        results.append(run_check("greedy-batched", engine, config.device,
                                 lambda: greedy_batched_check(config, pipeline.generator, prompts, alone)))
        progress(f"[{engine}] a seeded sampled request alone, again, and among {config.sessions - 1} others ...")
        results.append(run_check("sampled", engine, config.device,
                                 lambda: sampled_check(config, pipeline.generator, prompts, alone)))
    finally:
        del pipeline
        free_memory(config.device)
    return results


def _roofline(*args) -> CheckResult:
    from disco_cli.doctor_roofline import roofline_report  # noqa: PLC0415 - measured only where asked

    detail, data = roofline_report(*args)
    return CheckResult("", True, detail, data=data)


def costs_check(config: DoctorConfig, target: torch.nn.Module, draft: torch.nn.Module) -> CheckResult:
    """Forward costs of both models as they run here, and whether speculation can pay with them."""
    from disco.engines.engine_costs import CONTENDED_SPREAD, CostRequest, measure_forward_costs  # noqa: PLC0415
    from disco.speculation.cost_model import CostModel  # noqa: PLC0415
    from disco.speculation.policies.auto import speculation_pays  # noqa: PLC0415

    request = CostRequest(max_new_tokens=config.cost_tokens, context_tokens=config.cost_context,
                          repeats=config.cost_repeats)
    target_request = request.fitted(_max_context(target))
    draft_request = dataclasses.replace(request, max_new_tokens=1).fitted(_max_context(draft))
    target_costs = measure_forward_costs(target, target_request, progress=False)
    draft_costs = measure_forward_costs(draft, draft_request, progress=False)
    seconds = [*target_costs.forward_s, *draft_costs.forward_s]
    ok = all(math.isfinite(s) and s > 0 for s in seconds)
    model = CostModel.from_forward_costs(draft_costs.forward_s, target_costs.forward_s, source="disco doctor")
    pays = speculation_pays(model, config.cost_tokens - 1)
    target_ms = [round(s * 1000, 3) for s in target_costs.forward_s]
    draft_ms = round(draft_costs.forward_s[0] * 1000, 3)
    spread = max(target_costs.spread, draft_costs.spread)
    # NOTE: repeats spread this much only when other processes share the cores (as for the
    # engines' cached costs, disco.engines.engine_costs): said, not failed (the machine works).
    contended = f" (contended: repeats spread {spread:.1f}x)" if spread >= CONTENDED_SPREAD else ""
    return CheckResult("", ok, f"target {'/'.join(f'{v:.1f}' for v in target_ms)} ms for 1..{len(target_ms)} "
                               f"tokens, draft {draft_ms:.1f} ms per token; speculation "
                               f"{'can' if pays else 'cannot'} pay{contended}",
                       data={"context_tokens": target_request.context_tokens, "target_forward_ms": target_ms,
                             "target_prefill_ms": round(target_costs.prefill_s * 1000, 3),
                             "draft_token_ms": draft_ms, "draft_prefill_ms": round(draft_costs.prefill_s * 1000, 3),
                             "spread": round(spread, 3), "contended": bool(contended),
                             "speculation_pays": pays, "repeats": request.repeats})


def greedy_alone_check(config: DoctorConfig, generator: SpeculativeGenerator, prompts: Sequence[list[int]],
                       alone: dict[str, list[list[int]]]) -> CheckResult:
    """Target-only and speculative greedy output of the first prompts, one request at a
    time; stores both in ``alone`` for :func:`greedy_batched_check`."""
    sampling = greedy(config)
    chosen = prompts[:config.alone_prompts]
    reference = [generator.generate(p, sampling, SpeculationConfig(policy="none")) for p in chosen]
    speculative = [generator.generate(p, sampling, SpeculationConfig(policy=config.policy)) for p in chosen]
    alone["none"] = [r.token_ids for r in reference]
    alone["speculative"] = [r.token_ids for r in speculative]
    comparison = compare(alone["none"], alone["speculative"], config.max_new_tokens)
    drafted = sum(r.stats.draft_tokens for r in speculative)
    accepted = sum(r.stats.accepted_tokens for r in speculative)
    distinct = len({t for tokens in alone["none"] for t in tokens})
    ok = comparison["identical"] == len(chosen) and drafted > 0
    detail = (f"{comparison['identical']}/{len(chosen)} identical to target-only ({config.policy}, "
              f"acceptance {accepted}/{drafted}); {distinct} distinct tokens in the reference")
    return CheckResult("", ok, detail, data={
        **comparison, "policy": config.policy, "draft_tokens": drafted, "accepted_tokens": accepted,
        "distinct_reference_tokens": distinct,
        "target_only_tok_s": _tokens_per_s(reference, False),
        "speculative_tok_s": _tokens_per_s(speculative, False)})


def greedy_batched_check(config: DoctorConfig, generator: SpeculativeGenerator, prompts: Sequence[list[int]],
                         alone: dict[str, list[list[int]]]) -> CheckResult:
    """``sessions`` concurrent requests, target-only then speculative: equal to each other
    and to the same prompts run alone; where the target's batcher packs, at least one of its
    forwards must have held several sessions."""
    sampling = greedy(config)
    target_batcher = generator.verifier.batcher
    target_batcher.batch_sizes = []  # observability only: count this check's batches
    reference = generate_concurrently(generator, [(p, sampling, "none") for p in prompts])
    largest_none = max(target_batcher.batch_sizes, default=0)
    target_batcher.batch_sizes = []
    speculative = generate_concurrently(generator, [(p, sampling, config.policy) for p in prompts])
    largest = max(largest_none, max(target_batcher.batch_sizes, default=0))
    reference_ids = [r.token_ids for r in reference]
    speculative_ids = [r.token_ids for r in speculative]
    comparison = compare(reference_ids, speculative_ids, config.max_new_tokens)
    as_alone = sum(reference_ids[i] == ids for i, ids in enumerate(alone.get("none", [])))
    as_alone += sum(speculative_ids[i] == ids for i, ids in enumerate(alone.get("speculative", [])))
    alone_count = len(alone.get("none", [])) + len(alone.get("speculative", []))
    batched = largest >= 2 or not target_batcher.packed
    ok = comparison["identical"] == len(prompts) and as_alone == alone_count and batched
    detail = (f"{comparison['identical']}/{len(prompts)} identical to target-only under load, "
              f"{as_alone}/{alone_count} identical to alone; largest target batch {largest} sessions"
              + ("" if target_batcher.packed else " (not packed here: one forward per session)"))
    return CheckResult("", ok, detail, data={
        **comparison, "sessions": len(prompts), "identical_to_alone": as_alone, "alone_compared": alone_count,
        "largest_target_batch": largest, "target_packed": target_batcher.packed,
        "target_only_tok_s": _tokens_per_s(reference, True),
        "speculative_tok_s": _tokens_per_s(speculative, True)})


def sampled_check(config: DoctorConfig, generator: SpeculativeGenerator, prompts: Sequence[list[int]],
                  alone: dict[str, list[list[int]]]) -> CheckResult:
    """A seeded sampled speculative request: same tokens alone, again, and under load (with
    ``sessions - 1`` other sampled requests at once: the same prompt with another seed, then
    the other prompts). Reported, not required: that another seed and greedy decoding (the
    greedy-alone reference, in ``alone``) give other tokens, i.e. the request really samples."""
    sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              top_p=config.top_p, seed=config.seed, ignore_eos=True)
    speculation = SpeculationConfig(policy=config.policy)
    first = generator.generate(prompts[0], sampling, speculation)
    again = generator.generate(prompts[0], sampling, speculation)
    others = [prompts[0], *prompts[1:-1]] if len(prompts) > 1 else []
    jobs = [(prompts[0], sampling, config.policy)] + [
        (prompt, dataclasses.replace(sampling, seed=config.seed + 1 + i), config.policy)
        for i, prompt in enumerate(others)]
    loaded = generate_concurrently(generator, jobs)
    greedy_ids = alone["none"][0] if alone.get("none") else None
    repeat_same = again.token_ids == first.token_ids
    load_same = loaded[0].token_ids == first.token_ids
    other_seed_differs = len(loaded) > 1 and loaded[1].token_ids != first.token_ids
    greedy_differs = greedy_ids is not None and greedy_ids != first.token_ids
    ok = repeat_same and load_same and len(first.token_ids) == config.max_new_tokens
    detail = (f"seed {config.seed}: {'same' if repeat_same else 'OTHER'} tokens again, "
              f"{'same' if load_same else 'OTHER'} tokens among {len(jobs) - 1} other requests; "
              f"another seed {'differs' if other_seed_differs else 'gives the same tokens'}, "
              f"greedy {'differs' if greedy_differs else 'gives the same tokens'}")
    return CheckResult("", ok, detail, data={
        "seed": config.seed, "temperature": config.temperature, "top_p": config.top_p,
        "tokens": first.token_ids, "same_again": repeat_same, "same_under_load": load_same,
        "first_difference_under_load": first_difference(first.token_ids, loaded[0].token_ids),
        "other_seed_differs": other_seed_differs, "greedy_differs": greedy_differs})


# -- helpers ----------------------------------------------------------------------------------


def greedy(config: DoctorConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=config.max_new_tokens, ignore_eos=True)


def encode(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def generate_concurrently(generator: SpeculativeGenerator,
                          jobs: Sequence[tuple[list[int], SamplingParams, str]]) -> list[GenerationResult]:
    """Each ``(prompt_ids, sampling, policy)`` generated by its own thread, all released at
    once (the engines' batchers then pack their forwards); raises the first error."""
    results: list[GenerationResult | None] = [None] * len(jobs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def worker(index: int) -> None:
        prompt_ids, sampling, policy = jobs[index]
        try:
            barrier.wait()
            results[index] = generator.generate(prompt_ids, sampling, SpeculationConfig(policy=policy))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,), name=f"doctor-session-{i}") for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [result for result in results if result is not None]


def compare(reference: Sequence[list[int]], candidate: Sequence[list[int]], expected_tokens: int) -> dict:
    """How many candidates equal their reference token for token (and are full length), and
    where the first that does not differs."""
    identical = sum(r == c and len(r) == expected_tokens for r, c in zip(reference, candidate))
    mismatches = [{"request": i, "position": first_difference(r, c)}
                  for i, (r, c) in enumerate(zip(reference, candidate)) if r != c]
    total = sum(len(r) for r in reference)
    same_tokens = sum(a == b for r, c in zip(reference, candidate) for a, b in zip(r, c))
    return {"identical": identical, "compared": len(reference), "first_mismatch": mismatches[0] if mismatches else None,
            "identical_token_rate": round(same_tokens / total, 4) if total else 1.0}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (``None`` when equal)."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def exactness_statement(model: torch.nn.Module) -> str | None:
    """What the engine states about greedy exactness on its device (a verified block proven
    bit for bit against decoding, or not: ``disco.engines.packing_proof.exactness_for``), where
    this version of the engines states it. Reported, not required: the greedy checks compare
    the tokens themselves."""
    try:
        from disco.engines.packing_proof import exactness_for  # noqa: PLC0415
    except ImportError:  # NOTE: engines from before issue 30's device exactness (item 3)
        return None
    return exactness_for(model).statement


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tokens_per_s(results: Sequence[GenerationResult], concurrent: bool) -> float:
    """Tokens per second of ``results``: their summed tokens over their summed wall times
    (one after another) or over the longest one (``concurrent``: they overlap)."""
    walls = [r.stats.wall_s for r in results]
    wall = max(walls, default=0.0) if concurrent else sum(walls)
    return round(sum(len(r.token_ids) for r in results) / wall, 3) if wall else 0.0


def _max_context(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))
