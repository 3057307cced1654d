"""Measured engine costs: what one forward of a loaded model costs on this machine.

For speculative decoding two numbers decide everything: the draft's cost per token and
the target's cost of one forward over k new tokens (a verification block of k - 1 draft
tokens plus the bonus position), for k = 1..L with L = max lookahead + 1. They depend on
the model, the engine (dtype), the device and the thread count, so they are measured
once per such combination, after a ~200-token context (the KV cache a real request has),
and cached as JSON under ``<home>/engine_costs/``.

Timings go through the engines' own forward path (:class:`disco.engines.kv.CachedSequence`):
prefill the context once, then for each k append k tokens, forward them, and roll the
cache back. Every k is timed ``repeats`` times round-robin (a burst of load from other
processes then hits one timing of several k rather than every timing of one k) after a
warm-up round, and a low percentile (:data:`LOW_PERCENTILE`) is kept: another process on
the cores only makes forwards slower. A measurement taken under contention — the load
average at or above the core count, or repeats of one size spread by
:data:`CONTENDED_SPREAD` or more — is cached as *provisional* and measured again at a later
start on a quiet machine (issue 29: a busy first start had cached 1,548 ms per draft
token for a 25 ms draft, and ``auto`` then stopped speculating). A file lock keeps two processes of one machine
(``disco serve`` starts the draft and the target together) from measuring at once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch
from tqdm import tqdm

from disco.engines import device_clock
from disco.errors import InvalidRequest
from disco.models import q4q8
from disco.speculation.cost_model import CostModel

logger = logging.getLogger(__name__)

COSTS_DIR = "engine_costs"
FORMAT_VERSION = 1
DEFAULT_CONTEXT_TOKENS = 200
DEFAULT_REPEATS = 5
#: Target forwards measured by default: 1..9 new tokens (max lookahead 8).
DEFAULT_TARGET_TOKENS = 9
#: The draft's per-token cost is a one-token forward.
DEFAULT_DRAFT_TOKENS = 1
#: The percentile of a size's repeats that is kept: a low one, since another process on the
#: cores only ever makes a forward slower (a busy first start must not set the costs).
LOW_PERCENTILE = 20
#: A measurement whose repeats of one size spread by more than this (slowest / fastest,
#: the median over sizes) was taken on shared cores: it is provisional.
CONTENDED_SPREAD = 1.5


@dataclass(frozen=True)
class CostRequest:
    """What to measure: forwards over ``1..max_new_tokens`` new tokens after
    ``context_tokens`` tokens of context, each a low percentile of ``repeats`` timings."""

    max_new_tokens: int = DEFAULT_TARGET_TOKENS
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    repeats: int = DEFAULT_REPEATS

    def validate(self, max_context: int | None = None) -> None:
        """Raise :class:`InvalidRequest` if a field is out of range (or the context too long)."""
        if not 1 <= self.max_new_tokens <= 128:
            raise InvalidRequest(f"new tokens per forward must be in [1, 128], got {self.max_new_tokens}")
        if self.context_tokens < 1:
            raise InvalidRequest(f"context tokens must be >= 1, got {self.context_tokens}")
        if self.repeats < 1:
            raise InvalidRequest(f"repeats must be >= 1, got {self.repeats}")
        if max_context is not None and self.context_tokens + self.max_new_tokens > max_context:
            raise InvalidRequest(f"context ({self.context_tokens}) + new tokens ({self.max_new_tokens}) exceeds "
                                 f"the model's context of {max_context} tokens")

    def fitted(self, max_context: int) -> "CostRequest":
        """This request with the context shortened (to half the model's context at most)
        where the model's context is too short for it (tiny test models)."""
        room = max(1, min(self.context_tokens, max_context // 2, max_context - self.max_new_tokens))
        return replace(self, context_tokens=room)


@dataclass(frozen=True)
class EngineCosts:
    """Measured forward costs of one model on one engine, device and thread count.

    Attributes:
        model: display name of the model.
        fingerprint: its weights' fingerprint (part of the cache key).
        engine: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"int8"``.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        threads: torch CPU threads during the measurement.
        context_tokens: tokens in the KV cache before each timed forward.
        forward_s: ``forward_s[k - 1]``: seconds of one forward over ``k`` new tokens.
        prefill_s: seconds of the forward that filled the context (one timing).
        repeats: timings per point (a low percentile is kept, :data:`LOW_PERCENTILE`).
        torch_version: torch that ran them.
        measured_at: unix time of the measurement.
        load_average: the machine's 1-minute load average when the measurement began (other
            processes on the cores inflate the timings; compare with the core count).
        spread: slowest / fastest repeat of one size, the median over sizes (1.0: steady).
        provisional: taken under contention (load average >= cores, or ``spread`` >=
            :data:`CONTENDED_SPREAD`): measured again at a later start on a quiet machine.
    """

    model: str
    fingerprint: str
    engine: str
    device: str
    threads: int
    context_tokens: int
    forward_s: tuple[float, ...]
    prefill_s: float
    repeats: int
    torch_version: str
    measured_at: float
    load_average: float = 0.0
    spread: float = 1.0
    provisional: bool = False

    @property
    def per_token_s(self) -> float:
        """Seconds of a one-token forward (a decode step, or one drafted token)."""
        return self.forward_s[0]

    @property
    def max_new_tokens(self) -> int:
        return len(self.forward_s)

    def forward(self, new_tokens: int) -> float:
        """Seconds of one forward over ``new_tokens`` tokens, extrapolated linearly past the last point."""
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
        if new_tokens <= len(self.forward_s):
            return self.forward_s[new_tokens - 1]
        if len(self.forward_s) == 1:
            return self.forward_s[0] * new_tokens
        slope = max(0.0, self.forward_s[-1] - self.forward_s[-2])
        return self.forward_s[-1] + slope * (new_tokens - len(self.forward_s))

    def to_json(self) -> dict:
        data = asdict(self)
        data["forward_s"] = list(self.forward_s)
        data["forward_ms"] = [round(v * 1000, 3) for v in self.forward_s]
        data["format"] = FORMAT_VERSION
        return data

    @staticmethod
    def from_json(data: dict) -> "EngineCosts":
        """Raises :class:`InvalidRequest` on a malformed or older-format record."""
        try:
            if data.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
            costs = EngineCosts(
                model=str(data["model"]), fingerprint=str(data["fingerprint"]), engine=str(data["engine"]),
                device=str(data["device"]), threads=int(data["threads"]), context_tokens=int(data["context_tokens"]),
                forward_s=tuple(float(v) for v in data["forward_s"]), prefill_s=float(data["prefill_s"]),
                repeats=int(data["repeats"]), torch_version=str(data["torch_version"]),
                measured_at=float(data["measured_at"]), load_average=float(data.get("load_average", 0.0)),
                spread=float(data.get("spread", 1.0)), provisional=bool(data.get("provisional", False)))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise InvalidRequest(f"malformed engine costs: {error}") from None
        if not costs.forward_s or any(v <= 0 for v in costs.forward_s):
            raise InvalidRequest("malformed engine costs: forward_s must hold positive seconds")
        return costs


class ForwardTimings(NamedTuple):
    """What :func:`measure_forward_costs` measured."""

    forward_s: tuple[float, ...]  # forward_s[k - 1]: a low percentile of the forwards over k new tokens
    prefill_s: float  # the context's prefill (one timing)
    spread: float  # slowest / fastest repeat of one size, the median over sizes


def measure_forward_costs(model: torch.nn.Module, request: CostRequest, progress: bool = True,
                          label: str = "") -> ForwardTimings:
    """Time forwards of ``model`` over 1..``request.max_new_tokens`` new tokens (each size
    :data:`LOW_PERCENTILE`-th percentile of its repeats, see :func:`low_percentile`)."""
    sizes = range(1, request.max_new_tokens + 1)
    samples, prefill_s = time_forwards(model, request.context_tokens, sizes, request.repeats, progress, label)
    return ForwardTimings(tuple(low_percentile(samples[k]) for k in sizes), prefill_s,
                          statistics.median(max(samples[k]) / min(samples[k]) for k in sizes))


def low_percentile(values: Sequence[float], percent: float = LOW_PERCENTILE) -> float:
    """The ``percent``-th percentile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * percent / 100
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def time_forwards(model: torch.nn.Module, context_tokens: int, sizes: Sequence[int], repeats: int,
                  progress: bool = False, label: str = "") -> tuple[dict[int, list[float]], float]:
    """The one timing harness: the engines' own forward path (:class:`CachedSequence`)
    after ``context_tokens`` tokens of a fixed synthetic context (prefilled once to warm up,
    then again timed), one forward over ``k``
    new tokens per ``k`` in ``sizes``, rolled back after each timing; ``repeats`` rounds
    round-robin over the sizes after a warm-up round (a burst of load from other processes
    then hits one timing of several sizes rather than every timing of one size).

    Returns:
        ``({k: seconds of each repeat}, prefill seconds of the context)``.
    """
    from disco.engines.kv import CachedSequence  # noqa: PLC0415 - transformers only when measuring

    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device  # NOTE: CUDA runs kernels asynchronously: timers wait for it
    context = [(i * 7919) % (vocab - 1) + 1 for i in range(context_tokens)]
    samples: dict[int, list[float]] = {k: [] for k in sizes}
    bar = tqdm(total=2 + (repeats + 1) * len(samples), unit="fwd", disable=not progress,
               desc=f"calibrating {label}".strip())
    with bar, torch.inference_mode():
        # NOTE: the first call of a shape builds its kernels (oneDNN's bf16 primitives on an
        # AMX Xeon: a 200-token prefill timed 2.7 s cold, 0.5 s warm), so one prefill warms up.
        CachedSequence(model, [*context, context[-1]]).prefill()
        bar.update(1)
        sequence = CachedSequence(model, [*context, context[-1]])
        started = device_clock.now(device)
        sequence.prefill()  # the context is in the cache; one token stays pending
        prefill_s = device_clock.now(device) - started
        sequence.truncate(context_tokens)
        bar.update(1)
        for round_index in range(repeats + 1):  # round 0 warms up
            for k in samples:
                sequence.tokens.extend((context_tokens + round_index + i) % (vocab - 1) + 1 for i in range(k))
                started = device_clock.now(device)
                sequence.forward(k)
                elapsed = device_clock.now(device) - started
                sequence.truncate(context_tokens)
                if round_index:
                    samples[k].append(elapsed)
                bar.update(1)
    return samples, prefill_s


def measure_cost_model(target_model: torch.nn.Module, draft_model: torch.nn.Module, max_k: int = 12,
                       repeats: int = 3, rtt: float = 0.0, prompt_len: int = 128, source: str = "measured",
                       ks: Sequence[int] | None = None) -> CostModel:
    """A :class:`~disco.speculation.cost_model.CostModel` timed on the loaded models with
    :func:`time_forwards`: ``t_draft`` a one-token draft forward, ``t_verify(k)`` a target
    forward over ``k + 1`` new tokens, both after ``prompt_len`` tokens of context; ``k``
    not in ``ks`` (default: all of 0..``max_k``) interpolated linearly."""
    ks = sorted(set(ks if ks is not None else range(max_k + 1)) | {0})
    draft, _ = time_forwards(draft_model, prompt_len, (1,), repeats)
    target, _ = time_forwards(target_model, prompt_len, [k + 1 for k in ks], repeats)
    measured = {k: statistics.median(target[k + 1]) for k in ks}
    t_verify = []
    for k in range(max(ks) + 1):
        if k in measured:
            t_verify.append(measured[k])
        else:
            lo = max(j for j in measured if j < k)
            hi = min(j for j in measured if j > k)
            t_verify.append(measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo))
    return CostModel.from_forward_costs((statistics.median(draft[1]),), t_verify, rtt, source,
                                        extra={"repeats": repeats, "prompt_len": prompt_len, "timed_k": ks})


#: The engines' forward as costs were timed on it: "lean1" is the lean decoder (issue 39), whose
#: forwards cost less than the HF decoder's the earlier cache files timed.
FORWARD_VERSION = "lean1"


def costs_path(home: Path, fingerprint: str, engine: str, device: str, threads: int) -> Path:
    """The cache file of one (model, engine, device, threads) combination; the int4 engine's
    name carries the kernel it runs here (:func:`disco.models.q4q8.choose_kernel`), so costs
    timed on the other kernel are not read back, and every name carries the forward's
    version (:data:`FORWARD_VERSION`), so costs timed on an older forward are not either."""
    safe_device = device.replace(":", "")
    if engine == "int4" and device.startswith("cpu"):
        engine = f"{engine}-{q4q8.choose_kernel(home).kernel}"
    return home / COSTS_DIR / f"{fingerprint}-{engine}-{safe_device}-t{threads}-{FORWARD_VERSION}.json"


def read_cached(home: Path, fingerprint: str, engine: str, device: str, threads: int,
                request: CostRequest | None = CostRequest()) -> EngineCosts | None:
    """The cached costs of this combination if they cover ``request`` (``None``: whatever
    was measured), else ``None``. Reads only."""
    path = costs_path(home, fingerprint, engine, device, threads)
    try:
        costs = EngineCosts.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, InvalidRequest):
        return None
    if request is not None and (costs.max_new_tokens < request.max_new_tokens
                                or costs.context_tokens != request.context_tokens):
        return None
    return costs


def load_or_measure(model: torch.nn.Module, *, name: str, fingerprint: str, engine: str, device: str,
                    home: Path, request: CostRequest = CostRequest(), force: bool = False,
                    progress: bool = True, lock: bool = True) -> EngineCosts:
    """The costs of ``model`` as it runs now: from the cache, else measured (and cached).

    The thread count is torch's current one. ``force`` measures again even when cached.
    A model whose context is too short for ``request`` is measured after a shorter context
    (the result's ``context_tokens`` says which). ``lock=False``: the caller already holds
    :func:`machine_lock`. A cached measurement taken while the machine was overloaded (load
    average >= its cores) is replaced once the load has fallen below half of that.

    Raises:
        InvalidRequest: ``request`` is out of range for the model.
    """
    max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    request.validate()
    request = request.fitted(max_context)
    request.validate(max_context)
    threads = torch.get_num_threads()
    key = (home, fingerprint, engine, device, threads)
    if not force and (cached := read_cached(*key, request)) is not None and not worth_remeasuring(cached):
        return cached
    with machine_lock(home) if lock else _no_lock():
        cached = None if force else read_cached(*key, request)  # measured meanwhile?
        if cached is not None and not worth_remeasuring(cached):
            return cached
        load_average = _load_average()
        logger.info("measuring the forward costs of %s (%s, %s, %d threads; once, cached in %s) ...",
                    name, engine, device, threads, home / COSTS_DIR)
        if load_average >= (os.cpu_count() or 1):  # NOTE: this process's own model load counts too
            logger.warning("the load average is %.1f: other processes share the cores, so the measured costs "
                           "may be too high (measure again with `disco models calibrate --force`)", load_average)
        timings = measure_forward_costs(model, request, progress, label=f"{name} ({engine})")
        provisional = load_average >= (os.cpu_count() or 1) or timings.spread >= CONTENDED_SPREAD
        costs = EngineCosts(model=name, fingerprint=fingerprint, engine=engine, device=device, threads=threads,
                            context_tokens=request.context_tokens, forward_s=timings.forward_s,
                            prefill_s=timings.prefill_s, repeats=request.repeats, torch_version=torch.__version__,
                            measured_at=time.time(), load_average=load_average, spread=round(timings.spread, 3),
                            provisional=provisional)
        if provisional:
            logger.warning("the measured costs of %s are provisional (load average %.1f, repeats spread %.2fx): "
                           "they are measured again at a start on a quiet machine", name, load_average,
                           timings.spread)
        path = costs_path(*key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(costs.to_json(), indent=2) + "\n")
            tmp.replace(path)
        except OSError as error:  # NOTE: a read-only cache only costs the next start a measurement
            logger.warning("could not cache engine costs in %s: %s", path, error)
    logger.info("%s (%s): %s", name, engine, format_costs_line(costs))
    return costs


def request_for(role: str) -> CostRequest:
    """What is measured for a role: the target's forwards over 1..9 new tokens (blocks up
    to the default max lookahead of 8), the draft's cost per token."""
    return CostRequest(max_new_tokens=DEFAULT_TARGET_TOKENS if role == "target" else DEFAULT_DRAFT_TOKENS)


def measure_loaded(loaded, config, role: str, home: Path, **options) -> EngineCosts:
    """:func:`load_or_measure` for a :class:`~disco.models.loading.LoadedModel` run as ``config``
    (a :class:`~disco.config.ModelConfig`) in ``role``; ``options`` as there."""
    return load_or_measure(loaded.model, name=loaded.name, fingerprint=loaded.fingerprint, engine=config.dtype,
                           device=config.device, home=home, request=request_for(role), **options)


def worth_remeasuring(cached: EngineCosts) -> bool:
    """Whether ``cached`` was taken under contention (provisional, or an overloaded machine)
    and the machine is quiet now (load average below half its cores).

    NOTE: with two processes of 2 threads each on 2 cores, a bf16 draft step measured
    1.1-1.6 s instead of ~0.1 s (every op waits for a descheduled thread); such a record
    must not stand for the engine forever.
    """
    cores = os.cpu_count() or 1
    contended = cached.provisional or cached.load_average >= cores
    return contended and _load_average() < max(cached.load_average, cores) / 2


def _load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return 0.0


def format_costs_line(costs: EngineCosts) -> str:
    """``1 tok 236.1 ms, 2 tok 245.0 ms, ...`` (for logs)."""
    return ", ".join(f"{k} tok {v * 1000:.1f} ms" for k, v in enumerate(costs.forward_s, start=1))


def format_costs_table(rows: dict[str, EngineCosts]) -> str:
    """A text table of several models' costs (ms per forward over k new tokens)."""
    width = max(len(costs.forward_s) for costs in rows.values())
    header = f"{'role':<8}{'model':<30}{'engine':<10}{'threads':>8}{'prefill':>11}" + "".join(
        f"{f'k={k}':>9}" for k in range(1, width + 1))
    lines = [header]
    for role, costs in rows.items():
        cells = "".join(f"{v * 1000:>9.1f}" for v in costs.forward_s)
        lines.append(f"{role:<8}{costs.model[:29]:<30}{costs.engine:<10}{costs.threads:>8}"
                     f"{costs.prefill_s * 1000:>11.0f}{cells}")
    first = next(iter(rows.values()))
    lines.append(f"ms per forward over k new tokens after a {first.context_tokens}-token context "
                 f"({LOW_PERCENTILE}th percentile of {first.repeats}; prefill: the context, ms); {first.device}; "
                 "load average "
                 + ", ".join(f"{costs.load_average:g}" for costs in rows.values()) + " when measured")
    return "\n".join(lines)


@contextmanager
def _no_lock() -> Iterator[None]:
    yield


@contextmanager
def machine_lock(home: Path) -> Iterator[None]:
    """One measurement at a time per machine (a second process waits, then reads the cache).

    NOTE: the lock is machine-wide, not per model: two models measured at once on a
    small CPU would slow each other down and cache the slowed numbers. A service holds it
    while it loads its model too (quantizing is CPU-heavy), so a measurement never runs
    next to another service's model load. Not reentrant within one process.
    """
    locks = home / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        handle = (locks / "engine_costs.lock").open("w")
    except OSError:  # read-only home: measure without the lock
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def to_cost_model(target: EngineCosts, draft: EngineCosts, rtt: float = 0.0) -> CostModel:
    """A :class:`disco.speculation.cost_model.CostModel` from measured costs: ``t_draft`` the draft's
    per-token cost, ``t_verify[k]`` the target forward over ``k + 1`` new tokens."""
    return CostModel.from_forward_costs(draft.forward_s, target.forward_s, rtt,
                                        source=f"engine costs: {target.model} / {draft.model}, {target.engine}, "
                                               f"{target.device}, {target.threads} threads")
