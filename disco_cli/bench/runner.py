"""Running the benchmark matrix, interleaved per prompt so machine drift hits every row
alike, and folding the measurements into rows."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tqdm import tqdm

from disco.config import SamplingParams, SpeculationConfig
from disco_cli.bench.transports import Runner, RunOutcome

#: Transport names of runners whose draft engine pre-drafts (``disco bench --overlap on``).
OVERLAP_SUFFIX = "+overlap"

HF_PEER = "hf-assisted"


@dataclass(frozen=True)
class BenchConfig:
    policies: tuple[str, ...]
    sampling: SamplingParams
    max_lookahead: int = 20
    repeats: int = 1
    warmup: bool = True


@dataclass(frozen=True)
class Measurement:
    prompt_index: int
    repeat: int
    policy: str
    transport: str
    outcome: RunOutcome


@dataclass
class BenchRun:
    """Everything measured so far (also after an interruption)."""

    measurements: list[Measurement] = field(default_factory=list)
    interrupted: bool = False


def cells(config: BenchConfig, runners: dict[str, Runner], peer: Runner | None) -> list[tuple[str, str, Runner]]:
    """(policy, transport, runner) for every row, baseline ``none`` first per transport."""
    policies = ("none",) + tuple(p for p in config.policies if p != "none")
    matrix = [(policy, name, runner) for name, runner in runners.items() for policy in policies
              if not (policy == "oracle" and name != "local")]  # oracle: in-process analysis only
    if peer is not None:
        matrix.append((HF_PEER, peer.transport, peer))
    return matrix


def run_matrix(config: BenchConfig, prompts: Sequence[list[int]], runners: dict[str, Runner],
               peer: Runner | None = None, on_measurement: Callable[[Measurement], None] | None = None) -> BenchRun:
    """Prompt 1: every row; prompt 2: every row; …, after one warm-up call per row. The row
    order rotates per prompt so no row always runs first after a model switch."""
    matrix = cells(config, runners, peer)
    speculation = {policy: SpeculationConfig(policy=policy, max_lookahead=config.max_lookahead)
                   for policy, _, _ in matrix if policy != HF_PEER}
    run = BenchRun()
    if config.warmup:
        warm = SamplingParams(max_new_tokens=2, temperature=config.sampling.temperature, seed=config.sampling.seed)
        for policy, _, runner in tqdm(matrix, desc="warm-up", leave=False):
            runner.run(prompts[0], warm, speculation.get(policy, SpeculationConfig(policy="none")))
    total = config.repeats * len(prompts) * len(matrix)
    try:
        with tqdm(total=total, desc="bench", unit="run") as progress:
            for repeat in range(config.repeats):
                for index, prompt_ids in enumerate(prompts):
                    shift = index % len(matrix)
                    for policy, transport, runner in matrix[shift:] + matrix[:shift]:
                        progress.set_postfix_str(f"prompt {index + 1} {transport}/{policy}")
                        outcome = runner.run(prompt_ids, config.sampling,
                                             speculation.get(policy, SpeculationConfig(policy="none")))
                        measurement = Measurement(index, repeat, policy, transport, outcome)
                        run.measurements.append(measurement)
                        if on_measurement:
                            on_measurement(measurement)
                        progress.update()
    except KeyboardInterrupt:
        run.interrupted = True
    return run


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token, None if identical."""
    for index, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def target_only_texts(run: BenchRun, tokenizer, prompts: int) -> list[str | None]:
    """Our target-only (``none``) completion per prompt, first repeat, as text (``None``
    where it did not run): what the llama.cpp peer's target-only text is compared with."""
    texts: list[str | None] = [None] * prompts
    for m in run.measurements:
        if m.policy == "none" and m.repeat == 0 and texts[m.prompt_index] is None:
            texts[m.prompt_index] = tokenizer.decode(m.outcome.token_ids, skip_special_tokens=True)
    return texts


