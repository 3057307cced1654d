"""The static path proves at engine start what the packed path's proofs prove (issue 49, item 4).

A session on the static path (:mod:`disco.engines.static_runner`) prefills through the packed
forward into its slot, then runs every decoding and verification step as a bucket of the static
step: eagerly on a CPU, by replaying the bucket's CUDA graph on a GPU. The packed path's start-up
proofs (:mod:`disco.engines.packing_proof`) run the packed forward only, so they say nothing of
the kernels, shapes and padding a slotted session meets. :func:`prove_static` runs the runner
itself (its steps as they serve: the graphs where captured) and compares bit for bit:

1. **A verified block equals decoding**: a synthetic stream decoded one token at a time in a slot,
   against its prefixes of :data:`~disco.engines.packing_proof.PROOF_BLOCKS` tokens verified as
   one step each (greedy exactness rests on it, as on the packed path).
2. **Either path, the same bits**: a session prefilled and stepped in a slot against the same
   tokens on the packed forward in the runner's attention plan (a session may take either path
   from one forward to the next: prefills, hidden states and slotless sessions run packed).
3. **A bucket changes no bits**: sessions of different lengths and blocks in one step (a bucket
   with padding rows) against each of them alone.

Where a comparison fails, or the proof itself fails, the runner turns the static path off
(sessions take the packed path: exact, as proven there) and says why in its description, which
``Info.batching`` and ``/metrics`` (``disco_forward_batching_info``) report.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from disco.engines.kv import CachedSequence
from disco.engines.packing_proof import PROOF_BLOCKS, Exactness
from disco.engines.static_step import BLOCK_BUCKETS

logger = logging.getLogger(__name__)

#: Check 2: the prompt prefilled, then a step of its last token and these blocks (within the stream).
PREFILL_TOKENS = 12
FOLLOWING_BLOCKS = (3, 6)
#: Check 3: (history tokens prefilled, block) per session; three of them make a bucket of four
#: with a padding row where the slots allow it.
BUCKET_SESSIONS = ((9, 3), (30, 1), (17, 5))


@dataclass(frozen=True)
class StaticProof:
    """What the static path gave, bit for bit (module doc).

    Attributes:
        batching_exact: checks 2 and 3 held (or the model is float32, exempt as on the packed
            path: its batched rows are within ~1e-6 of solo rows): the path may serve.
        decoding_exact: check 1 held: greedy output on this path equals target-only (else, as
            on the packed path, stated as not proven).
        detail: one line for the runner's description.
    """

    batching_exact: bool
    decoding_exact: bool
    detail: str


class _Slots:
    """Sequences taken into the runner's slots during the proof, all given back at the end."""

    def __init__(self, runner) -> None:  # a disco.engines.static_runner.StaticRunner (it imports this module)
        self.runner, self.taken = runner, []

    def sequence(self, tokens: Sequence[int]) -> CachedSequence:
        sequence = CachedSequence(self.runner.lean.model, tokens, capacity=len(tokens) + BLOCK_BUCKETS[-1] + 1)
        if not self.runner.acquire(sequence, len(tokens) + 1):
            raise RuntimeError("no slot was free for the proof")
        self.taken.append(sequence)
        return sequence

    def give_back(self) -> None:
        for sequence in self.taken:
            self.runner.release(sequence.cache.slot)
        self.taken.clear()


def _step(runner, sequences: Sequence[CachedSequence], counts: Sequence[int]) -> list[torch.Tensor]:
    return [logits for logits, _ in runner.run(sequences, counts)]


def _prefill(sequence: CachedSequence) -> None:
    """What the batcher does with a slotted session's prompt: one packed forward into its slot."""
    CachedSequence.forward_batch([sequence], [0], [False])


def _blocks_equal_decoding(runner, slots: _Slots, stream: Sequence[int]) -> str | None:
    decoding = slots.sequence(stream[:1])
    decoded = _step(runner, [decoding], [1])
    for token in stream[1:]:
        decoding.tokens.append(token)
        decoded.extend(_step(runner, [decoding], [1]))
    slots.give_back()
    decoded_logits = torch.cat(decoded)  # [len(stream), vocab]
    wrong = []
    for size in PROOF_BLOCKS:
        verified = _step(runner, [slots.sequence(stream[:size])], [size])[0]  # [size, vocab]
        slots.give_back()
        if not torch.equal(verified, decoded_logits[:size]):
            wrong.append(size)
    return f"verified blocks of {'/'.join(map(str, wrong))} tokens differ from decoding" if wrong else None


