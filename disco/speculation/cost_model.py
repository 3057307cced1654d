"""Cost model of one deployment: what a draft token, a verification and a round trip cost.

Replay (:mod:`disco.offline.replay`) counts draft forwards and target forwards per iteration;
this turns the counts into simulated seconds, so thresholds can be tuned in seconds of
CPU instead of hours of generation. Per iteration of a speculative run::

    draft_forwards * t_draft + t_verify(k) + 2 * t_rtt     (k = draft tokens in the block)

and per token of target-only decoding ``t_verify(0) + t_rtt`` (one Verify call, no
Draft call). ``t_verify(k)`` is one target forward over ``k + 1`` positions (the block
plus the bonus position) with a warm KV cache; it is stored per k as measured and
extrapolated linearly from its last two points beyond.

Measured ones come one way: :func:`disco.engines.engine_costs.to_cost_model` over two
:class:`~disco.engines.engine_costs.EngineCosts` records (a low percentile of the engines'
own forwards, cached per model, engine and forward;
:func:`disco.engines.engine_costs.measure_cost_model` measures both on the loaded engines,
uncached). ``orientation`` is the GPU-like model the DISCO issue's figures used (t_draft
90 ms, t_verify 225 ms for any k, 240 ms per target-only token, i.e. a 15 ms round trip).
"""

from __future__ import annotations

import json
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
    t_draft_prefill: float = 0.0  # seconds per prompt token of the draft's prefill (0: not known)
    extra: dict = field(default_factory=dict, compare=False)
    draft_prefill_window: int = 0  # prompt tokens the draft prefills at most (its prefill window); 0: all

    def __post_init__(self) -> None:
        if (self.t_draft < 0 or self.t_rtt < 0 or self.t_draft_prefill < 0 or not self.t_verify
                or any(v <= 0 for v in self.t_verify) or self.draft_prefill_window < 0):
            raise InvalidRequest("cost model needs t_draft >= 0, t_rtt >= 0, t_draft_prefill >= 0, positive "
                                 "t_verify values and draft_prefill_window >= 0")

    def draft_prefill(self, prompt_tokens: int) -> float:
        """Seconds of the draft's prefill of a ``prompt_tokens`` prompt (at most its window's tokens)."""
        window = self.draft_prefill_window
        return (min(prompt_tokens, window) if window else prompt_tokens) * self.t_draft_prefill

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
        """Overlap (:mod:`disco.engines.predraft`): draft tokens of the next block ready when the
        verdict on a ``k``-token block arrives. The draft has ``t_verify(k) + 2 * t_rtt``
        (block to the target, verdict back, next call to the draft); it spends one forward
        on the guessed bonus token, then drafts."""
        if self.t_draft <= 0:
            return 0
        return max(0, int((self.verify(k) + 2 * self.t_rtt) // self.t_draft) - 1)

    @staticmethod
    def from_forward_costs(draft_forward_s: Sequence[float], target_forward_s: Sequence[float], t_rtt: float = 0.0,
                           source: str = "", extra: dict | None = None,
                           draft_prefill_s_per_token: float = 0.0, draft_prefill_window: int = 0) -> "CostModel":
        """The cost model of measured forwards (the one way measurements become one):
        ``t_draft`` a one-token draft forward (``draft_forward_s[0]``), ``t_verify[k]`` the
        target forward over ``k + 1`` new tokens (``target_forward_s[k]``), ``t_draft_prefill``
        the draft's prefill per prompt token (of at most ``draft_prefill_window`` tokens; 0: all)."""
        return CostModel(t_draft=float(draft_forward_s[0]), t_verify=tuple(float(v) for v in target_forward_s),
                         t_rtt=float(t_rtt), source=source, extra=dict(extra or {}),
                         t_draft_prefill=float(draft_prefill_s_per_token),
                         draft_prefill_window=int(draft_prefill_window))

    def with_rtt(self, t_rtt: float) -> "CostModel":
        return replace(self, t_rtt=float(t_rtt), source=f"{self.source} (rtt {t_rtt * 1000:g} ms)")

    def to_json(self) -> dict:
        return {"t_draft": self.t_draft, "t_verify": list(self.t_verify), "t_rtt": self.t_rtt,
                "t_draft_prefill": self.t_draft_prefill, "draft_prefill_window": self.draft_prefill_window,
                "source": self.source,
                "target_only_token": self.target_only_token, **self.extra}

    @staticmethod
    def from_json(data: dict) -> "CostModel":
        try:
            return CostModel(t_draft=float(data["t_draft"]), t_verify=tuple(float(v) for v in data["t_verify"]),
                             t_rtt=float(data.get("t_rtt", 0.0)), source=str(data.get("source", "")),
                             t_draft_prefill=float(data.get("t_draft_prefill", 0.0)),
                             draft_prefill_window=int(data.get("draft_prefill_window", 0)))
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

