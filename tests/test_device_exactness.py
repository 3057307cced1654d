"""Exactness on the model's device, stated and watched (issue 30, items 1 and 3).

- Timers that mean device time: :mod:`disco.engines.device_clock` waits for a CUDA device
  (never for a CPU), and the engine-cost, packing-proof and weight-only timers read it.
- The quantized cache names the device kind its tensors are laid out for, and is refused
  for another.
- The decoding proof (:func:`disco.engines.packing_proof.prove_decoding`) runs on the model's
  device: a model whose linear is deliberately row-variant fails it, and the engine then
  says so (not proven, packing off); where row plans fix the kernels, the engine gives the
  model plans proven on its device and proves again.
- ``Info.exactness``, ``disco_exactness_proven`` / ``disco_exactness_info`` on ``/metrics`` and
  ``disco info`` carry the statement (real servers on loopback).

No CUDA here: the CUDA branches are driven through a monkeypatched ``torch.cuda.synchronize``
and a device-generic proof on the CPU.
"""

from __future__ import annotations

import copy
import json
import urllib.request

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

import draft_service.server
import target_service.server
from disco.engines import device_clock, engine_costs, packing_proof
from disco.engines.batching import ForwardBatcher
from disco.engines.packing_proof import exactness_for, prove_decoding, verdict_for
from disco.models import quantize, row_stable, weight_only
from disco.models.model_record import model_record
from disco.models.row_stable import RowStableLinear
from disco_cli.main import main
from protos.disco.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from protos.runtime.metrics import sample_value
from tests.grpc_fixtures import loaded, start_orchestrator

SESSIONS = 16


class _RowCountDependent(torch.nn.Module):
    """A linear whose result depends on the rows of the call (a kernel path switch no row
    plan can fix: it wraps the linear, so the plan's calls still see every row)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        out = self.linear(x)
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return out * (1 + 2 ** -6) if rows > 8 else out


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to(torch.bfloat16)


def _row_variant(model: torch.nn.Module) -> torch.nn.Module:
    broken = _bf16(model)
    broken.model.layers[0].mlp.down_proj = _RowCountDependent(broken.model.layers[0].mlp.down_proj)
    return broken


# --- timers ------------------------------------------------------------------------------

@pytest.fixture
def synchronized(monkeypatch):
    """The devices ``torch.cuda.synchronize`` was called with (it is replaced: no CUDA here)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(torch.device(device)))
    return calls


def test_the_device_clock_waits_for_cuda_and_never_for_a_cpu(synchronized):
    before = device_clock.now("cpu")
    device_clock.now(None), device_clock.now_ns(torch.device("cpu"))
    weight_only._now(torch.device("cpu"))
    assert synchronized == []
    assert device_clock.now(torch.device("cuda:1")) >= before
    device_clock.now_ns("cuda")
    weight_only._now(torch.device("cuda:0"))  # disco.models restates the rule (it may not import engines)
    assert synchronized == [torch.device("cuda:1"), torch.device("cuda"), torch.device("cuda:0")]


@pytest.fixture
def clock_reads(monkeypatch):
    """The devices :func:`device_clock.now` was read for, by every timer that imports it."""
    reads = []
    original = device_clock.now

    def now(device=None):
        reads.append(torch.device(device) if device is not None else None)
        return original(device)

    monkeypatch.setattr(device_clock, "now", now)
    return reads


def test_engine_cost_timers_read_the_device_clock_of_the_model(target_model, clock_reads):
    samples, prefill_s = engine_costs.time_forwards(target_model, context_tokens=8, sizes=[1, 3], repeats=2)
    assert prefill_s > 0 and all(len(seconds) == 2 and min(seconds) > 0 for seconds in samples.values())
    # the timed prefill, then each of 3 rounds x 2 sizes: a start and an end each
    assert clock_reads == [target_model.device] * 2 * (1 + 3 * 2)


def test_both_proofs_time_on_the_device_clock(target_model, clock_reads):
    model = _bf16(target_model)
    prove_decoding(model)
    packing_proof.prove_packing(model, 4)
    assert clock_reads == [model.device] * 4


def test_the_weight_only_prefill_timer_waits_for_the_model_device(target_model, monkeypatch):
    reads = []
    monkeypatch.setattr(weight_only, "_now", lambda device: reads.append(device) or 0.0)
    model = quantize.quantize_model(copy.deepcopy(target_model))
    weight_only.choose_dense_dtype(model, rows=8)
    assert reads == [torch.device("cpu")] * 12  # 3 rounds x 2 dtypes, a start and an end each


# --- the quantized cache, keyed by device kind -------------------------------------------

