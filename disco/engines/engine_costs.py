"""Measured engine costs: what one forward of a loaded model costs on this machine.

For speculative decoding two numbers decide everything: the draft's cost per token and
the target's cost of one forward over k new tokens (a verification block of k - 1 draft
tokens plus the bonus position), for k = 1..L with L = the lookahead cap + 1
(:data:`disco.config.DEFAULT_MAX_LOOKAHEAD`). They depend on the model, the engine (dtype),
the int4 kernel, the forward that runs it (the lean decoder, the packed HF forward or the
plain HF one), the device and the thread count, so they are measured once per such
combination, after a ~200-token context (the KV cache a real request has), and cached as
JSON under ``<home>/engine_costs/``.

One record and one way to a cost model: :func:`measure_forward_costs` is the only place
timings become numbers, an :class:`EngineCosts` record (what :func:`load_or_measure` caches,
``disco doctor`` reports and :func:`measure_cost_model` uses), and :func:`to_cost_model` the
only way records become a :class:`~disco.speculation.cost_model.CostModel`. Reading a record
(:func:`read_cached`) only reads files: it never builds, loads or times a kernel.

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

import json
import logging
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from disco.config import DEFAULT_MAX_LOOKAHEAD
from disco.engines import device_clock
from disco.engines.machine_lock import machine_lock
from disco.errors import InvalidRequest
from disco.models import q4q8
from disco.models.int4 import Int4Linear
from disco.speculation.cost_model import CostModel

logger = logging.getLogger(__name__)

COSTS_DIR = "engine_costs"
#: 2: records say which forward (and int4 kernel) was timed, and cover the lookahead cap.
#: 3: prefills may run on the quantized kernel (:func:`~disco.models.weight_only.choose_prefill_path`):
#: a record's ``prefill_s`` timed before may be ~1.7x too high.
FORMAT_VERSION = 3
DEFAULT_CONTEXT_TOKENS = 200
DEFAULT_REPEATS = 5
#: Target forwards measured by default: 1..L new tokens, L = the lookahead cap + 1 (a block
#: of the most draft tokens a request may ask for, plus the bonus position): no block the
#: engines verify is priced by extrapolation.
DEFAULT_TARGET_TOKENS = DEFAULT_MAX_LOOKAHEAD + 1
#: The forwards the engines run a model on (:func:`forward_of`).
FORWARDS = ("lean", "packed-hf", "hf")
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
        engine: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"int8"`` or ``"int4"``.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        forward: the forward that was timed (:func:`forward_of`): ``"lean"``, ``"packed-hf"``
            or ``"hf"`` (part of the cache key: costs of one are never read for another).
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
        kernel: the int4 kernel the model's int4 layers ran (:func:`kernel_of`; part of the
            cache key), ``None`` for a model without them.
    """

    model: str
    fingerprint: str
    engine: str
    device: str
    forward: str
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
    kernel: str | None = None

    @property
    def per_token_s(self) -> float:
        """Seconds of a one-token forward (a decode step, or one drafted token)."""
        return self.forward_s[0]

    @property
    def max_new_tokens(self) -> int:
        return len(self.forward_s)

    def forward_seconds(self, new_tokens: int) -> float:
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
                device=str(data["device"]), forward=str(data["forward"]), threads=int(data["threads"]),
                context_tokens=int(data["context_tokens"]),
                forward_s=tuple(float(v) for v in data["forward_s"]), prefill_s=float(data["prefill_s"]),
                repeats=int(data["repeats"]), torch_version=str(data["torch_version"]),
                measured_at=float(data["measured_at"]), load_average=float(data.get("load_average", 0.0)),
                spread=float(data.get("spread", 1.0)), provisional=bool(data.get("provisional", False)),
                kernel=None if data.get("kernel") is None else str(data["kernel"]))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise InvalidRequest(f"malformed engine costs: {error}") from None
        if not costs.forward_s or any(v <= 0 for v in costs.forward_s):
            raise InvalidRequest("malformed engine costs: forward_s must hold positive seconds")
        return costs


