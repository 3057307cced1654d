"""The defects of the static path that issue 49 (item 6) lists, each with a test that failed
before its fix (eager on the CPU; CUDA-only checks skip without a GPU):

* a replayed step's logits are handed out as copies: the next replay does not change them;
* a refused packing verdict keeps batches off the static step (no slot is handed out);
* the lean decoder is built (and graphs captured) after the row plans, and the runner only runs
  the model's current decoder (an eager runner rebuilds its steps, a graphed one turns off);
* a bucket counts sessions: slots 0 and 15 run in the 2-row bucket, bit for bit the packed forward's;
* a slot's finalizer run by a garbage collection while the runner's lock is held does not deadlock;
* graphs are captured largest first into one pool, every graph writing one shared output buffer.
"""

from __future__ import annotations

import copy
import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from disco.config import SamplingParams
from disco.engines import batching, packing_proof, step_runner
from disco.engines.batching import ForwardBatcher
from disco.engines.kv import CachedSequence
from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward
from disco.engines.packing_proof import PackingVerdict
from disco.engines.sessions import SessionLimits
from disco.engines.kv_pool import PoolCache
from disco.engines.static_runner import static_runner_for
from disco.engines.static_step import Bucket, StaticCaches, StaticStep
from disco.engines.target import TargetEngine
from disco.engines.varlen_attention import ONE_CALL_CPU
from disco.models import q4q8, row_stable
from disco.models.int4 import Int4Linear
from disco.models.model_record import weights_changed
from disco.models.quantize import quantize_model
from tests import tiny

HOME = Path(os.environ.get("DISCO_HOME", "/tmp/disco_q4q8_tests"))
STATIC = SessionLimits(static_slots=4, static_capacity=256)
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 7, 7], [300, 2, 2, 77], list(range(40, 70))]
#: A hang guard, not a timing: a thread still alive after it has deadlocked.
HANG_GUARD_S = 60


@pytest.fixture(scope="module")
def bf16_model() -> torch.nn.Module:
    """bf16 under the CPU's row plans: the static step gives the packed forward's bits."""
    model = tiny.qwen2(11).to(torch.bfloat16)
    row_stable.stabilize(model)
    return model


def prefilled(model: torch.nn.Module, prompts: list[list[int]], slots: list[int],
              capacity: int = 128) -> tuple[list[PoolCache], StaticCaches]:
    """The prompts prefilled on the packed path (one-call plan) and loaded into ``slots``."""
    caches = [PoolCache.for_model(model, capacity) for _ in prompts]
    packed_forward(model, [SessionRows(c, 0, p, 0) for c, p in zip(caches, prompts)], ONE_CALL_CPU)
    static = StaticCaches(model, max(slots) + 1, capacity)
    for slot, cache, prompt in zip(slots, caches, prompts):
        static.load(slot, cache, len(prompt))
    return caches, static


class ReplayedOnCpu:
    """A CUDA graph's contract on a CPU: every replay runs the step again into the one static
    logits buffer (``logits``) that the graph owns, as :class:`step_runner.GraphedStep` replays."""

    def __init__(self, step: StaticStep, logits: torch.Tensor) -> None:
        self.step, self.logits = step, logits

    def replay(self) -> None:
        self.logits.copy_(self.step.compute())


# 1. The float32 read: a replay's logits are copies.

def test_a_replay_does_not_change_the_logits_an_earlier_replay_handed_out():
    model = tiny.qwen2(11)  # float32: the read was a view of the graph's output for this dtype
    _, caches = prefilled(model, PROMPTS[:2], slots=[0, 1])
    step = StaticStep(lean_decoder_for(model), caches, Bucket(2, 2), ONE_CALL_CPU)
    rows = caches.session_rows
    first_rows, second_rows = [rows(0, [3, 4]), rows(1, [5])], [rows(0, [9, 8]), rows(1, [6, 2])]
    expected = [logits.clone() for logits in step.forward(first_rows)]  # eager, the lengths not advanced
    graphed = step_runner.GraphedStep.__new__(step_runner.GraphedStep)  # its replay path, with a CPU graph
    graphed.step = step
    graphed.logits = step.compute().clone()  # [sessions, block, vocab]: the graph's static output
    graphed.graph = ReplayedOnCpu(step, graphed.logits)
    first = graphed.forward(first_rows)  # a waiting thread's logits ...
    second = graphed.forward(second_rows)  # ... and the batcher's next batch, replayed before it reads
    assert not torch.equal(second[0], expected[0][:2])
    for got, want in zip(first, expected):
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() != graphed.logits.untyped_storage().data_ptr()


