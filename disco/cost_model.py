"""Cost model of one deployment: what a draft token, a verification and a round trip cost.

Replay (:mod:`disco.replay`) counts draft forwards and target forwards per iteration;
this turns the counts into simulated seconds, so thresholds can be tuned in seconds of
CPU instead of hours of generation. Per iteration of a speculative run::

    draft_forwards * t_draft + t_verify(k) + 2 * t_rtt     (k = draft tokens in the block)

and per token of target-only decoding ``t_verify(0) + t_rtt`` (one Verify call, no
Draft call). ``t_verify(k)`` is one target forward over ``k + 1`` positions (the block
plus the bonus position) with a warm KV cache; it is stored per k as measured and
extrapolated linearly from its last two points beyond.

``measure`` times the live engines' code path (:class:`disco.kv.CachedSequence`) on the
loaded models; ``orientation`` is the GPU-like model the DISCO issue's figures used
(t_draft 90 ms, t_verify 225 ms for any k, 240 ms per target-only token, i.e. a 15 ms
round trip).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from disco.errors import InvalidRequest


@dataclass(frozen=True)
class CostModel:
    t_draft: float  # seconds per draft forward (one token, warm cache)
    t_verify: tuple[float, ...]  # t_verify[k]: one target forward over k draft tokens (+ bonus position)
    t_rtt: float = 0.0  # seconds per RPC round trip (0 in process)
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.t_draft < 0 or self.t_rtt < 0 or not self.t_verify or any(v <= 0 for v in self.t_verify):
            raise InvalidRequest("cost model needs t_draft >= 0, t_rtt >= 0 and positive t_verify values")

    def verify(self, k: int) -> float:
        if k < len(self.t_verify):
            return self.t_verify[k]
        if len(self.t_verify) == 1:
            return self.t_verify[0]
        slope = max(0.0, self.t_verify[-1] - self.t_verify[-2])
        return self.t_verify[-1] + slope * (k - len(self.t_verify) + 1)

    def iteration(self, draft_forwards: int, k: int, uses_draft: bool = True) -> float:
        """Seconds of one iteration that ran ``draft_forwards`` draft forwards and
        verified ``k`` draft tokens."""
        rtts = 2 if uses_draft and draft_forwards > 0 else 1
        return draft_forwards * self.t_draft + self.verify(k) + rtts * self.t_rtt

    @property
    def target_only_token(self) -> float:
        return self.verify(0) + self.t_rtt

    def predrafted(self, k: int) -> int:
        """Overlap (:mod:`disco.predraft`): draft tokens of the next block ready when the
        verdict on a ``k``-token block arrives. The draft has ``t_verify(k) + 2 * t_rtt``
        (block to the target, verdict back, next call to the draft); it spends one forward
        on the guessed bonus token, then drafts."""
        if self.t_draft <= 0:
            return 0
        return max(0, int((self.verify(k) + 2 * self.t_rtt) // self.t_draft) - 1)

    def with_rtt(self, t_rtt: float) -> "CostModel":
        return replace(self, t_rtt=float(t_rtt), source=f"{self.source} (rtt {t_rtt * 1000:g} ms)")

    def to_json(self) -> dict:
        return {"t_draft": self.t_draft, "t_verify": list(self.t_verify), "t_rtt": self.t_rtt,
                "source": self.source, "target_only_token": self.target_only_token, **self.extra}

    @staticmethod
    def from_json(data: dict) -> "CostModel":
        try:
            return CostModel(t_draft=float(data["t_draft"]), t_verify=tuple(float(v) for v in data["t_verify"]),
                             t_rtt=float(data.get("t_rtt", 0.0)), source=str(data.get("source", "")))
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidRequest(f"malformed cost model: {error}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @staticmethod
    def load(path: Path) -> "CostModel":
        try:
            return CostModel.from_json(json.loads(Path(path).read_text()))
        except OSError as error:
            raise InvalidRequest(f"cannot read cost model {path}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"cost model {path} is not valid JSON ({error.msg})") from None

    @staticmethod
    def orientation() -> "CostModel":
        return CostModel(t_draft=0.090, t_verify=(0.225,), t_rtt=0.015,
                         source="orientation (issue figures: t_draft 90 ms, t_verify 225 ms, 240 ms/token target-only)")


def measure(target_model, draft_model, max_k: int = 12, repeats: int = 3, rtt: float = 0.0,
            prompt_len: int = 128, source: str = "measured",
            ks: Sequence[int] | None = None) -> CostModel:
    """Time the engines' forward path on the loaded models.

    ``t_draft``: a single-token draft forward after a ``prompt_len``-token prefill;
    ``t_verify(k)``: a target forward over ``k + 1`` new tokens on the same cache, rolled
    back after each timing. Each point is the median of ``repeats`` timings (after one
    warm-up), taken round-robin over k. Points not timed (when ``ks`` skips some) are interpolated linearly.
    """
    import torch  # noqa: PLC0415

    from disco.kv import CachedSequence  # noqa: PLC0415

    ks = sorted(set(ks if ks is not None else range(max_k + 1)) | {0})
    vocab = min(int(target_model.config.vocab_size), int(draft_model.config.vocab_size))
    prompt = [(i * 7919) % (vocab - 1) + 1 for i in range(prompt_len)]

    def timed(sequence: CachedSequence, new_tokens: int) -> float:
        base = len(sequence)
        sequence.tokens.extend((base + i) % (vocab - 1) + 1 for i in range(new_tokens))
        started = time.perf_counter()
        sequence.forward(new_tokens)
        elapsed = time.perf_counter() - started
        sequence.truncate(base)
        return elapsed

    with torch.inference_mode():
        draft = CachedSequence(draft_model, prompt)
        draft.prefill()
        draft.tokens.pop()  # prefill leaves the last token pending; time from a clean cache
        draft.cache_len = min(draft.cache_len, len(draft))
        timed(draft, 1)
        t_draft = statistics.median(timed(draft, 1) for _ in range(repeats))
        target = CachedSequence(target_model, prompt)
        target.prefill()
        target.tokens.pop()
        timed(target, 1)
        # Round-robin over k, so that a burst of contention from other processes hits
        # one timing of several k rather than every timing of one k.
        samples: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(repeats):
            for k in ks:
                samples[k].append(timed(target, k + 1))
        measured = {k: statistics.median(values) for k, values in samples.items()}
    t_verify = []
    for k in range(max(ks) + 1):
        if k in measured:
            t_verify.append(measured[k])
        else:
            lo = max(j for j in measured if j < k)
            hi = min(j for j in measured if j > k)
            t_verify.append(measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo))
    return CostModel(t_draft=t_draft, t_verify=tuple(t_verify), t_rtt=rtt, source=source,
                     extra={"repeats": repeats, "prompt_len": prompt_len, "timed_k": ks})
