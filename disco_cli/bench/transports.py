"""The ways a benchmark request can run: in process, through the gRPC services, or
through HF transformers' assisted generation (the peer)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from disco.config import SamplingParams, SpeculationConfig
from disco.speculation.loop import SpeculativeGenerator


@dataclass(frozen=True)
class RunOutcome:
    token_ids: list[int]
    wall_s: float  # measured by the benchmark around the call (client side)
    stats: dict  # RequestStats.to_dict(), or {} when the runner has none (the HF peer)


class Runner(Protocol):
    transport: str

    def run(self, prompt_ids: Sequence[int], sampling: SamplingParams,
            speculation: SpeculationConfig) -> RunOutcome: ...


class LocalRunner:
    """The in-process speculation loop."""

    transport = "local"

    def __init__(self, generator: SpeculativeGenerator) -> None:
        self.generator = generator

    def run(self, prompt_ids, sampling, speculation) -> RunOutcome:
        started = time.perf_counter()
        result = self.generator.generate(prompt_ids, sampling, speculation)
        return RunOutcome(result.token_ids, time.perf_counter() - started, result.stats.to_dict())


class GrpcRunner:
    """The public Orchestrator API, with the prompt sent as token ids so every transport
    sees exactly the same input."""

    transport = "grpc"

    def __init__(self, client) -> None:  # orchestrator.client.DiscoClient
        self.client = client

    def run(self, prompt_ids, sampling, speculation) -> RunOutcome:
        started = time.perf_counter()
        result = self.client.generate(
            prompt_ids=list(prompt_ids), policy=speculation.policy, max_lookahead=speculation.max_lookahead,
            max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, stop=list(sampling.stop), ignore_eos=sampling.ignore_eos)
        return RunOutcome(list(result.token_ids), time.perf_counter() - started, dict(result.stats))


class HfAssistedRunner:
    """HF transformers ``generate(assistant_model=...)`` with its default assisted-generation
    settings (the peer row ``hf-assisted``); greedy only, stops at EOS like our loop."""

    transport = "local"

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, eos_token_ids: Sequence[int],
                 pad_token_id: int) -> None:
        self.target, self.draft = target, draft
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id

    @torch.inference_mode()
    def run(self, prompt_ids, sampling, speculation) -> RunOutcome:
        input_ids = torch.tensor([list(prompt_ids)], device=self.target.device)
        started = time.perf_counter()
        output = self.target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=self.draft, do_sample=False,
            max_new_tokens=sampling.max_new_tokens, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id)
        wall_s = time.perf_counter() - started
        return RunOutcome(output[0, input_ids.shape[1]:].tolist(), wall_s, {})