def measure_forward_costs(model: torch.nn.Module, request: CostRequest, progress: bool = True, label: str = "",
                          *, name: str = "", fingerprint: str = "", engine: str = "", device: str | None = None,
                          sizes: Sequence[int] | None = None) -> EngineCosts:
    """The one way from timings to costs: time forwards of ``model`` over 1..``request.max_new_tokens``
    new tokens (:func:`time_forwards`) and keep each size's :data:`LOW_PERCENTILE`-th
    percentile of its repeats (:func:`low_percentile`), as an :class:`EngineCosts` record of
    the forward that ran (:func:`forward_of`, :func:`kernel_of`) on the model's device.

    Args:
        name, fingerprint, engine, device: the record's identity (the cache key where it is
            cached; ``device`` defaults to the model's).
        sizes: the sizes timed (default: all); the others are interpolated linearly between
            them. Must hold 1 and ``request.max_new_tokens``.
    """
    sizes = sorted(set(sizes if sizes is not None else range(1, request.max_new_tokens + 1)))
    if sizes[0] != 1 or sizes[-1] != request.max_new_tokens:
        raise ValueError(f"sizes must span 1..{request.max_new_tokens}, got {sizes}")
    forward, load_average = forward_of(model), _load_average()
    samples, prefill_s = time_forwards(model, request.context_tokens, sizes, request.repeats, progress, label)
    spread = statistics.median(max(samples[k]) / min(samples[k]) for k in sizes)
    return EngineCosts(model=name, fingerprint=fingerprint, engine=engine,
                       device=device or str(next(model.parameters()).device), forward=forward,
                       threads=torch.get_num_threads(), context_tokens=request.context_tokens,
                       forward_s=_interpolated({k: low_percentile(samples[k]) for k in sizes}),
                       prefill_s=prefill_s, repeats=request.repeats, torch_version=torch.__version__,
                       measured_at=time.time(), load_average=load_average, spread=round(spread, 3),
                       provisional=load_average >= (os.cpu_count() or 1) or spread >= CONTENDED_SPREAD,
                       kernel=kernel_of(model))


def _interpolated(seconds: dict[int, float]) -> tuple[float, ...]:
    """``seconds`` by size (1 and the largest among them) as a table over 1..largest, the
    sizes missing linearly interpolated between their timed neighbours."""
    table = []
    for k in range(1, max(seconds) + 1):
        if k in seconds:
            table.append(seconds[k])
            continue
        lo, hi = max(j for j in seconds if j < k), min(j for j in seconds if j > k)
        table.append(seconds[lo] + (seconds[hi] - seconds[lo]) * (k - lo) / (hi - lo))
    return tuple(table)


def forward_of(model: torch.nn.Module) -> str:
    """The forward the engines run ``model`` on (what its costs are timed on): ``"lean"``, its
    lean decoder (:func:`disco.engines.packed_forward.lean_decoder_for`); ``"packed-hf"``, the
    HF forward packed (:func:`~disco.engines.packed_forward.supports_packing`); ``"hf"``, the
    plain HF forward."""
    from disco.engines.packed_forward import lean_decoder_for, supports_packing  # noqa: PLC0415 - transformers

    if lean_decoder_for(model) is not None:
        return "lean"
    return "packed-hf" if supports_packing(model) else "hf"


def kernel_of(model: torch.nn.Module) -> str | None:
    """The kernel the model's int4 layers run (:attr:`disco.models.int4.Int4Linear.kernel`),
    ``None`` for a model without them."""
    kernels = sorted({module.kernel for module in model.modules() if isinstance(module, Int4Linear)})
    return "+".join(kernels) if kernels else None


def cached_kernel(home: Path, engine: str, device: str) -> str | None:
    """The int4 kernel a model of ``engine`` would run on ``device`` here, where no model is at
    hand (an engine choice before loading, a benchmark reading the services' records): the
    kernel already chosen on this machine (:func:`disco.models.q4q8.cached_choice`: read, never
    measured), torch's kernel off the CPU, ``None`` for other engines or where no choice is
    cached yet (then no int4 record is found: nothing was timed on a chosen kernel)."""
    if engine != "int4":
        return None
    if not device.startswith("cpu"):
        return q4q8.TORCH_KERNEL
    choice = q4q8.cached_choice(home)
    return choice.kernel if choice is not None else None


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
    """A :class:`~disco.speculation.cost_model.CostModel` timed on the loaded models (not
    cached): both measured by :func:`measure_forward_costs` after ``prompt_len`` tokens of
    context, the target over 1..``max(ks) + 1`` new tokens, the draft over one, and turned
    into a cost model by :func:`to_cost_model`. ``k`` not in ``ks`` (default: all of
    0..``max_k``) is interpolated linearly."""
    ks = sorted(set(ks if ks is not None else range(max_k + 1)) | {0})
    target = measure_forward_costs(target_model, CostRequest(ks[-1] + 1, prompt_len, repeats), progress=False,
                                   name="target", sizes=[k + 1 for k in ks])
    draft = measure_forward_costs(draft_model, CostRequest(1, prompt_len, repeats), progress=False, name="draft")
    return replace(to_cost_model(target, draft, rtt), source=source,
                   extra={"repeats": repeats, "prompt_len": prompt_len, "timed_k": ks})


