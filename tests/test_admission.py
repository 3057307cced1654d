"""Memory (issue 30, item 4): sessions admitted by KV-cache bytes with a clear
RESOURCE_EXHAUSTED and nothing left behind, the budget derived from the device's memory or
set by ``--max-kv-bytes``, and models loaded straight onto their device."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from disco.config import SamplingParams
from disco.engines import sessions as sessions_module
from disco.engines.draft import DraftEngine
from disco.engines.sessions import (CUDA_FREE_FRACTION, HOST_AVAILABLE_FRACTION, KvBudget, SessionLimits,
                                    SessionStore, derive_kv_budget, kv_bytes_per_token)
from disco.engines.target import TargetEngine
from disco.errors import InvalidRequest, ResourceExhausted, SessionNotFound
from disco.interfaces import DraftToken
from disco.speculation.policies import PolicyFactory
from disco_cli.commands.serve import parse_bytes
from disco_cli.launcher import ServiceOptions
from tests import tiny


def _expected_per_token(model) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    element = torch.empty(0, dtype=model.get_input_embeddings().weight.dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def test_bytes_per_token_follow_the_config_and_the_dtype(target_model):
    per_token = kv_bytes_per_token(target_model)
    assert per_token == _expected_per_token(target_model)
    wider = tiny.qwen2(seed=5, layers=3, kv_heads=4)
    assert kv_bytes_per_token(wider) == _expected_per_token(wider) == per_token * 3 * 4 // (2 * 2)
    half = tiny.qwen2(seed=5).to(torch.bfloat16)
    assert kv_bytes_per_token(half) == per_token // 2


def test_a_session_cache_holds_what_the_estimate_says(target_model):
    """The estimate is the bytes the engines' cache really holds per token."""
    from disco.engines.kv import CachedSequence  # noqa: PLC0415

    sequence = CachedSequence(target_model, list(range(1, 21)))
    sequence.prefill()
    held = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in sequence.cache.layers)
    assert held == sequence.cache_len * kv_bytes_per_token(target_model)


def _store(budget_tokens: int, per_token: int = 100, max_sessions: int = 8, clock=None) -> SessionStore:
    kv = KvBudget(budget_bytes=budget_tokens * per_token, bytes_per_token=per_token)
    limits = SessionLimits(max_sessions=max_sessions, idle_ttl_s=10.0)
    return SessionStore(limits, kv=kv) if clock is None else SessionStore(limits, clock=clock, kv=kv)


def test_refusal_names_the_bytes_and_leaves_nothing():
    store = _store(budget_tokens=100)
    store.reserve("a", 60)
    store.add("a", object())
    with pytest.raises(ResourceExhausted) as refused:
        store.reserve("b", 50)
    message = str(refused.value)
    assert "5000 bytes" in message and "6000 bytes are in use" in message and "budget is 10000 bytes" in message
    assert len(store) == 1 and store.kv_bytes_in_use == 6000
    store.reserve("b", 40)  # what fits is admitted, under the same id
    store.release("b")
    assert store.kv_bytes_in_use == 6000
    store.remove("a")
    assert store.kv_bytes_in_use == 0
    store.reserve("b", 100)
    with pytest.raises(ResourceExhausted):
        store.check_capacity(1)


def test_growth_is_admitted_up_to_the_budget():
    store = _store(budget_tokens=100)
    store.add("a", object(), tokens=50)
    store.add("b", object(), tokens=30)
    store.grow("a", 40)  # already covered: no-op
    store.grow("a", 70)
    assert store.kv_bytes_in_use == 100 * 100
    with pytest.raises(ResourceExhausted, match="budget is 10000 bytes"):
        store.grow("b", 31)
    assert store.kv_bytes_in_use == 100 * 100  # the refused growth kept the reservation as it was
    store.grow("gone", 10**9)  # an unknown session: nothing to grow (its own call reports it)


def test_pending_reservations_count_and_expiry_frees_bytes():
    now = [0.0]
    store = _store(budget_tokens=100, max_sessions=2, clock=lambda: now[0])
    store.reserve("a", 10)
    store.reserve("b", 10)
    with pytest.raises(ResourceExhausted, match="too many active sessions"):
        store.reserve("c", 1)
    with pytest.raises(InvalidRequest, match="already exists"):
        store.reserve("a", 1)
    store.add("a", object())
    store.add("b", object())
    now[0] = 100.0  # both idle past their ttl
    assert len(store) == 0 and store.kv_bytes_in_use == 0
    with pytest.raises(SessionNotFound):
        store.get("a")


def test_limits_refuse_a_negative_budget():
    with pytest.raises(InvalidRequest, match="max_kv_bytes"):
        SessionLimits(max_kv_bytes=-1)


def test_the_budget_derives_from_the_devices_memory(monkeypatch):
    assert derive_kv_budget(12345, "cpu") == (12345, "--max-kv-bytes")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1_000_000, 4_000_000))
    budget, source = derive_kv_budget(0, "cuda:0")
    assert budget == int(1_000_000 * CUDA_FREE_FRACTION) and "free" in source
    monkeypatch.setattr(sessions_module, "_host_available_bytes", lambda: 8_000_000)
    budget, source = derive_kv_budget(0, "cpu")
    assert budget == int(8_000_000 * HOST_AVAILABLE_FRACTION) and "available RAM" in source


