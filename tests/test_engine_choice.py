"""``--dtype auto`` on a CPU picks each role's engine by timing the candidates on the machine
(issue 28, item 4): the choice follows the measured costs, not the CPU flags; a candidate not
measured yet is loaded and timed once (cached); the entry point resolves it once."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

import disco.engines.engine_choice as engine_choice
from disco.config import ModelConfig
from disco.engines.engine_choice import CPU_CANDIDATES, choose_engine, typical_request_s
from disco.engines.engine_costs import EngineCosts, cached_kernel, costs_path, read_cached, request_for
from disco.models import q4q8
from disco.models.loading import model_fingerprint

#: The int4 kernel the records below were timed on (the machine's cached choice, see ``chosen_kernel``).
KERNEL = q4q8.TORCH_KERNEL


@pytest.fixture
def chosen_kernel(monkeypatch):
    """This machine's int4 kernel choice, as if cached: :data:`KERNEL` (whatever the CPU)."""
    monkeypatch.setattr(q4q8, "cached_choice", lambda home: q4q8.KernelChoice(KERNEL, "chosen in a test"))


def _padded(forward_ms: list[float]) -> list[float]:
    """A target's table over the sizes the choice reads (1..the lookahead cap + 1), extended
    linearly from its last two points."""
    sizes = request_for("target").max_new_tokens
    slope = forward_ms[-1] - forward_ms[-2] if len(forward_ms) > 1 else 0.0
    return [*forward_ms, *(forward_ms[-1] + slope * i for i in range(1, sizes - len(forward_ms) + 1))]


def _write_costs(home, fingerprint: str, engine: str, forward_ms: list[float], prefill_ms: float,
                 provisional: bool = False) -> EngineCosts:
    forward_ms = _padded(forward_ms) if len(forward_ms) > 1 else forward_ms
    costs = EngineCosts(model="tiny", fingerprint=fingerprint, engine=engine, device="cpu", forward="lean",
                        threads=torch.get_num_threads(), context_tokens=request_for("target").context_tokens,
                        forward_s=tuple(ms / 1000 for ms in forward_ms), prefill_s=prefill_ms / 1000, repeats=5,
                        torch_version=torch.__version__, measured_at=time.time(), load_average=4.0 if provisional
                        else 0.0, provisional=provisional, kernel=KERNEL if engine == "int4" else None)
    path = costs_path(home, fingerprint, engine, "cpu", torch.get_num_threads(), forward=costs.forward,
                      kernel=costs.kernel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs.to_json()))
    return costs


def _fingerprint(folder, home) -> str:
    return model_fingerprint(ModelConfig(spec=str(folder), dtype="int4"), "target", home)


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("choose_engine loaded a model although every candidate was measured")
    monkeypatch.setattr(engine_choice, "load_model", refuse)


AMX_LIKE = {"bfloat16": ([190] * 9, 450), "int4": ([55, 70, 85, 100, 115, 130, 145, 160, 175], 900),
            "int8": ([170, 185, 200, 215, 240, 260, 280, 300, 320], 1200)}


@pytest.mark.parametrize("costs, expected", [
    (AMX_LIKE, "int4"),  # int4's decode and short blocks win over bf16's flat verification
    ({**AMX_LIKE, "int4": ([150, 300, 450, 600, 750, 900, 1050, 1200, 1350], 900)}, "bfloat16"),  # int4 grows
    ({**AMX_LIKE, "int4": ([55] * 9, 60_000)}, "bfloat16"),  # a prefill too slow to pay for its decode
    ({"bfloat16": ([600] * 9, 40_000), "int4": ([90] * 9, 9_000), "int8": ([80] * 9, 8_000)}, "int8"),
])
def test_the_target_engine_with_the_fastest_typical_request_wins(tmp_path, tiny_pair_dirs, no_loading,
                                                                  chosen_kernel, costs, expected):
    fingerprint = _fingerprint(tiny_pair_dirs["target"], tmp_path)
    for engine, (forward_ms, prefill_ms) in costs.items():
        _write_costs(tmp_path, fingerprint, engine, forward_ms, prefill_ms)
    assert choose_engine("auto", str(tiny_pair_dirs["target"]), "target", "cpu", tmp_path) == expected
    timed = {engine: typical_request_s(read_cached(tmp_path, fingerprint, engine, "cpu", torch.get_num_threads(),
                                                   forward="lean", kernel=KERNEL if engine == "int4" else None),
                                       "target") for engine in costs}
    assert min(timed, key=timed.get) == expected