def costs_path(home: Path, fingerprint: str, engine: str, device: str, threads: int, *, forward: str,
               kernel: str | None = None) -> Path:
    """The cache file of one (model, engine, int4 kernel, device, threads, forward) combination:
    costs timed on another kernel or another forward (:func:`kernel_of`, :func:`forward_of`)
    are never read back."""
    engine = engine if kernel is None else f"{engine}-{kernel}"
    return home / COSTS_DIR / f"{fingerprint}-{engine}-{device.replace(':', '')}-t{threads}-{forward}.json"


def read_cached(home: Path, fingerprint: str, engine: str, device: str, threads: int,
                request: CostRequest | None = CostRequest(), *, forward: str | None,
                kernel: str | None = None) -> EngineCosts | None:
    """The cached costs of this combination if they cover ``request`` (``None``: whatever
    was measured), else ``None``. Reads files only (never builds, loads or times a kernel).

    Args:
        forward: the forward of the model as it runs now (:func:`forward_of`); ``None`` only
            where no model is at hand (an engine choice before loading, a benchmark reading the
            services' records): then the newest record of this combination, whatever forward
            timed it (the process that loads the model reads its own forward's).
        kernel: the int4 kernel the model runs (:func:`kernel_of`; without a model,
            :func:`cached_kernel`), ``None`` for a model without int4 layers.
    """
    forwards = FORWARDS if forward is None else (forward,)
    paths = [costs_path(home, fingerprint, engine, device, threads, forward=name, kernel=kernel) for name in forwards]
    records = []
    for path in paths:
        try:
            records.append(EngineCosts.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, InvalidRequest):
            continue
    if not records:
        return None
    costs = max(records, key=lambda record: record.measured_at)
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
    forward, kernel = forward_of(model), kernel_of(model)  # the forward that serves: its costs only
    key = (home, fingerprint, engine, device, threads)
    if (not force and (cached := read_cached(*key, request, forward=forward, kernel=kernel)) is not None
            and not worth_remeasuring(cached)):
        return cached
    with machine_lock(home) if lock else nullcontext():
        cached = None if force else read_cached(*key, request, forward=forward, kernel=kernel)  # measured meanwhile?
        if cached is not None and not worth_remeasuring(cached):
            return cached
        logger.info("measuring the forward costs of %s (%s, %s forward, %s, %d threads; once, cached in %s) ...",
                    name, engine, forward, device, threads, home / COSTS_DIR)
        if (load_average := _load_average()) >= (os.cpu_count() or 1):  # NOTE: this process's model load counts too
            logger.warning("the load average is %.1f: other processes share the cores, so the measured costs "
                           "may be too high (measure again with `disco models calibrate --force`)", load_average)
        costs = measure_forward_costs(model, request, progress, label=f"{name} ({engine})", name=name,
                                      fingerprint=fingerprint, engine=engine, device=device)
        if costs.provisional:
            logger.warning("the measured costs of %s are provisional (load average %.1f, repeats spread %.2fx): "
                           "they are measured again at a start on a quiet machine", name, costs.load_average,
                           costs.spread)
        path = costs_path(*key, forward=costs.forward, kernel=costs.kernel)
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
    """What is measured for a role: the target's forwards over 1..:data:`DEFAULT_TARGET_TOKENS`
    new tokens (every block up to the lookahead cap, plus the bonus position), the draft's
    cost per token."""
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


def to_cost_model(target: EngineCosts, draft: EngineCosts, rtt: float = 0.0) -> CostModel:
    """The one way from measured costs to a :class:`disco.speculation.cost_model.CostModel`:
    ``t_draft`` the draft's per-token cost, ``t_verify[k]`` the target forward over ``k + 1``
    new tokens (both records of :func:`measure_forward_costs`)."""
    return CostModel.from_forward_costs(draft.forward_s, target.forward_s, rtt,
                                        draft_prefill_s_per_token=draft.prefill_s / max(1, draft.context_tokens),
                                        source=f"engine costs: {target.model} / {draft.model}, {target.engine}, "
                                               f"{target.device}, {target.threads} threads")