def test_the_quantized_cache_is_refused_for_another_device_kind(target_model, tmp_path):
    model = quantize.quantize_model(copy.deepcopy(target_model))
    folder = tmp_path / "cache"
    quantize.save_quantized(model, folder, {"fingerprint": "x"})
    manifest = json.loads((folder / quantize.MANIFEST_FILE).read_text())
    assert manifest["device"] == quantize.CACHE_DEVICE == "cpu"
    assert quantize.read_manifest(folder) is not None and quantize.read_manifest(folder, "cpu") is not None
    assert quantize.read_manifest(folder, "cuda") is None and quantize.read_manifest(folder, "cuda:1") is None
    with pytest.raises(ValueError, match="for cuda"):
        quantize.load_quantized(_skeleton(target_model), folder, device="cuda")
    loaded_back = quantize.load_quantized(_skeleton(target_model), folder)
    ids = torch.tensor([[5, 9, 13, 2]])
    assert torch.equal(loaded_back(input_ids=ids).logits, model(input_ids=ids).logits)
    # A cache written before the field: laid out for the CPU, the only device it could be written for.
    del manifest["device"]
    (folder / quantize.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert quantize.read_manifest(folder) is not None and quantize.read_manifest(folder, "cuda") is None


def _skeleton(model: torch.nn.Module) -> torch.nn.Module:
    with torch.device("meta"):  # as disco.models.loading builds it
        skeleton = AutoModelForCausalLM.from_config(model.config, dtype=quantize.COMPUTE_DTYPE)
    return quantize.quantized_skeleton(skeleton)


# --- the decoding proof on the model's device --------------------------------------------

def test_a_row_stable_model_is_proven_bit_exact_on_its_device(target_model):
    model = _bf16(target_model)
    row_stable.stabilize(model)
    exactness = prove_decoding(model)
    assert exactness.proven, exactness.statement
    assert exactness.statement.startswith(f"bit-exact on {model.device}: verified blocks of 2/5/9/21 tokens")
    assert model_record(model).row_plans in exactness.statement  # what the row plans are


def test_a_row_variant_linear_fails_the_proof_and_the_engine_says_so(target_model):
    """The row-variant linear is not fixable by a plan: the engine stabilises what it can,
    proves again, states "not proven" with the blocks that differed, and turns packing off."""
    model = _row_variant(target_model)
    assert row_stable.needs_plans(model)
    exactness = exactness_for(model)
    assert not exactness.proven
    assert exactness.statement.startswith(f"not proven on {model.device}: greedy output may differ from "
                                          "target-only on near-ties (verified blocks of 9/21 tokens")
    assert not row_stable.needs_plans(model)  # it did give the linears plans, on the model's device
    assert isinstance(model.model.layers[0].mlp.down_proj.linear, RowStableLinear)
    batcher = ForwardBatcher(model, SESSIONS)
    assert not batcher.packed and batcher.max_batch == 1 and batcher.verdict.detail.startswith("one by one")
    assert exactness_for(model) is exactness  # kept on the model: proven once


def test_where_row_plans_fix_the_kernels_the_engine_installs_them_and_proves_exactness(target_model, monkeypatch):
    """A kernel whose one-row calls take another path (what the bf16 CPU kernels of a Zen 4
    do, and what cuBLAS may do by row count): the first proof fails, the engine probes plans
    on the model's device (calls of 2 or more rows), and the second proof holds."""
    plain = torch.nn.functional.linear

    def one_row_path(x, weight, bias=None):  # x: [..., in] -> [..., out]
        out = plain(x, weight, bias)
        return out * (1 + 2 ** -6) if x.reshape(-1, x.shape[-1]).shape[0] == 1 else out

    monkeypatch.setattr(torch.nn.functional, "linear", one_row_path)
    model = _bf16(target_model)
    assert not prove_decoding(model).proven
    exactness = exactness_for(model)
    assert exactness.proven, exactness.statement
    assert isinstance(model.lm_head, RowStableLinear) and model.lm_head.row_plan.min_rows >= 2
    assert "row-stable linears (calls of " in exactness.statement
    assert verdict_for(model, SESSIONS).packed  # proven after the plans: packed forwards are exact too


def test_float32_is_stated_as_it_is(target_model):
    """Float32 GEMMs on this CPU are not row-invariant (~1e-6): the statement says so with the
    measured difference; nothing is changed (no row plans for float32)."""
    model = copy.deepcopy(target_model)
    exactness = exactness_for(model)
    assert not row_stable.needs_plans(model)
    if not exactness.proven:
        assert "near-ties" in exactness.statement and "from decoding's" in exactness.statement
    assert exactness.statement.split(":")[0] in ("bit-exact on cpu", "not proven on cpu")


# --- Info, /metrics and `disco info` -----------------------------------------------------

def _metrics(running) -> str:
    with urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=10) as page:
        return page.read().decode()


def test_the_services_state_exactness_in_info_and_metrics(target_model, tokenizer):
    proven, broken = _bf16(target_model), _row_variant(target_model)
    row_stable.stabilize(proven)
    for model, is_proven in ((proven, True), (broken, False)):
        for serve, stub in ((target_service.server.serve, target_pb2_grpc.TargetServiceStub),
                            (draft_service.server.serve, draft_pb2_grpc.DraftServiceStub)):
            running = serve(loaded(model, tokenizer, "tiny"), metrics_port=0)
            try:
                with grpc.insecure_channel(running.address) as channel:
                    info = stub(channel).Info(common_pb2.ServiceInfoRequest(), timeout=10)
                assert info.exactness == exactness_for(model).statement
                assert info.exactness.startswith("bit-exact on cpu" if is_proven else "not proven on cpu")
                assert info.batching.startswith("packed" if is_proven else "one by one"), info.batching
                text = _metrics(running)
                assert sample_value(text, "disco_exactness_proven") == float(is_proven)
                assert sample_value(text, "disco_exactness_info", {"statement": info.exactness}) == 1
            finally:
                running.stop(0)


def test_disco_info_shows_each_backends_exactness(target_model, tokenizer, capsys):
    target = target_service.server.serve(loaded(_row_variant(target_model), tokenizer, "tiny-broken"))
    draft_model = _bf16(target_model)
    row_stable.stabilize(draft_model)
    draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-draft"))
    orch = start_orchestrator(tokenizer, draft.address, target.address)
    try:
        assert main(["info", "--server", orch.address, "--json"]) == 0
        models = json.loads(capsys.readouterr().out)["models"]
        assert models["target"]["exactness"].startswith("not proven on cpu")
        assert models["draft"]["exactness"].startswith("bit-exact on cpu")
        assert main(["info", "--server", orch.address]) == 0
        lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
        assert f"exactness: {models['target']['exactness']}" in lines
        assert f"exactness: {models['draft']['exactness']}" in lines
    finally:
        for server in (orch, draft, target):
            server.stop(0)
