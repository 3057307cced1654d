"""At most one device-to-host transfer per draft token and per verification (issue 30, item 4).

On a GPU every value read back to the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``t.to("cpu")``) waits for the device.
The engines gather what the host needs into one tensor and move it with
:func:`disco.speculation.sampling.to_host`. These tests run the device-generic code on the
CPU with every such Tensor method counting its calls, and count each ``to_host`` call as one
transfer (calls made inside it are its own): each drafting step and each verification must
make at most one — greedy, sampled, with confidence signals, with DISCO features (hidden
state included).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from disco.config import SamplingParams
from disco.engines import draft as draft_module
from disco.engines.draft import DraftEngine
from disco.engines.target import TargetEngine
from disco.interfaces import DraftToken, Feedback
from disco.speculation import sampling as sampling_module
from disco.speculation.features import FeatureSpec
from disco.speculation.policies import PolicyFactory
from disco.speculation.policies.learned import DiscoPolicy
from disco.speculation.sampling import greedy_accept, invariant_verify, rejection_sample, sample
from tests.disco_fixtures import handmade_artifact

_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class TransferCounter:
    """Counts host reads of tensors; a ``to_host`` call counts as one, whatever it does inside."""

    def __init__(self) -> None:
        self.count = 0
        self.calls: list[str] = []
        self._inside = threading.local()

    def note(self, what: str) -> None:
        if not getattr(self._inside, "depth", 0) and threading.current_thread() is threading.main_thread():
            self.count += 1
            self.calls.append(what)

    @contextlib.contextmanager
    def choke_point(self):
        self.note("to_host")
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1


@pytest.fixture
def transfers(monkeypatch) -> TransferCounter:
    counter = TransferCounter()
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __original=original, __name=name, **kwargs):
            counter.note(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    original_to = torch.Tensor.to

    def counted_to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, str) and device.startswith("cpu"):
            counter.note("to('cpu')")
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    original_to_host = sampling_module.to_host

    def counted_to_host(values):
        with counter.choke_point():
            return original_to_host(values)

    monkeypatch.setattr(sampling_module, "to_host", counted_to_host)
    monkeypatch.setattr(draft_module, "to_host", counted_to_host)
    return counter


def _per_step_counts(monkeypatch, engine: DraftEngine, counter: TransferCounter) -> list[int]:
    """Wrap the drafting step: the transfers each step makes (the forward included)."""
    counts: list[int] = []
    original = DraftEngine._step

    def step(self, *args, **kwargs):
        before = counter.count
        result = original(self, *args, **kwargs)
        counts.append(counter.count - before)
        return result

    monkeypatch.setattr(DraftEngine, "_step", step)
    return counts


def _disco_factory(hidden: bool) -> PolicyFactory:
    spec = FeatureSpec(groups=("probs", "position", "block", "session", "hidden"), hidden_dims=4) if hidden \
        else FeatureSpec()
    artifact = handmade_artifact(spec, threshold=0.0, hidden_size=64)  # threshold 0: never stops early
    return PolicyFactory(lambda argument: (lambda: DiscoPolicy(artifact, 0.0)))


CASES = {
    "greedy": ("static:4", SamplingParams(max_new_tokens=32), None),
    "greedy+signals": ("confidence:0.0", SamplingParams(max_new_tokens=32), None),
    "sampled": ("static:4", SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=3), None),
    "sampled+signals": ("confidence:0.0", SamplingParams(max_new_tokens=32, temperature=0.8, seed=3), None),
    "greedy+disco": ("disco:x", SamplingParams(max_new_tokens=32), False),
    "sampled+disco+hidden": ("disco:x", SamplingParams(max_new_tokens=32, temperature=0.8, seed=3), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_transfer_per_draft_token(case, monkeypatch, transfers, target_model, tokenizer):
    policy, params, hidden = CASES[case]
    factory = _disco_factory(hidden) if hidden is not None else PolicyFactory()
    engine = DraftEngine(target_model, factory)
    if hidden:
        assert target_model.config.hidden_size == 64  # the hand-made projection's input size
    engine.start_session("s", tokenizer("def f(x):")["input_ids"], params, policy)
    counts = _per_step_counts(monkeypatch, engine, transfers)
    feedback = None
    for _ in range(3):  # three blocks: the feedback path (rollback, bonus token) included
        tokens = [event for event in engine.draft("s", feedback, 4) if isinstance(event, DraftToken)]
        assert tokens, "the block drafted nothing"
        for token in tokens:
            assert 0 <= token.token_id < target_model.config.vocab_size and 0 <= token.draft_prob <= 1
            # Sampled tokens are verified by their ids (drafter-invariant sampling): no distribution travels.
            assert token.draft_probs is None
        feedback = Feedback(num_accepted=len(tokens) // 2, next_token_id=tokens[0].token_id)
    assert len(counts) >= 6
    assert max(counts) <= 1, (case, counts, transfers.calls)
    engine.end_session("s")


@pytest.mark.parametrize("greedy", [True, False])
def test_one_transfer_per_verification(greedy, transfers, target_model, tokenizer):
    params = SamplingParams(max_new_tokens=32) if greedy else SamplingParams(max_new_tokens=32, temperature=1.0,
                                                                              seed=9)
    engine = TargetEngine(target_model)
    engine.start_session("t", tokenizer("def f(x):")["input_ids"], params)
    vocab = target_model.config.vocab_size
    for block in ([5, 6, 7], [], [9]):
        draft_probs = None if greedy else torch.softmax(torch.randn(len(block), vocab), -1)  # on the host, as sent
        before = transfers.count
        result = engine.verify("t", block, draft_probs)
        assert transfers.count - before <= 1, (block, transfers.calls)
        assert 0 <= result.num_accepted <= len(block)
    engine.end_session("t")


def test_sample_draws_what_multinomial_draws():
    """The sync-free sampler picks multinomial's token from the same random numbers, so
    seeded outputs are unchanged; and a block of k uniforms is k single draws."""
    for seed in range(200):
        probs = torch.softmax(torch.randn(300, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        first, second = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert int(torch.multinomial(probs, 1, generator=first)) == int(sample(probs, second))
        assert torch.equal(torch.rand((), generator=first), torch.rand((), generator=second))  # same state after
        singles = torch.stack([torch.rand((), generator=first) for _ in range(4)])
        assert torch.equal(singles, torch.rand(4, generator=second))


def test_target_only_sampling_is_multinomial():
    """k = 0 (a target-only step): the token multinomial draws from the target row."""
    target_probs = torch.softmax(torch.randn(1, 50), -1)
    for seed in range(50):
        expected = int(torch.multinomial(target_probs[0], 1, generator=torch.Generator().manual_seed(seed)))
        assert rejection_sample([], torch.empty(0, 50), target_probs, torch.Generator().manual_seed(seed)) == (
            0, expected)


def _loop_reference(draft_ids, draft_probs, target_probs, generator):
    """The previous implementation (a loop with a read-back per position), for comparison."""
    for position, token in enumerate(draft_ids):
        target_prob, draft_prob = target_probs[position, token], draft_probs[position, token]
        if draft_prob > 0 and torch.rand((), generator=generator) * draft_prob <= target_prob:
            continue
        residual = torch.clamp(target_probs[position] - draft_probs[position], min=0.0)
        total = residual.sum()
        recovered = residual / total if total > 0 else target_probs[position]
        return position, int(torch.multinomial(recovered, 1, generator=generator))
    return len(draft_ids), int(torch.multinomial(target_probs[len(draft_ids)], 1, generator=generator))


def test_rejection_sampling_matches_the_loop_where_it_draws_the_same_numbers():
    """Without a rejection before the block's last token both draw the same random numbers:
    the outcomes must be identical (elsewhere they draw different, equally distributed ones)."""
    vocab, k, compared = 12, 3, 0
    for seed in range(400):
        rng = torch.Generator().manual_seed(seed)
        target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=rng), -1)
        draft_probs = torch.softmax(torch.randn(k, vocab, generator=rng) * 0.3 + target_probs[:k].log(), -1)
        draft_ids = [int(torch.multinomial(draft_probs[i], 1, generator=rng)) for i in range(k)]
        reference = _loop_reference(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        if reference[0] < k - 1:
            continue
        compared += 1
        assert rejection_sample(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(seed)) == reference
    assert compared > 100


def test_greedy_accept_reads_back_once(transfers):
    logits = torch.randn(5, 20)
    argmax = logits.argmax(-1)
    before = transfers.count
    assert greedy_accept([int(t) for t in argmax[:2]] + [(int(argmax[2]) + 1) % 20], logits)[0] == 2
    assert transfers.count - before == 4  # the three int() above, and the one transfer inside


def test_invariant_verify_reads_back_once(transfers):
    probs = torch.softmax(torch.randn(4, 30), -1)
    before = transfers.count
    num_accepted, next_token = invariant_verify([1, 2, 3], probs, seed=5, first_position=10)
    assert transfers.count - before == 1 and 0 <= num_accepted <= 3 and 0 <= next_token < 30