def summarize(run: BenchRun) -> list[dict]:
    """One row per (policy, transport), over the prompts completed in every repeat."""
    by_cell: dict[tuple[str, str], dict[tuple[int, int], RunOutcome]] = {}
    for m in run.measurements:
        by_cell.setdefault((m.policy, m.transport), {})[(m.repeat, m.prompt_index)] = m.outcome
    rows = []
    for (policy, transport), outcomes in by_cell.items():
        baseline_transport = transport if policy != HF_PEER else peer_baseline_transport(by_cell)
        baseline = by_cell.get(("none", baseline_transport), {})
        keys = sorted(set(outcomes) & set(baseline))
        if not keys:
            continue
        repeats = sorted({repeat for repeat, _ in keys})
        rates, speedups = [], []
        for repeat in repeats:
            rkeys = [k for k in keys if k[0] == repeat]
            tokens = sum(len(outcomes[k].token_ids) for k in rkeys)
            rate = tokens / sum(outcomes[k].wall_s for k in rkeys)
            base_rate = sum(len(baseline[k].token_ids) for k in rkeys) / sum(baseline[k].wall_s for k in rkeys)
            rates.append(rate)
            speedups.append(rate / base_rate)
        prompt_keys = [k for k in keys if k[0] == repeats[0]]
        divergences = [first_divergence(outcomes[k].token_ids, baseline[k].token_ids) for k in prompt_keys]
        diverged = [d for d in divergences if d is not None]
        stats = [outcomes[k].stats for k in prompt_keys if outcomes[k].stats]
        draft_tokens = sum(s["draft_tokens"] for s in stats)
        decode_rate = _decode_rate(stats)
        base_decode_rate = _decode_rate([baseline[k].stats for k in prompt_keys if baseline[k].stats])
        rows.append({
            "policy": policy, "transport": transport, "baseline_transport": baseline_transport,
            "prompts": len(prompt_keys), "repeats": len(repeats),
            "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates), "speedup": statistics.median(speedups),
            "speedup_min": min(speedups), "speedup_max": max(speedups),
            "identical": sum(d is None for d in divergences) / len(divergences),
            "mean_first_divergence": statistics.mean(diverged) if diverged else None,
            "acceptance_rate": (sum(s["accepted_tokens"] for s in stats) / draft_tokens) if draft_tokens else None,
            "mean_lookahead": (draft_tokens / sum(s["iterations"] for s in stats)) if stats else None,
            "target_forwards": statistics.mean(s["target_forwards"] for s in stats) if stats else None,
            "draft_forwards": statistics.mean(s["draft_forwards"] for s in stats) if stats else None,
            "generated_tokens": statistics.mean(len(outcomes[k].token_ids) for k in prompt_keys),
            # without the prompts' prefill (first repeat), as llama.cpp's decode rate
            "decode_tokens_per_s": decode_rate,
            "decode_speedup": decode_rate / base_decode_rate if decode_rate and base_decode_rate else None,
            "overlap": transport.endswith(OVERLAP_SUFFIX),
            "overlap_hit_rate": _overlap_hit_rate(stats),
            "predrafted_used": sum(s.get("predrafted_used", 0) for s in stats) / len(stats) if stats else None,
            "predrafted_wasted": sum(s.get("predrafted_wasted", 0) for s in stats) / len(stats) if stats else None,
            **_per_call_ms(stats),
        })
    return rows


def peer_baseline_transport(by_cell: dict[tuple[str, str], dict]) -> str:
    """The ``none`` row the HF peer (in process) is compared with: our in-process ``none``
    where it ran, else our ``none`` over the one transport that ran (``--transport grpc``:
    then the ratio includes our gRPC hops, and the row says so in ``baseline_transport``)."""
    transports = [transport for policy, transport in by_cell if policy == "none"]
    return "local" if "local" in transports or not transports else transports[0]


def _overlap_hit_rate(stats: Sequence[dict]) -> float | None:
    """Iterations whose pre-drafted tokens were used, over the iterations that drafted."""
    hits = sum(s.get("overlap_hits", 0) for s in stats)
    tried = hits + sum(s.get("overlap_misses", 0) for s in stats)
    return hits / tried if tried else None


def _per_call_ms(stats: Sequence[dict]) -> dict[str, float | None]:
    """Milliseconds per call, pooled over requests: a Verify call as the loop saw it, as the
    target reported it, and of that its forward; a Draft call as seen and as reported."""
    verifies = sum(s.get("target_forwards", 0) for s in stats)
    drafts = sum(s.get("draft_calls", 0) for s in stats)

    def per(key: str, calls: int) -> float | None:
        return 1000 * sum(s.get(key, 0.0) for s in stats) / calls if calls else None
    return {"verify_call_ms": per("verify_s", verifies), "verify_server_ms": per("backend_verify_s", verifies),
            "verify_forward_ms": per("verify_forward_s", verifies), "draft_call_ms": per("draft_s", drafts),
            "draft_server_ms": per("backend_draft_s", drafts)}


def _decode_rate(stats: Sequence[dict]) -> float | None:
    """Generated tokens per second of wall time after the prefill, pooled over requests."""
    decode_s = sum(s["wall_s"] - s["prefill_s"] for s in stats if "prefill_s" in s and "wall_s" in s)
    return sum(s["generated_tokens"] for s in stats) / decode_s if decode_s > 0 else None


def lookahead_traces(run: BenchRun, prompt_index: int = 0) -> dict[str, list[int]]:
    """Lookahead per iteration of one prompt (first repeat), per local-or-grpc policy row."""
    traces = {}
    for m in run.measurements:
        if m.prompt_index == prompt_index and m.repeat == 0 and m.outcome.stats and m.policy not in traces:
            traces[m.policy] = list(m.outcome.stats.get("lookaheads", []))
    return traces


def lookahead_histograms(run: BenchRun) -> dict[str, list[int]]:
    """All lookaheads per policy, pooled over prompts (first repeat, first transport seen)."""
    pooled: dict[str, list[int]] = {}
    transport_of: dict[str, str] = {}
    for m in run.measurements:
        if m.repeat != 0 or not m.outcome.stats or m.policy == "none":
            continue
        if transport_of.setdefault(m.policy, m.transport) == m.transport:
            pooled.setdefault(m.policy, []).extend(m.outcome.stats.get("lookaheads", []))
    return pooled