# 2. The packing verdict gates the static path.

@pytest.mark.parametrize("packed", [False, True])
def test_a_refused_packing_verdict_keeps_batches_off_the_static_step(monkeypatch, packed):
    verdict = PackingVerdict(packed, "packed (a test's verdict)" if packed else "one by one (a test's verdict)")
    monkeypatch.setattr(batching, "verdict_for", lambda model, sessions: verdict)
    engine = TargetEngine(tiny.qwen2(11), STATIC)
    engine.start_session("a", PROMPTS[0], SamplingParams(max_new_tokens=8))
    engine.verify("a", [4, 5])
    engine.verify("a", [6])
    sequence = engine.sessions.get("a").sequence
    if packed:  # the control: this engine's steps take the static path where the verdict allows it
        assert sequence.cache.slot is not None and engine.static.steps
    else:
        assert sequence.cache.slot is None and not engine.static.steps
        assert not engine.static.can_run([sequence], [1], [False])
        assert "off: batching is not proven exact" in engine.static.describe()


# 3. Row plans before the lean decoder and the graphs; the runner runs the current decoder only.

@pytest.fixture
def int4_model() -> torch.nn.Module:
    """The q4 x q8 engine without row plans: its lean decoder fuses projections, so giving the
    linears row plans later makes it stale (a GPU model built outside ``load_model`` gets them
    in :func:`packing_proof.exactness_for`)."""
    if not q4q8.cpu_supports() or q4q8.load(HOME) is not None:
        pytest.skip("no q4 x q8 kernel on this CPU")
    model = quantize_model(tiny.qwen2(11), engine="int4")
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.use_kernel(q4q8.loaded_kernel())
    assert row_stable.needs_plans(model)
    return model


def test_the_static_path_is_built_over_the_row_plans_that_serve(monkeypatch, int4_model):
    proofs = []
    real = packing_proof.prove_decoding

    def first_fails(model, seed=0):  # as on a GPU: the first proof fails, row plans are probed, it passes
        proofs.append(model)
        if len(proofs) == 1:
            return packing_proof.Exactness(False, "not proven on cpu: a test's first proof")
        return real(model, seed)

    monkeypatch.setattr(packing_proof, "prove_decoding", first_fails)
    engine = TargetEngine(int4_model, STATIC)
    assert len(proofs) == 2 and not row_stable.needs_plans(int4_model)  # row plans were given at start
    assert engine.static.lean.fused and engine.static.lean.is_current()  # what the graphs would capture
    assert engine.static.lean is lean_decoder_for(int4_model)


def replace_a_projection(model: torch.nn.Module) -> None:
    """A new module in the model (what quantizing or new row plans do): its lean decoder is stale."""
    mlp = model.get_decoder().layers[0].mlp
    mlp.down_proj = copy.deepcopy(mlp.down_proj)
    weights_changed(model)  # what the models room says when it does either


def test_an_eager_runner_rebuilds_its_steps_over_the_model_s_current_decoder():
    model = tiny.qwen2(11)
    engine = TargetEngine(model, STATIC)
    engine.start_session("a", PROMPTS[0], SamplingParams(max_new_tokens=8))
    engine.verify("a", [4, 5])
    old = engine.static.lean
    replace_a_projection(model)
    assert not old.is_current()
    engine.verify("a", [6])
    assert engine.static.lean is not old and engine.static.lean.is_current()
    assert engine.static.lean is lean_decoder_for(model) and engine.static.steps


def test_a_graphed_runner_whose_decoder_changed_turns_off():
    model = tiny.qwen2(11)
    engine = TargetEngine(model, STATIC)
    engine.start_session("a", PROMPTS[0], SamplingParams(max_new_tokens=8))
    sequence = engine.sessions.get("a").sequence
    sequence.tokens.append(4)
    runner = engine.static
    assert runner.can_run([sequence], [1], [False])
    runner.graphed = True  # as on CUDA: its graphs replay the decoder they captured
    replace_a_projection(model)
    assert not runner.can_run([sequence], [1], [False])
    assert not runner.acquire(CachedSequence(model, [1, 2, 3], capacity=40), 8)
    assert "off: the model's lean decoder changed" in runner.describe()