def test_host_available_bytes_reads_memavailable():
    available = sessions_module._host_available_bytes()
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        text = meminfo.read()
    found = re.search(r"MemAvailable:\s+(\d+) kB", text)
    assert found and abs(available - int(found.group(1)) * 1024) < 0.2 * available


def test_target_engine_admits_by_kv_bytes(target_model):
    per_token = kv_bytes_per_token(target_model)
    engine = TargetEngine(target_model, SessionLimits(max_kv_bytes=per_token * 100))
    assert engine.sessions.kv.budget_bytes == per_token * 100
    engine.start_session("a", list(range(1, 11)), SamplingParams(max_new_tokens=60))  # 70 tokens reserved
    assert engine.sessions.kv_bytes_in_use == 70 * per_token
    with pytest.raises(ResourceExhausted, match=f"needs {50 * per_token} bytes"):
        engine.start_session("b", list(range(1, 11)), SamplingParams(max_new_tokens=40))
    assert engine.active_sessions() == 1 and engine.sessions.kv_bytes_in_use == 70 * per_token
    engine.start_session("b", list(range(1, 11)), SamplingParams(max_new_tokens=20))  # 30 fit
    # A verification past its reservation grows it, within the budget only.
    session = engine.sessions.get("b")
    session.sequence.tokens.extend([7] * 19)  # as if 19 tokens had been accepted: 29 of 30 reserved
    with pytest.raises(ResourceExhausted, match="KV cache budget exceeded"):
        engine.verify("b", [5, 6, 7], None)
    assert len(session.sequence) == 29  # the refused block left the session as it was
    engine.end_session("a")
    engine.verify("b", [5, 6, 7], None)
    assert engine.sessions.kv_bytes_in_use == 32 * per_token


def test_a_failed_prefill_releases_its_reservation(target_model, monkeypatch):
    engine = TargetEngine(target_model, SessionLimits(max_kv_bytes=kv_bytes_per_token(target_model) * 100))

    def broken(sequence):
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(engine.batcher, "prefill", broken)
    with pytest.raises(RuntimeError, match="prefill failed"):
        engine.start_session("a", [1, 2, 3], SamplingParams(max_new_tokens=10))
    assert engine.sessions.kv_bytes_in_use == 0 and engine.active_sessions() == 0


def test_draft_engine_admits_by_kv_bytes_and_grows_while_drafting(drafts):
    model = drafts["noisy"]
    per_token = kv_bytes_per_token(model)
    engine = DraftEngine(model, PolicyFactory(), SessionLimits(max_kv_bytes=per_token * 40))
    with pytest.raises(ResourceExhausted, match=f"needs {41 * per_token} bytes"):
        engine.start_session("big", list(range(1, 11)), SamplingParams(max_new_tokens=31), "static:4")
    assert engine.active_sessions() == 0 and engine.sessions.kv_bytes_in_use == 0
    engine.start_session("a", list(range(1, 11)), SamplingParams(max_new_tokens=2), "static:8")
    tokens = [event for event in engine.draft("a", None, 8) if isinstance(event, DraftToken)]
    assert len(tokens) == 8  # drafting past max_new_tokens: the reservation grew as the cache did
    assert engine.sessions.kv_bytes_in_use == (10 + 7) * per_token
    engine.end_session("a")
    assert engine.sessions.kv_bytes_in_use == 0


def test_max_kv_bytes_flag():
    assert [parse_bytes(text) for text in ("4096", "512K", "64M", "8G", "1.5GiB")] == [
        4096, 512 << 10, 64 << 20, 8 << 30, 3 << 29]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    options = ServiceOptions(max_kv_bytes=8 << 30)
    for role in ("draft", "target"):
        assert options.args(role)[options.args(role).index("--max-kv-bytes") + 1] == str(8 << 30)
    assert "--max-kv-bytes" not in options.args("orchestrator")
    assert "--max-kv-bytes" not in ServiceOptions().args("target")


def test_backend_servers_pass_the_flag_to_their_limits():
    from disco_cli.main import build_parser  # noqa: PLC0415

    args = build_parser().parse_args(["target-server", "--max-kv-bytes", "2G"])
    assert args.max_kv_bytes == 2 << 30
    assert build_parser().parse_args(["serve", "--max-kv-bytes", "1M"]).max_kv_bytes == 1 << 20


def test_models_load_straight_onto_their_device(monkeypatch):
    """A dense model for a GPU is built there by transformers (``device_map``), never in
    host memory first; on a CPU the plain call is kept."""
    from disco.models import loading  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained",
                        lambda location, **kwargs: calls.append(kwargs) or "model")
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", lambda location, **kwargs: "tokenizer")
    assert loading._load_hf("folder", torch.bfloat16, False, "cuda:1") == ("model", "tokenizer")
    loading._load_hf("folder", torch.float32, False, "cpu")
    assert calls == [{"dtype": torch.bfloat16, "device_map": "cuda:1", "use_kernels": False},
                     {"dtype": torch.float32, "use_kernels": False}]  # never a Hub kernel