def test_the_draft_is_timed_per_token_and_explicit_or_cuda_engines_need_no_measurement(tmp_path, tiny_pair_dirs,
                                                                                          no_loading, chosen_kernel):
    fingerprint = _fingerprint(tiny_pair_dirs["draft"], tmp_path)
    _write_costs(tmp_path, fingerprint, "int4", [40], 2000)
    _write_costs(tmp_path, fingerprint, "int8", [30], 2500)  # 64 tokens: 1.92 + 2.5 s beats 2.56 + 2 s
    assert choose_engine("auto", str(tiny_pair_dirs["draft"]), "draft", "cpu", tmp_path) == "int8"
    assert choose_engine("auto", None, "draft", "cuda", tmp_path) == "bfloat16"
    assert choose_engine("bfloat16", None, "target", "cpu", tmp_path) == "bfloat16"


def test_a_candidate_not_measured_yet_is_loaded_timed_and_cached_once(tmp_path, tiny_pair_dirs, monkeypatch):
    spec = str(tiny_pair_dirs["draft"])
    chosen = choose_engine("auto", spec, "draft", "cpu", tmp_path, progress=False)
    assert chosen in CPU_CANDIDATES["draft"]
    fingerprint = _fingerprint(tiny_pair_dirs["draft"], tmp_path)
    for engine in CPU_CANDIDATES["draft"]:  # each timed through the engines' own forward path and cached
        cached = read_cached(tmp_path, fingerprint, engine, "cpu", torch.get_num_threads(), request_for("draft"),
                             forward=None, kernel=cached_kernel(tmp_path, engine, "cpu"))
        assert cached is not None and cached.engine == engine and cached.per_token_s > 0

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(engine_choice, "load_model", refuse)
    assert choose_engine("auto", spec, "draft", "cpu", tmp_path) == chosen  # the second start only reads


def test_the_cli_resolves_auto_once_at_the_entry_point(tiny_pair_dirs, monkeypatch, tmp_path, chosen_kernel):
    from disco_cli.commands.common import pair_config_from_args
    from disco_cli.main import build_parser

    monkeypatch.setenv("DISCO_HOME", str(tmp_path))
    models = ["--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"])]
    for role, (engine, forward_ms, prefill_ms) in {"target": ("int8", [1] * 9, 1), "draft": ("int4", [1], 1)}.items():
        fingerprint = _fingerprint(tiny_pair_dirs[role], tmp_path)
        for candidate in CPU_CANDIDATES[role]:  # the named engine measured fastest, the others slower
            factor = 1 if candidate == engine else 10
            _write_costs(tmp_path, fingerprint, candidate, [ms * factor for ms in forward_ms], prefill_ms * factor)
    args = build_parser().parse_args(["generate", "--prompt", "x", *models])
    assert args.dtype == "auto"  # the default
    pair = pair_config_from_args(args)
    assert (pair.target.dtype, pair.draft.dtype) == ("int8", "int4")
    assert pair.engine == "int8, draft int4"
    explicit = pair_config_from_args(build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "int8"]))
    assert explicit.target.dtype == explicit.draft.dtype == "int8"  # an explicit engine is both models'
    split = pair_config_from_args(build_parser().parse_args(
        ["generate", "--prompt", "x", "--dtype", "bfloat16", "--draft-dtype", "int4"]))
    assert (split.target.dtype, split.draft.dtype) == ("bfloat16", "int4")
    cuda = pair_config_from_args(build_parser().parse_args(["generate", "--prompt", "x", "--device", "cuda"]))
    assert cuda.target.dtype == "bfloat16"


def test_a_timing_taken_on_a_busy_machine_is_measured_again_once_quiet(tmp_path, tiny_pair_dirs, monkeypatch,
                                                                        chosen_kernel):
    """A candidate timed while other processes shared the cores (provisional) must not decide
    the engine for good: at a start on a quiet machine it is measured again."""
    import disco.engines.engine_costs as engine_costs

    fingerprint = _fingerprint(tiny_pair_dirs["draft"], tmp_path)
    _write_costs(tmp_path, fingerprint, "int4", [400], 2000, provisional=True)  # 10x too slow: a busy start
    int8 = _write_costs(tmp_path, fingerprint, "int8", [50], 300)
    measured = []

    def measure(spec, role, engine, device, home, progress):
        measured.append(engine)
        return replace(int8, engine=engine, forward_s=(0.02,), prefill_s=0.2)
    monkeypatch.setattr(engine_choice, "_measure", measure)
    monkeypatch.setattr(engine_costs, "_load_average", lambda: 3.0)  # still busy: the record stands
    assert choose_engine("auto", str(tiny_pair_dirs["draft"]), "draft", "cpu", tmp_path) == "int8"
    assert measured == []
    monkeypatch.setattr(engine_costs, "_load_average", lambda: 0.1)  # quiet now
    assert choose_engine("auto", str(tiny_pair_dirs["draft"]), "draft", "cpu", tmp_path) == "int4"
    assert measured == ["int4"]
