"""Offline replay of any stop policy on oracle records.

:func:`replay_record` walks a record exactly as :class:`disco.speculation.loop.SpeculativeGenerator`
and :class:`disco.engines.draft.DraftEngine` would under greedy decoding:

1. ``lookahead_cap = min(max_lookahead, max_new_tokens - generated - 1)``; no draft
   call when it is 0 (or for ``none``);
2. the pending feedback of the previous block reaches ``policy.on_feedback`` first,
   then ``budget = min(cap, policy.begin_block(cap))`` and, per draft token, one draft
   forward, the token and its signals, ``policy.after_token`` (CONTINUE/STOP/DISCARD);
3. the target accepts the longest prefix equal to its own greedy continuation and adds
   the bonus token; EOS (unless ignored) and ``max_new_tokens`` end the request.

Token signals come from the record: teacher-forced ones up to a block's first rejected
token, the stored free-running branch after it (see :mod:`disco.offline.records`). A
token more than ``horizon`` steps past a rejection has no stored signals; replay then
uses the teacher-forced signals of the same position as a proxy and counts it in
``approx_tokens`` (0 means the replay is exact). Counts never depend on the proxy for
policies that read no signals (static, heuristic, none, oracle).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from disco.errors import InvalidRequest
from disco.offline.records import OracleRecord, RecordSet
from disco.speculation.cost_model import CostModel
from disco.speculation.policies import Decision, PolicyFactory, StopPolicy, block_budget, parse_policy_spec
from disco.speculation.policies.auto import as_served
from disco.speculation.policies.simple import OraclePolicy
from disco.speculation.signals import TokenSignals
from disco.stats import RequestStats

DEFAULT_REPLAY_LOOKAHEAD = 20  # the serving default (disco.config.DEFAULT_MAX_LOOKAHEAD)


class ReplayObserver(Protocol):
    """Sees every draft token with its ground truth (training data collection)."""

    def begin_block(self) -> None: ...

    def token(self, position: int, token_id: int, signals: TokenSignals, index: int, alive: bool,
              exact: bool) -> None:
        """``index``: continuation position; ``alive``: this token will be accepted."""

    def feedback(self, num_drafted: int, num_accepted: int) -> None: ...


@dataclass
class RecordReplay:
    """One record replayed under one policy."""

    stats: RequestStats
    blocks: list[tuple[int, int, int]] = field(default_factory=list)  # (draft forwards, drafted, accepted)
    approx_tokens: int = 0
    uses_draft: bool = True

    def seconds(self, cost: CostModel) -> float:
        return sum(cost.iteration(forwards, drafted, self.uses_draft) for forwards, drafted, _ in self.blocks)


def generated_length(record: OracleRecord, max_new_tokens: int, eos_token_ids: Sequence[int],
                     honor_eos: bool) -> int:
    """How many tokens the request produces (up to and including the first EOS)."""
    if honor_eos and eos_token_ids:
        hits = np.flatnonzero(np.isin(record.continuation[:max_new_tokens], list(eos_token_ids)))
        if hits.size:
            return int(hits[0]) + 1
    return max_new_tokens


def replay_record(record: OracleRecord, policy: StopPolicy, max_new_tokens: int, max_lookahead: int,
                  eos_token_ids: Sequence[int] = (), honor_eos: bool = True,
                  observer: ReplayObserver | None = None, with_hidden: bool = False) -> RecordReplay:
    """Replay ``policy`` (a fresh per-session object) on one record; see the module docstring."""
    cont = record.continuation
    if max_new_tokens > len(cont):
        raise InvalidRequest(f"records hold {len(cont)} tokens per prompt; cannot replay max_new_tokens="
                             f"{max_new_tokens}")
    end = generated_length(record, max_new_tokens, eos_token_ids, honor_eos)
    want_hidden = with_hidden or policy.needs_hidden
    result = RecordReplay(stats=RequestStats(prompt_tokens=len(record.prompt_ids)), uses_draft=policy.uses_draft)
    stats = result.stats
    generated, pending = 0, None
    while generated < end:
        # 1. Lookahead cap: never more than can still be used (remaining tokens - bonus).
        cap = min(max_lookahead, max_new_tokens - generated - 1)
        block: list[int] = []
        forwards = 0
        mismatch: int | None = None  # continuation index of the block's first rejected token
        if policy.uses_draft and cap > 0:
            # 2. Draft: feedback of the previous block, then the policy's budget.
            if pending is not None:
                policy.on_feedback(*pending)
                if observer is not None:
                    observer.feedback(*pending)
                pending = None
            budget = block_budget(policy, cap)
            if observer is not None:
                observer.begin_block()
            for position in range(budget):
                index = generated + position
                exact = True
                if mismatch is None:
                    token, signals = int(record.draft_tokens[index]), record.trunk_signals(index, want_hidden)
                else:
                    step = index - mismatch - 1
                    if step < record.branch_length(mismatch):
                        token, signals = record.branch_token(mismatch, step, want_hidden)
                    else:  # beyond the stored horizon: teacher-forced proxy
                        token, signals = int(record.draft_tokens[index]), record.trunk_signals(index, want_hidden)
                        exact = False
                        result.approx_tokens += 1
                forwards += 1
                decision = policy.after_token(position, token, signals if policy.needs_signals else None)
                if mismatch is None and token != int(cont[index]):
                    mismatch = index
                if observer is not None:
                    observer.token(position, token, signals, index, mismatch is None, exact)
                if decision is Decision.DISCARD:
                    if mismatch == index:
                        mismatch = None
                    break
                block.append(token)
                if decision is Decision.STOP:
                    break
        # 3. Verify: accepted prefix + bonus token.
        accepted = len(block) if mismatch is None else mismatch - generated
        stats.record_iteration(len(block), accepted)
        stats.draft_forwards += forwards
        result.blocks.append((forwards, len(block), accepted))
        pending = (len(block), accepted)
        generated = min(generated + accepted + 1, end)
    stats.generated_tokens = generated
    stats.finish_reason = "length" if end == max_new_tokens else "stop"
    return result


PolicyBuilder = Callable[[OracleRecord], StopPolicy]


def policy_builder(spec: str, factory: PolicyFactory | None = None, eos_token_ids: Sequence[int] = (),
                   honor_eos: bool = True, max_new_tokens: int | None = None) -> PolicyBuilder:
    """A per-record policy constructor for a spec (the oracle gets the record's reference)."""
    parse_policy_spec(spec)
    factory = factory or PolicyFactory(_learned_loader())

    def build(record: OracleRecord) -> StopPolicy:
        if parse_policy_spec(spec).name == "oracle":
            limit = max_new_tokens or len(record.continuation)
            end = generated_length(record, limit, eos_token_ids, honor_eos)
            return OraclePolicy([int(t) for t in record.continuation[:end]])
        return factory.build(spec)
    return build


def _learned_loader():
    try:
        from disco.speculation.policies.learned import load_learned_policy  # noqa: PLC0415
    except ImportError:
        return None
    return load_learned_policy


@dataclass
class PolicyReplay:
    """A policy replayed on a whole record set."""

    policy: str
    records: list[RecordReplay]

    def totals(self) -> dict:
        keys = ("generated_tokens", "iterations", "target_forwards", "draft_tokens", "draft_forwards",
                "accepted_tokens")
        total = {key: sum(getattr(r.stats, key) for r in self.records) for key in keys}
        total["approx_tokens"] = sum(r.approx_tokens for r in self.records)
        return total

    def seconds(self, cost: CostModel) -> float:
        return sum(r.seconds(cost) for r in self.records)


def replay_policy(records: RecordSet, build: PolicyBuilder | str, max_lookahead: int = DEFAULT_REPLAY_LOOKAHEAD,
                  honor_eos: bool = True, max_new_tokens: int | None = None, name: str | None = None,
                  observer_factory: Callable[[], ReplayObserver] | None = None,
                  with_hidden: bool = False) -> PolicyReplay:
    max_new_tokens = max_new_tokens or records.max_new_tokens
    if isinstance(build, str):
        name = name or build
        build = policy_builder(build, eos_token_ids=records.eos_token_ids, honor_eos=honor_eos,
                               max_new_tokens=max_new_tokens)
    results = [replay_record(record, _bound(build(record), record), max_new_tokens, max_lookahead, records.eos_token_ids,
                             honor_eos, observer_factory() if observer_factory else None, with_hidden)
               for record in records.records]
    return PolicyReplay(policy=name or "?", records=results)


def _bound(policy: StopPolicy, record: OracleRecord) -> StopPolicy:
    """The policy told the record's sampling temperature, as the draft engine tells it live."""
    policy.bind_sampling(record.temperature)
    return policy


def summarize(replayed: PolicyReplay, cost: CostModel, baseline_seconds: float) -> dict:
    total = replayed.totals()
    seconds = replayed.seconds(cost)
    lookaheads = [k for r in replayed.records for k in r.stats.lookaheads if k > 0]
    return {
        "policy": replayed.policy,
        "speedup": round(baseline_seconds / seconds, 4) if seconds > 0 else 0.0,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(total["generated_tokens"] / seconds, 4) if seconds > 0 else 0.0,
        "target_forwards": total["target_forwards"],
        "draft_tokens": total["draft_tokens"],
        "draft_forwards": total["draft_forwards"],
        "accepted_tokens": total["accepted_tokens"],
        "generated_tokens": total["generated_tokens"],
        "acceptance_rate": round(total["accepted_tokens"] / total["draft_tokens"], 4) if total["draft_tokens"] else 0.0,
        "mean_lookahead": round(sum(lookaheads) / len(lookaheads), 4) if lookaheads else 0.0,
        "tokens_per_target_forward": round(total["generated_tokens"] / max(total["target_forwards"], 1), 4),
        "approx_tokens": total["approx_tokens"],
    }


def target_only_seconds(records: RecordSet, cost: CostModel, honor_eos: bool = True,
                        max_new_tokens: int | None = None) -> float:
    max_new_tokens = max_new_tokens or records.max_new_tokens
    tokens = sum(generated_length(r, max_new_tokens, records.eos_token_ids, honor_eos) for r in records.records)
    return tokens * cost.target_only_token


def replay_report(records: RecordSet, policies: Iterable[str], cost: CostModel,
                  max_lookahead: int = DEFAULT_REPLAY_LOOKAHEAD, honor_eos: bool = True) -> dict:
    """The ``disco replay`` JSON: cost model, data description and one row per policy."""
    baseline = target_only_seconds(records, cost, honor_eos)
    rows = [summarize(replay_policy(records, as_served(spec, cost, max_lookahead), max_lookahead, honor_eos,
                                    name=spec), cost, baseline)
            for spec in policies]
    return {"cost_model": cost.to_json(),
            "records": {"dataset": records.meta.get("dataset"), "prompts": len(records.records),
                        "max_new_tokens": records.max_new_tokens, "horizon": records.horizon,
                        "target": records.meta.get("target"), "draft": records.meta.get("draft")},
            "max_lookahead": max_lookahead, "honor_eos": honor_eos,
            "target_only_seconds": round(baseline, 4), "rows": rows}


_RANGE = re.compile(r"^(static|heuristic):(\d+)-(\d+)$")
_FLOAT_RANGE = re.compile(r"^(confidence|adaptive-confidence|entropy):([\d.]+)-([\d.]+)/([\d.]+)$")


def expand_policies(text: str) -> list[str]:
    """``static:1-12`` → static:1 … static:12; ``confidence:0.1-0.9/0.1`` → a sweep."""
    specs: list[str] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if match := _RANGE.match(item):
            name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
            specs.extend(f"{name}:{k}" for k in range(low, high + 1))
        elif match := _FLOAT_RANGE.match(item):
            name, low, high, step = match.group(1), *(float(match.group(i)) for i in (2, 3, 4))
            if step <= 0:
                raise InvalidRequest(f"bad sweep {item!r}: step must be > 0")
            count = int(math.floor((high - low) / step + 1e-9)) + 1
            specs.extend(f"{name}:{round(low + i * step, 6):g}" for i in range(count))
        else:
            parse_policy_spec(item)
            specs.append(item)
    if not specs:
        raise InvalidRequest("--policies is empty")
    return specs


def format_report(report: dict) -> str:
    cost = report["cost_model"]
    data = report.get("records") or report["test"]
    lines = [f"cost model: t_draft {cost['t_draft'] * 1000:.1f} ms, t_verify(0/1/4/8) "
             f"{', '.join(f'{_verify(cost, k) * 1000:.0f}' for k in (0, 1, 4, 8))} ms, rtt {cost['t_rtt'] * 1000:.1f} ms"
             f"  [{cost.get('source', '')}]",
             f"records: {data['dataset']} ({data['prompts']} prompts, "
             f"{data['max_new_tokens']} tokens, horizon {data['horizon']}); "
             f"max lookahead {report['max_lookahead']}",
             f"{'policy':<34} {'speedup':>8} {'tgt fwd':>8} {'drafted':>8} {'accepted':>8} {'mean k':>7} {'approx':>7}"]
    for row in report["rows"]:
        lines.append(f"{row['policy']:<34} {row['speedup']:>7.3f}x {row['target_forwards']:>8} "
                     f"{row['draft_tokens']:>8} {row['accepted_tokens']:>8} {row['mean_lookahead']:>7.2f} "
                     f"{row['approx_tokens']:>7}")
    return "\n".join(lines)


def _verify(cost: dict, k: int) -> float:
    return CostModel.from_json(cost).verify(k)