def test_graphs_are_not_captured_over_a_stale_decoder():
    model = tiny.qwen2(11)
    runner = static_runner_for(model, 2, 64, "test")
    replace_a_projection(model)
    with pytest.raises(RuntimeError, match="not the model's current one"):
        runner.capture([Bucket(1, 1)])


# 4. Buckets count sessions.

def test_sessions_in_slots_0_and_15_run_in_the_two_session_bucket_with_the_packed_forward_s_bits(bf16_model):
    model = bf16_model
    runner = static_runner_for(model, 16, 128, "test")
    ForwardBatcher(model, 16, static=runner)  # the engine's batcher: its verdict turns the path on
    sequences = [CachedSequence(model, PROMPTS[i % 2], capacity=64) for i in range(16)]
    assert all(runner.acquire(sequence, 32) for sequence in sequences)
    kept = [sequences[0], sequences[15]]
    assert [sequence.cache.slot for sequence in kept] == [0, 15]
    del sequences  # slots 1-14 come back
    assert sorted(runner._free) == list(range(1, 15))
    references = [CachedSequence(model, PROMPTS[i], capacity=64, plan=ONE_CALL_CPU) for i in range(2)]
    blocks = [[21, 22, 23], [24]]
    for sequence, reference, block in zip(kept, references, blocks):
        for each in (sequence, reference):
            each.prefill()
            each.tokens.extend(block)
    counts = [len(block) + 1 for block in blocks]  # the last prompt token was pending
    assert runner.can_run(kept, counts, [False, False])
    runner.steps.clear()  # the start-up proof ran other buckets (issue 49 item 4)
    got = runner.run(kept, counts)
    assert list(runner.steps) == [Bucket(2, 4)]
    for (logits, _), reference, count in zip(got, references, counts):
        expected, _ = reference.forward(count)
        assert logits.shape == expected.shape and torch.equal(logits, expected)


def test_a_step_gathers_its_rows_slots_and_pads_in_slots_outside_the_batch(bf16_model):
    model = bf16_model
    caches_packed, caches = prefilled(model, PROMPTS, slots=[5, 0, 2])
    caches.runs[1].length = 120  # the shortest slots outside the batch take the padding: not slot 1
    step = StaticStep(lean_decoder_for(model), caches, Bucket(4, 2), ONE_CALL_CPU)
    blocks = [[1, 2], [3], [4, 5]]
    got = step.forward([caches.session_rows(slot, block) for slot, block in zip([5, 0, 2], blocks)])
    assert step.slots.tolist() == [5, 0, 2, 3]
    expected = packed_forward(model, [SessionRows(c, len(p), b, len(b)) for c, p, b in
                                      zip(caches_packed, PROMPTS, blocks)], ONE_CALL_CPU)
    for logits, (reference, _) in zip(got, expected):
        assert torch.equal(logits, reference)


# 5. A finalizer under the runner's lock.