def _same_as_packed(runner, slots: _Slots, stream: Sequence[int]) -> str | None:
    model = runner.lean.model
    packed = CachedSequence(model, stream[:PREFILL_TOKENS], capacity=len(stream) + 1, plan=runner.plan)
    slotted = slots.sequence(stream[:PREFILL_TOKENS])
    _prefill(packed)
    _prefill(slotted)
    fed = PREFILL_TOKENS
    for block in (0, *FOLLOWING_BLOCKS):  # first the prompt's last token, then the blocks
        packed.tokens.extend(stream[fed: fed + block])
        slotted.tokens.extend(stream[fed: fed + block])
        fed += block
        count = packed.num_pending
        expected, _ = packed.forward(count)
        got = _step(runner, [slotted], [count])[0]
        if not torch.equal(got, expected):
            slots.give_back()
            return f"a block of {count} after {packed.cache_len - count} positions differs from the packed path's"
    slots.give_back()
    return None


def _bucket_changes_nothing(runner, slots: _Slots, rng: random.Random, vocab: int) -> str | None:
    sessions = BUCKET_SESSIONS[: min(len(BUCKET_SESSIONS), runner.caches.slots)]
    if len(sessions) < 2:
        return None
    streams = [[rng.randrange(vocab) for _ in range(history + block)] for history, block in sessions]

    def prepared() -> list[CachedSequence]:
        sequences = []
        for (history, _), stream in zip(sessions, streams):
            sequence = slots.sequence(stream[: history + 1])
            _prefill(sequence)  # history tokens cached, one pending
            sequence.tokens.extend(stream[history + 1:])
            sequences.append(sequence)
        return sequences

    alone = []
    for sequence in prepared():
        alone.extend(_step(runner, [sequence], [sequence.num_pending]))
    slots.give_back()
    batch = prepared()
    together = _step(runner, batch, [sequence.num_pending for sequence in batch])
    slots.give_back()
    wrong = [index for index, (a, b) in enumerate(zip(alone, together)) if not torch.equal(a, b)]
    return f"{len(wrong)} of {len(sessions)} sessions changed bits in one bucket" if wrong else None


@torch.inference_mode()
def prove_static(runner, seed: int = 0) -> StaticProof:
    """Run the three checks (module doc) through ``runner`` as it serves (it must hand out slots:
    the caller lifts its refusal first); every slot is free again afterwards."""
    model = runner.lean.model
    vocab = int(model.get_input_embeddings().weight.shape[0])
    rng = random.Random(seed)
    stream = [rng.randrange(vocab) for _ in range(max(PROOF_BLOCKS))]
    slots = _Slots(runner)
    float32 = model.get_input_embeddings().weight.dtype == torch.float32
    try:
        decoding = _blocks_equal_decoding(runner, slots, stream)
        batching = _same_as_packed(runner, slots, stream) or _bucket_changes_nothing(runner, slots, rng, vocab)
    except Exception as error:  # noqa: BLE001 - any failure of the path turns it off, with the reason
        return StaticProof(False, False, f"the proof failed: {type(error).__name__}: {error}")
    finally:
        slots.give_back()
    blocks = "/".join(map(str, PROOF_BLOCKS))
    sessions = min(len(BUCKET_SESSIONS), runner.caches.slots)
    if batching is not None and not float32:
        return StaticProof(False, decoding is None, batching if decoding is None else f"{batching}; {decoding}")
    parts = [f"blocks of {blocks} = decoding" if decoding is None else f"not proven: {decoding}",
             f"= the packed path, {sessions} sessions in a bucket = alone" if batching is None
             else f"float32: {batching} (within ~1e-6, as packed rows)"]
    return StaticProof(True, decoding is None, "checked bit for bit at start (" + "; ".join(parts) + ")")


def serving_exactness(exactness: Exactness, runner) -> Exactness:
    """The engine's :class:`~disco.engines.packing_proof.Exactness` for the paths that serve: the
    packed path's, and where ``runner`` (a static runner or ``None``) is on, its decoding check
    too (greedy output is proven only where both paths give decoding's bits)."""
    if runner is None or runner.refused is not None or runner.proof is None:
        return exactness
    if runner.proof.decoding_exact:
        return Exactness(exactness.proven, f"{exactness.statement}; on the static path too (checked at start)")
    return Exactness(False, f"{exactness.statement}; the static path: {runner.proof.detail}")
