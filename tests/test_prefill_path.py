"""Prefill rows on the quantized kernel (:func:`disco.models.weight_only.choose_prefill_path`):
chosen at load only where the kernel measures clearly faster than the dense GEMM; then no prefill
span reaches a dense GEMM, the lean decoder (fused projections included) gives the HF forward's
bits on long prefills, and a prompt gets the same cache alone and batched."""

from __future__ import annotations

import pytest
import torch

from disco.engines import lean_decoder
from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward
from disco.engines.kv_pool import PoolCache
from disco.models import int4, weight_only
from disco.models.weight_only import DENSE_MIN_ROWS, WeightOnlyLinear, choose_prefill_path
from tests import tiny
from tests.test_lean_decoder import PROMPTS, assert_same, ops, q4q8_model  # noqa: F401 - ops is a fixture


def _timed(monkeypatch, dense_ms: float, kernel_ms: float) -> None:
    """The probe's clock: each dense call takes ``dense_ms``, each kernel call ``kernel_ms``
    (the probe alternates dense, kernel; a start and an end read each)."""
    durations = [dense_ms, kernel_ms] * 3
    reads = iter(value for duration in durations for value in (0.0, duration / 1e3))
    monkeypatch.setattr(weight_only, "_now", lambda device: next(reads))


def _linears(model: torch.nn.Module) -> list[WeightOnlyLinear]:
    return [module for module in model.modules() if isinstance(module, WeightOnlyLinear)]


def test_the_kernel_takes_prefills_only_where_it_is_clearly_faster(monkeypatch):
    model = q4q8_free_model(0)
    _timed(monkeypatch, dense_ms=10.0, kernel_ms=9.5)  # within the margin: a near-tie keeps the GEMMs
    line = choose_prefill_path(model)
    assert line.startswith("prefill rows in float32 GEMMs") and "kernel 9.50 ms" in line
    assert all(module.dense_dtype == torch.float32 for module in _linears(model))
    _timed(monkeypatch, dense_ms=10.0, kernel_ms=6.0)
    line = choose_prefill_path(model)
    assert line.startswith("prefill rows on the quantized kernel") and "float32 GEMM 10.00 ms, kernel 6.00 ms" in line
    assert all(module.dense_dtype is None for module in _linears(model))
    assert choose_prefill_path(tiny.qwen2(0)) is None  # no weight-only linears: nothing to choose


def q4q8_free_model(seed: int) -> torch.nn.Module:
    """A tiny int4 model on torch's kernel (no q4 x q8 build needed)."""
    from disco.models.quantize import quantize_model  # noqa: PLC0415

    return quantize_model(tiny.qwen2(seed), engine="int4")


def _never_dense(monkeypatch) -> None:
    def refused(self, rows):
        raise AssertionError("a prefill span reached the dense GEMM")

    monkeypatch.setattr(int4.Int4Linear, "_dense", refused)


def _prefill_caches(model: torch.nn.Module, prompts: list[list[int]]) -> list[PoolCache]:
    caches = [PoolCache.for_model(model, len(prompt) + 1) for prompt in prompts]
    packed_forward(model, [SessionRows(cache, 0, prompt, 0) for cache, prompt in zip(caches, prompts)])
    return caches


def _same_cache(a: PoolCache, b: PoolCache, length: int) -> bool:
    return all(torch.equal(x.keys[0, :, :length], y.keys[0, :, :length])
               and torch.equal(x.values[0, :, :length], y.values[0, :, :length]) for x, y in zip(a.layers, b.layers))


def test_kernel_prefills_give_the_hf_bits_and_the_same_cache_alone_and_batched(ops, monkeypatch):  # noqa: F811
    model = q4q8_model(7)
    for module in _linears(model):
        module.dense_dtype = None
    _never_dense(monkeypatch)
    long_prompt = [(11 * index) % 500 + 1 for index in range(DENSE_MIN_ROWS + 22)]
    lean = assert_same(model, [long_prompt, PROMPTS[0]], [1, 3])  # fused projections over the prefill too
    assert lean.fused
    prompts = [long_prompt, [(5 * index) % 400 + 2 for index in range(DENSE_MIN_ROWS + 5)], PROMPTS[1]]
    together = _prefill_caches(model, prompts)
    for prompt, cache in zip(prompts, together):
        assert _same_cache(_prefill_caches(model, [prompt])[0], cache, len(prompt))


def test_a_kernel_prefill_runs_the_fused_projections(ops, monkeypatch):  # noqa: F811
    """With dense GEMMs a long prefill takes the separate layers; on the kernel, the fused ones."""
    model = q4q8_model(8)
    assert lean_decoder_for(model).fused  # built (and checked) before the calls are counted
    calls = []
    real = lean_decoder._project
    monkeypatch.setattr(lean_decoder, "_project", lambda module, states: calls.append(module) or real(module, states))
    long_prompt = list(range(1, DENSE_MIN_ROWS + 10))
    _prefill_caches(model, [long_prompt])
    assert not calls  # dense spans: every projection through its parts, as HF calls them
    for module in _linears(model):
        module.dense_dtype = None
    _prefill_caches(model, [long_prompt])
    assert len(calls) == 4 * len(lean_decoder_for(model).blocks)  # wqkv, wo, w13, w2: one kernel call each


def test_info_says_how_a_loaded_engine_prefills(tiny_pair_dirs, tmp_path, monkeypatch):
    """``Info.prefill``: the path chosen at load (the kernel where it measured clearly faster),
    empty for engines without weight-only linears."""
    from disco.config import ModelConfig  # noqa: PLC0415
    from disco.engines.sessions import SessionLimits  # noqa: PLC0415
    from disco.models import loading  # noqa: PLC0415
    from disco.models.loading import load_model  # noqa: PLC0415
    from protos.convert import service_info_pb  # noqa: PLC0415

    monkeypatch.setattr(loading, "choose_dense_dtype", lambda model: "prefill GEMMs in float32 (not timed here)")
    _timed(monkeypatch, dense_ms=10.0, kernel_ms=6.0)
    loaded = load_model(ModelConfig(spec=str(tiny_pair_dirs["draft"]), dtype="int8"), "draft", tmp_path, progress=False)
    assert loaded.prefill == "kernel" == weight_only.prefill_path(loaded.model)
    assert service_info_pb("draft", loaded, 64, 0, SessionLimits(), 0).prefill == "kernel"
    for module in _linears(loaded.model):
        module.dense_dtype = torch.bfloat16
    assert weight_only.prefill_path(loaded.model) == "bfloat16 GEMM"
    dense = load_model(ModelConfig(spec=str(tiny_pair_dirs["draft"]), dtype="float32"), "draft", tmp_path,
                       progress=False)
    assert dense.prefill == "" and service_info_pb("draft", dense, 64, 0, SessionLimits(), 0).prefill == ""