def test_a_slot_freed_by_a_garbage_collection_under_the_runner_s_lock_does_not_deadlock():
    model = tiny.qwen2(11)
    runner = static_runner_for(model, 2, 64, "test")
    ForwardBatcher(model, 2, static=runner)
    errors: list[BaseException] = []

    def collect_under_the_lock() -> None:
        try:
            sequence = CachedSequence(model, [1, 2, 3], capacity=40)
            assert runner.acquire(sequence, 8)
            sequence.cycle = sequence  # only the cycle collector frees it
            with runner._lock:  # as inside run() or acquire()
                del sequence
                gc.collect()  # the slot's finalizer runs here
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    thread = threading.Thread(target=collect_under_the_lock, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the slot's finalizer waited for the runner's lock: deadlock"
    assert not errors
    assert sorted(runner._free) == [0, 1]  # the slot came back once the lock was free
    # A queued release of a slot taken again since then leaves the new owner's slot alone.
    first, second = (CachedSequence(model, [1, 2, 3], capacity=40) for _ in range(2))
    assert runner.acquire(first, 8) and runner.acquire(second, 8)
    slot = first.cache.slot
    with runner._lock:
        stale = runner._owners[slot]
    runner.release(slot)
    third = CachedSequence(model, [4, 5], capacity=40)
    assert runner.acquire(third, 8) and third.cache.slot == slot
    runner._freed(slot, stale)  # the first sequence's finalizer, late
    assert runner._free == [] and runner._owners[slot]() is third


# 6. Largest first, one pool, one output buffer.

class RecordedGraph:
    """:class:`step_runner.GraphedStep` on a CPU: records its capture (order, output buffer,
    pool) and replays by running the step into its view of the output buffer."""

    captured: list = []

    def __init__(self, step: StaticStep, output: torch.Tensor | None = None, pool=None) -> None:
        RecordedGraph.captured.append((step.bucket, output, pool))
        self.step = step
        self.logits = step_runner.logits_into(step, output)

    def forward(self, rows: list[SessionRows]) -> list[torch.Tensor]:
        self.step.fill(rows)
        step_runner.logits_into(self.step, self.logits.view(-1, self.logits.shape[-1]))
        return self.step.read(self.logits, rows)


def test_graphs_are_captured_largest_first_into_one_output_buffer(monkeypatch, bf16_model):
    model = bf16_model
    monkeypatch.setattr(step_runner, "GraphedStep", RecordedGraph)
    monkeypatch.setattr(RecordedGraph, "captured", [])
    lean = lean_decoder_for(model)
    caches = StaticCaches(model, 4, 128)
    buckets = [Bucket(1, 1), Bucket(4, 8), Bucket(2, 4), Bucket(2, 1)]
    graphed, report = step_runner.capture_buckets([StaticStep(lean, caches, bucket, ONE_CALL_CPU)
                                                   for bucket in buckets])  # before any slot holds a session
    packed, _ = prefilled(model, PROMPTS[:2], slots=[0, 1])
    for slot, (cache, prompt) in enumerate(zip(packed, PROMPTS[:2])):
        caches.load(slot, cache, len(prompt))
    order = [bucket for bucket, _, _ in RecordedGraph.captured]
    assert order == [Bucket(4, 8), Bucket(2, 4), Bucket(2, 1), Bucket(1, 1)]
    outputs = {id(output) for _, output, _ in RecordedGraph.captured}
    assert len(outputs) == 1 and report.graphs == 4 and report.memory_bytes == 0  # nothing reserved off CUDA
    output = RecordedGraph.captured[0][1]
    assert output.shape == (32, model.config.vocab_size) and output.dtype == torch.bfloat16
    for graph in graphed.values():
        assert graph.logits.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
    # Replays share the buffer: a second bucket's replay leaves the first one's logits alone.
    rows = [caches.session_rows(0, [3, 4]), caches.session_rows(1, [5])]
    expected = StaticStep(lean, caches, Bucket(2, 4), ONE_CALL_CPU).forward(rows)
    first = graphed[Bucket(2, 4)].forward(rows)
    graphed[Bucket(4, 8)].forward([caches.session_rows(1, [7] * 8), caches.session_rows(0, [9])])
    for got, want in zip(first, expected):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_share_one_pool_and_output_and_report_the_reserved_memory():
    model = tiny.qwen2(11).to("cuda", torch.bfloat16)
    row_stable.stabilize_norms(model)
    row_stable.stabilize(model)
    lean = lean_decoder_for(model)
    from disco.engines.varlen_attention import ONE_CALL_CUDA  # noqa: PLC0415

    caches = StaticCaches(model, 4, 128)
    buckets = [Bucket(1, 1), Bucket(2, 4), Bucket(4, 8)]
    graphed, report = step_runner.capture_buckets([StaticStep(lean, caches, b, ONE_CALL_CUDA) for b in buckets])
    assert report.graphs == 3 and report.memory_bytes > 0
    pointers = {graph.logits.untyped_storage().data_ptr() for graph in graphed.values()}
    assert len(pointers) == 1
    pools = {graph.pool for graph in graphed.values()}
    assert len(pools) == 1
    caches_packed = [PoolCache.for_model(model, 128) for _ in PROMPTS[:2]]
    packed_forward(model, [SessionRows(c, 0, p, 0) for c, p in zip(caches_packed, PROMPTS[:2])], ONE_CALL_CUDA)
    for slot, (cache, prompt) in enumerate(zip(caches_packed, PROMPTS[:2])):
        caches.load(slot, cache, len(prompt))
    rows = [caches.session_rows(0, [3, 4]), caches.session_rows(1, [5])]
    eager = StaticStep(lean, caches, Bucket(2, 4), ONE_CALL_CUDA).forward(rows)
    first = graphed[Bucket(2, 4)].forward(rows)
    graphed[Bucket(4, 8)].forward([caches.session_rows(1, [7] * 8), caches.session_rows(0, [9])])
    for got, want in zip(first, eager):
        assert torch.equal(got, want)
