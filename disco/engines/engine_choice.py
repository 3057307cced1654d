"""``--dtype auto`` on a CPU: the engine of each role chosen by timing the candidates here.

CPU kernels differ several-fold between machines (bf16 verification nearly free on AMX,
int4 one-row GEMMs 4x a bf16 one on a Zen 4, bf16 emulated on AVX2: docs/engines.md), so
no rule on CPU flags picks well everywhere (issue 28). At the first start on a machine each
candidate engine of the role is loaded and its forward costs measured
(:func:`disco.engines.engine_costs.load_or_measure`, cached per model, engine, int4 kernel,
forward, device and thread count, so later starts only read files); the engine whose
*typical request* (:func:`typical_request_s`) is fastest wins. Reading those records loads
nothing and times nothing: with no model at hand, a record's int4 kernel is the one already
chosen on this machine (:func:`disco.engines.engine_costs.cached_kernel`) and its forward the
newest timed (the service that loads the chosen engine reads its own forward's record).

Candidates are the engines that meet the quality bar (docs/engines.md, "quality"): the
target's greedy tokens agree with the bf16 reference on at least 95% of teacher-forced
positions (bf16 itself, int4 — the GGUF's own Q4_K weights —, int8); the draft's quality only
moves its acceptance rate, never the output, so its candidates are the weight-only engines.
On CUDA ``auto`` stays ``bfloat16`` (:func:`disco.platform.resolve_dtype`).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from disco.config import ModelConfig
from disco.engines.engine_costs import (CostRequest, EngineCosts, cached_kernel, load_or_measure, read_cached,
                                        worth_remeasuring)
from disco.models.loading import load_model, model_fingerprint
from disco.platform import resolve_dtype

logger = logging.getLogger(__name__)

#: Engines ``auto`` times on a CPU, by role (see the module docstring for why these).
CPU_CANDIDATES = {"target": ("int4", "int8", "bfloat16"), "draft": ("int4", "int8")}
#: The typical request an engine is timed for: its prompt (the measured context) and the
#: tokens it generates, as target forwards over 1..5 new tokens (decoding, and verification
#: blocks of the lengths ``auto`` drafts) or one draft forward per token.
TYPICAL_NEW_TOKENS = 64
TYPICAL_BLOCK = 5


def choice_request(role: str) -> CostRequest:
    """What the choice times per candidate: the forwards :func:`typical_request_s` reads (the
    target's over 1..:data:`TYPICAL_BLOCK` new tokens, the draft's one), not the services' whole
    table (1..the lookahead cap + 1, :func:`~disco.engines.engine_costs.request_for`): a candidate
    that loses is never timed over blocks nobody will run on it; the chosen engine's service
    measures the rest at its start."""
    return CostRequest(max_new_tokens=TYPICAL_BLOCK if role == "target" else 1)


def typical_request_s(costs: EngineCosts, role: str) -> float:
    """Seconds of a typical request on an engine: the prompt's prefill plus
    :data:`TYPICAL_NEW_TOKENS` tokens, for the target the mean forward over 1..:data:`TYPICAL_BLOCK`
    new tokens per token generated (each forward yields about one token more than it is
    given when verifying; decoding yields one), for the draft one forward per token."""
    if role == "draft":
        per_token = costs.forward_seconds(1)
    else:
        per_token = sum(costs.forward_seconds(k) for k in range(1, TYPICAL_BLOCK + 1)) / TYPICAL_BLOCK
    return costs.prefill_s + TYPICAL_NEW_TOKENS * per_token


def choose_engine(requested: str, spec: str | None, role: str, device: str, home: Path,
                  progress: bool = True) -> str:
    """The concrete engine for ``--dtype requested`` of the model ``spec`` in ``role``.

    Anything but ``auto`` on a CPU is :func:`disco.platform.resolve_dtype`. ``auto`` on a
    CPU measures the :data:`CPU_CANDIDATES` not measured yet on this machine (loading each:
    the first start takes minutes, with progress) and returns the one with the fastest
    :func:`typical_request_s`. Raises :class:`~disco.errors.ModelError` as :func:`load_model`."""
    if requested != "auto" or not device.startswith("cpu"):
        return resolve_dtype(requested, device, role)
    threads = torch.get_num_threads()
    fingerprint = model_fingerprint(ModelConfig(spec=spec, dtype=CPU_CANDIDATES[role][0], device=device), role, home)
    timed: dict[str, float] = {}
    for engine in CPU_CANDIDATES[role]:
        costs = None if fingerprint is None else read_cached(
            home, fingerprint, engine, device, threads, choice_request(role), forward=None,
            kernel=cached_kernel(home, engine, device))
        if costs is None or worth_remeasuring(costs):  # a busy start's timing is measured again when quiet
            costs = _measure(spec, role, engine, device, home, progress)
        timed[engine] = typical_request_s(costs, role)
    chosen = min(timed, key=timed.get)
    logger.info("--dtype auto, %s on %s with %d threads: %s (a typical request: %s)", role, device, threads, chosen,
                ", ".join(f"{engine} {seconds:.2f} s" for engine, seconds in timed.items()))
    return chosen


def _measure(spec: str | None, role: str, engine: str, device: str, home: Path, progress: bool) -> EngineCosts:
    """Load the model on ``engine``, measure (and cache) its costs, and free it."""
    logger.info("--dtype auto: timing the %s engine for the %s (once on this machine) ...", engine, role)
    config = ModelConfig(spec=spec, dtype=engine, device=device)
    loaded = load_model(config, role, home, progress)
    try:
        return load_or_measure(loaded.model, name=loaded.name, fingerprint=loaded.fingerprint, engine=engine,
                               device=device, home=home, request=choice_request(role), progress=progress)
    finally:
        del loaded
        gc.collect()
