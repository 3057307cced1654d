"""CUDA tests (``pytest -m gpu``): the tiny random models on a CUDA device.

Written to run on a CUDA machine; without one every test here is skipped with the reason
(they are collected by the default run too, and skip there). Each builds its models on
``cuda`` from the session's tiny CPU models (float32 unless it says otherwise).
"""

import copy
import json

import pytest
import torch

from disco.config import ModelConfig, SamplingParams, SpeculationConfig
from disco.engines.kv import CachedSequence
from disco.models import row_stable
from disco.models.hub_kernels import ENV_VAR
from disco.models.loading import load_model
from disco_cli.doctor_checks import generate_concurrently
from disco_cli.main import main
from tests.helpers import PROMPTS, local_generator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"),
]

DEVICE = "cuda"
MAX_NEW_TOKENS = 24


def on_cuda(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return copy.deepcopy(model).to(device=DEVICE, dtype=dtype).eval()


@pytest.fixture(scope="module")
def cuda_pair(target_model, drafts):
    """The tiny target and its noisy copy (mixed acceptance) on the CUDA device."""
    return on_cuda(target_model), on_cuda(drafts["noisy"])


def greedy(max_new_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def test_greedy_speculative_output_equals_target_only_on_cuda(cuda_pair, tokenizer):
    target, draft = cuda_pair
    generator = local_generator(target, draft, tokenizer)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        reference = generator.generate(ids, greedy(), SpeculationConfig(policy="none")).token_ids
        assert len(set(reference)) > 8  # varied output: a broken verification would show
        for policy in ("static:1", "static:4", "heuristic:2", "confidence:0.4"):
            result = generator.generate(ids, greedy(), SpeculationConfig(policy=policy))
            assert result.token_ids == reference, (prompt, policy)
            assert result.stats.draft_tokens > 0


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_under_load_on_cuda(cuda_pair, tokenizer):
    """The sampler's generators live on the model's device (torch.multinomial needs that),
    and a seeded request is reproducible, also among 7 other sampled requests."""
    target, draft = cuda_pair
    generator = local_generator(target, draft, tokenizer)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    first = generator.generate(ids, sampling, SpeculationConfig(policy="static:4")).token_ids
    assert generator.generate(ids, sampling, SpeculationConfig(policy="static:4")).token_ids == first
    others = [(tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"], SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True), "static:4")
        for i in range(7)]
    loaded = generate_concurrently(generator, [(ids, sampling, "static:4"), *others])
    assert loaded[0].token_ids == first
    other_seed = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=8, ignore_eos=True)
    assert generator.generate(ids, other_seed, SpeculationConfig(policy="static:4")).token_ids != first


@pytest.mark.parametrize("engine", ["int8", "int4"])
def test_int8_and_int4_on_cuda_are_refused_naming_the_engines_that_run_there(capsys, tiny_pair_dirs, engine):
    code = main(["generate", "--target", str(tiny_pair_dirs["target"]), "--draft", str(tiny_pair_dirs["draft"]),
                 "--device", DEVICE, "--dtype", engine, "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"the {engine} engine runs on a CPU only" in err and "bfloat16 or float32" in err


def test_a_packed_batch_of_8_sessions_gives_each_its_solo_forward_on_cuda(cuda_pair, tokenizer):
    """One packed forward of 8 sessions (prefixes of different lengths, blocks of 1-8
    tokens) gives each session its solo logits; 8 concurrent greedy requests through the
    engines' batcher equal target-only run alone."""
    target, draft = cuda_pair
    generator_ = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prefixes = [torch.randint(1, vocab, (3 + 5 * i,), generator=generator_).tolist() for i in range(8)]
    blocks = [torch.randint(1, vocab, (1 + i,), generator=generator_).tolist() for i in range(8)]

    def sessions():
        made = []
        for prefix, block in zip(prefixes, blocks):
            sequence = CachedSequence(target, prefix)
            sequence.prefill()
            sequence.tokens.extend(block)
            made.append(sequence)
        return made

    alone = [sequence.forward(sequence.num_pending)[0] for sequence in sessions()]
    batch = sessions()
    together = CachedSequence.forward_batch(batch, [s.num_pending for s in batch], [False] * len(batch))
    for (logits, _), expected in zip(together, alone):
        assert logits.device.type == "cuda"
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

    generator = local_generator(target, draft, tokenizer)
    prompt_ids = [tokenizer(PROMPTS[i % len(PROMPTS)] + str(i))["input_ids"] for i in range(8)]
    reference = [generator.generate(ids, greedy(16), SpeculationConfig(policy="none")).token_ids for ids in prompt_ids]
    generator.verifier.batcher.batch_sizes = []
    concurrent = generate_concurrently(generator, [(ids, greedy(16), "static:4") for ids in prompt_ids])
    assert [result.token_ids for result in concurrent] == reference
    assert max(generator.verifier.batcher.batch_sizes) >= 2  # the sessions did share forwards


def test_disco_doctor_passes_on_cuda(capsys, tiny_pair_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("DISCO_HOME", str(tmp_path / "home"))
    code = main(["doctor", "--device", DEVICE, "--json", "--target", str(tiny_pair_dirs["target"]),
                 "--draft", str(tiny_pair_dirs["draft"])])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 0 and report["ok"], json.dumps([c for c in report["checks"] if not c["ok"]], indent=1)
    assert report["checks"][0]["name"] == "device" and report["checks"][0]["capability"]
    assert report["checks"][1]["checked"] == ["float32", "bfloat16"]  # float16 is refused on CUDA
    assert {c["name"] for c in report["checks"]} >= {"costs", "greedy-alone", "greedy-batched", "sampled"}


# --- bf16, the CUDA default engine, under live load (the first GPU run's failure) ---------

#: Mixed lookaheads: short and long blocks, fixed and adaptive, in one live batch.
MIXED_POLICIES = ("static:1", "static:4", "static:8", "heuristic:2", "confidence:0.4", "none")


@pytest.fixture(scope="module")
def cuda_bf16_pair(target_model, drafts):
    return on_cuda(target_model, torch.bfloat16), on_cuda(drafts["noisy"], torch.bfloat16)


def mixed_prompts(tokenizer, sessions: int) -> list[list[int]]:
    """Prompts of many lengths (a few tokens to ~100): caches across several 64-key granules."""
    return [tokenizer(PROMPTS[i % len(PROMPTS)] * (1 + i % 4) + str(i) * (i % 5))["input_ids"]
            for i in range(sessions)]


@pytest.mark.parametrize("sessions", [8, 16])
def test_bf16_greedy_under_load_equals_target_only_alone_on_cuda(cuda_bf16_pair, tokenizer, sessions):
    target, draft = cuda_bf16_pair
    generator = local_generator(target, draft, tokenizer)
    assert generator.verifier.batcher.packed, generator.verifier.batcher.verdict.detail
    prompts = mixed_prompts(tokenizer, sessions)
    reference = [generator.generate(ids, greedy(32), SpeculationConfig(policy="none")).token_ids for ids in prompts]
    assert all(len(set(tokens)) > 8 for tokens in reference)
    generator.verifier.batcher.batch_sizes = []
    jobs = [(ids, greedy(32), MIXED_POLICIES[i % len(MIXED_POLICIES)]) for i, ids in enumerate(prompts)]
    concurrent = generate_concurrently(generator, jobs)
    wrong = [i for i, (result, expected) in enumerate(zip(concurrent, reference)) if result.token_ids != expected]
    assert not wrong, f"{len(wrong)}/{sessions} differ from target-only alone: {[jobs[i][2] for i in wrong]}"
    assert max(generator.verifier.batcher.batch_sizes) >= 4  # the sessions did share forwards


@pytest.mark.parametrize("sessions", [8, 16])
def test_bf16_seeded_sample_is_the_same_alone_and_among_others_on_cuda(cuda_bf16_pair, tokenizer, sessions):
    target, draft = cuda_bf16_pair
    generator = local_generator(target, draft, tokenizer)
    prompts = mixed_prompts(tokenizer, sessions)

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)

    alone = [generator.generate(ids, sampled(7 + i), SpeculationConfig(policy="static:4")).token_ids
             for i, ids in enumerate(prompts[:2])]
    jobs = [(ids, sampled(7 + i), MIXED_POLICIES[i % (len(MIXED_POLICIES) - 1)]) for i, ids in enumerate(prompts)]
    jobs[1] = (prompts[1], sampled(8), "static:4")
    jobs[0] = (prompts[0], sampled(7), "static:4")
    loaded = generate_concurrently(generator, jobs)
    assert [loaded[0].token_ids, loaded[1].token_ids] == alone


def test_a_saved_folder_loads_onto_cuda_offline_without_hub_kernels(tiny_pair_dirs, tmp_path, monkeypatch):
    """The path that failed on the first GPU run: ``from_pretrained`` with ``device_map`` on CUDA,
    where transformers swaps Hub kernels in unless told not to (no network here either)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(ModelConfig(spec=str(tiny_pair_dirs["target"]), dtype="bfloat16", device=DEVICE),
                        "target", tmp_path)
    assert next(loaded.model.parameters()).device.type == "cuda"
    assert not loaded.model.use_kernels
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, row_stable.RowStableLinear) for m in linears)
    sequence = CachedSequence(loaded.model, [1, 2, 3])
    logits, _ = sequence.forward(3)
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_decoder_runs_on_cuda_with_the_hf_forward_s_bits(target_model, dtype):
    """The lean decode path on CUDA (issue 39): the model's check passes there (else it would
    fall back to the HF forward), and packed forwards — a prefill, decoding, a 4-token block,
    two sessions at once — give the HF forward's logits bit for bit (the one-call attention plan)."""
    from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward, supports_packing
    from disco.engines.kv_pool import PoolCache

    model = on_cuda(target_model, dtype)
    if dtype != torch.float32:
        row_stable.stabilize_norms(model)
        row_stable.stabilize(model)
    assert supports_packing(model)
    lean = lean_decoder_for(model)
    assert lean is not None, "the lean decoder's check failed on CUDA (see the log)"
    prompts = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 77, 9, 9]]

    def run(forward) -> list[torch.Tensor]:
        caches = [PoolCache.for_model(model, 32) for _ in prompts]
        packed_forward(model, [SessionRows(c, 0, p[:-1], 0) for c, p in zip(caches, prompts)], lean=forward)
        lengths = [len(p) - 1 for p in prompts]
        out = []
        for tokens in ([[41], [9]], [[7, 8, 9, 10], [11]]):
            rows = [SessionRows(c, n, t, len(t)) for c, n, t in zip(caches, lengths, tokens)]
            out.extend(logits for logits, _ in packed_forward(model, rows, lean=forward))
            lengths = [n + len(t) for n, t in zip(lengths, tokens)]
        return out

    for got, expected in zip(run(lean), run(False)):
        assert torch.equal(got, expected)


def test_static_step_graphs_replay_the_eager_step_s_bits_on_cuda(target_model):
    """Issue 40: the static step of a bucket, captured as a CUDA graph, gives the eager step's
    logits bit for bit, and both give the packed forward's under the CUDA one-call plan."""
    from disco.engines.step_runner import capture_buckets
    from disco.engines.packed_forward import SessionRows, lean_decoder_for, packed_forward, supports_packing
    from disco.engines.kv_pool import PoolCache
    from disco.engines.static_step import Bucket, StaticCaches, StaticStep
    from disco.engines.varlen_attention import ONE_CALL_CUDA

    model = on_cuda(target_model, torch.bfloat16)
    row_stable.stabilize_norms(model)
    row_stable.stabilize(model)
    assert supports_packing(model)
    lean = lean_decoder_for(model)
    assert lean is not None
    buckets = [Bucket(1, 1), Bucket(2, 4), Bucket(4, 8)]
    eager_caches, graph_caches = StaticCaches(model, 4, 128), StaticCaches(model, 4, 128)
    graphed, report = capture_buckets([StaticStep(lean, graph_caches, bucket, ONE_CALL_CUDA) for bucket in buckets])
    assert report.graphs == 3 and set(graphed) == set(buckets)
    prompts = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 2, 77, 9, 9, 9, 9, 1]]
    packed_caches = [PoolCache.for_model(model, 128) for _ in prompts]
    packed_forward(model, [SessionRows(c, 0, p, 0) for c, p in zip(packed_caches, prompts)], ONE_CALL_CUDA)
    for slot, (cache, prompt) in enumerate(zip(packed_caches, prompts)):
        eager_caches.load(slot, cache, len(prompt))
        graph_caches.load(slot, cache, len(prompt))
    for bucket, blocks in ((buckets[0], [[4]]), (buckets[1], [[1, 2, 3], [4]]), (buckets[2], [[7] * 8, [1, 2]])):
        eager = StaticStep(lean, eager_caches, bucket, ONE_CALL_CUDA).forward(
            [eager_caches.session_rows(slot, block) for slot, block in enumerate(blocks)])
        replayed = graphed[bucket].forward([graph_caches.session_rows(slot, block) for slot, block in enumerate(blocks)])
        packed = [logits for logits, _ in packed_forward(
            model, [SessionRows(c, len(p), b, len(b)) for c, p, b in zip(packed_caches, prompts, blocks)],
            ONE_CALL_CUDA)]
        for cache, block in zip(packed_caches, blocks):
            cache.crop(-len(block))
        for got, expected, reference in zip(replayed, eager, packed):
            assert torch.equal(got, expected) and torch.equal(expected, reference), bucket


def test_engines_on_the_static_path_with_cuda_graphs_give_target_only_tokens(cuda_bf16_pair, tokenizer):
    """Issue 40: draft and target engines whose sessions step through captured CUDA graphs
    (``--static-slots``) give the packed engines' target-only tokens, alone and 8 at once."""
    from disco.engines.draft import DraftEngine
    from disco.engines.in_process import make_decode
    from disco.engines.sessions import SessionLimits
    from disco.engines.target import TargetEngine
    from disco.speculation.loop import SpeculativeGenerator
    from disco.speculation.policies import PolicyFactory
    from tests.helpers import EOS_ID, generate_at_once

    target, draft = (copy.deepcopy(model) for model in cuda_bf16_pair)
    for model in (target, draft):
        row_stable.stabilize_norms(model)
        row_stable.stabilize(model)
    limits = SessionLimits(static_slots=4, static_capacity=256)
    static = SpeculativeGenerator(DraftEngine(draft, PolicyFactory(), limits), TargetEngine(target, limits),
                                  make_decode(tokenizer), (EOS_ID,))
    assert static.verifier.static.graphed and static.drafter.static.graphed
    for engine in (static.verifier, static.drafter):  # the start-up proof ran through the graphs and kept them on
        assert engine.static.refused is None and engine.static.proof.batching_exact, engine.static.describe()
    packed = local_generator(target, draft, tokenizer)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    reference = packed.generate(ids, greedy(), SpeculationConfig(policy="none")).token_ids
    for policy in ("none", "static:1", "static:4", "heuristic:2"):
        assert static.generate(ids, greedy(), SpeculationConfig(policy=policy)).token_ids == reference, policy
    jobs = [(tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"], policy)
            for i, policy in enumerate(["none", "static:4", "heuristic:2", "static:2"] * 2)]
    solo = [packed.generate(job_ids, greedy(), SpeculationConfig(policy=policy)).token_ids for job_ids, policy in jobs]
    assert generate_at_once(static, jobs, greedy()) == solo
