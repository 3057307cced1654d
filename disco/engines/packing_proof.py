"""The engine proves, on the machine it runs on, that a packed forward changes no bits.

Cross-session batching (:mod:`disco.engines.batching`) is exact only if every session gets from a
packed forward exactly the logits its own forward gives. That rests on kernel properties
that differ between CPUs (:mod:`disco.models.row_stable`: the linears' calls are cut into row
counts proven at load; on a GPU also the norms and the attention kernel). :func:`prove_packing`
checks the whole forward once, at engine start, on the compositions a batcher issues: synthetic
sessions (:class:`SyntheticSession`) whose caches spread over :data:`KEY_GRANULES` 64-key
granules (seeded random keys and values written straight into the cache: no prefill forward),
with blocks of 1 to 21 tokens (a verification of the default max lookahead plus the bonus) and
two prefills, each fed alone and then in packed batches of every size from 2 to the batcher's
maximum (:data:`GPU_PROOF`; on a CPU a lighter :data:`CPU_PROOF`); every session's logits (a
prefill's new cache entries) must be the same bit for bit. Where they are not, the engine runs
forwards one by one (slower under load, still exact) and says so (log, ``Info.batching``,
``/metrics``).

Why so many compositions: on an H200 the earlier proof (16 sessions of 1-5 tokens over
one-token caches, one packed forward of 46 rows) passed while 8 live sessions got other tokens:
cuBLAS changes a row's bits from 129 rows on, and the attention kernel's choice depended on the
batch and the keys (docs/engines.md, "Exactness on CUDA"). It takes 4-9 s per model on the H200.
So the verdict is kept per model (:func:`verdict_for`): a service proves it while it holds the
machine's measurement lock at load (``disco target-server``, ``disco draft-server``), and its batcher reuses it.
Float32 models are not checked: their batched rows differ from solo rows by ~1e-6 on some
CPUs (float32 GEMMs are not row-invariant there), far below a flip, and the float32
exactness tests cover them.

The second proof, :func:`prove_decoding`, is the one greedy exactness rests on: a verified
block must give every row the logits decoding it token by token gives. It feeds a synthetic
stream of ``max(PROOF_BLOCKS)`` tokens one at a time (what target-only decoding
does) and its prefixes of :data:`PROOF_BLOCKS` tokens at once (verifications of 1, 4, 8 and
``DEFAULT_MAX_LOOKAHEAD`` draft tokens plus the bonus), on the model's device, and compares
bit for bit — every dtype, float32 included. Where it fails and the model's low-precision
linears have no row plan yet (a model loaded on CUDA: :mod:`disco.models.loading` probes row
plans at load on a CPU only), :func:`exactness_for` gives them plans proven on the device
(:func:`disco.models.row_stable.stabilize`) and proves again; what it finally shows is
the engine's :class:`Exactness`, stated at start (log), in ``Info.exactness`` and on
``/metrics`` (``disco_exactness_proven``, ``disco_exactness_info``). Where it is not proven
the engine still serves, and says that greedy output may differ from target-only on
near-ties; how often it does is what the benchmarks' token-identical rate measures
(``disco bench-concurrency``): no live counter can know it without running target-only too.
Like the packing proof it feeds ordinary tokens, so it sees what changes a model's logits
(a kernel path switched by row count, masks, positions, caches; float32's ~1e-5 too), while a
one-ulp difference inside one linear is the row plans' job (probed on cancelling inputs).
Both proofs run in :func:`verdict_for`, decoding first (a row plan it installs changes the
packed forward's bits too).

Timers read :func:`disco.engines.device_clock.now` (on CUDA it waits for the queued kernels).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from disco.config import DEFAULT_MAX_LOOKAHEAD
from disco.engines import device_clock
from disco.engines.decoder_shape import DecoderShape
from disco.engines.engine_state import engine_state
from disco.engines.kv import CachedSequence
from disco.engines.packed_forward import describe_forward, supports_packing
from disco.engines.varlen_attention import KEY_GRANULE
from disco.models import row_stable
from disco.models.model_record import model_record
from disco.models.weight_only import DENSE_MIN_ROWS

logger = logging.getLogger(__name__)

#: The synthetic sessions' caches spread over this many 64-key granules of the one-call attention.
KEY_GRANULES = 4


@dataclass(frozen=True)
class ProofShape:
    """What the packing proof feeds on a kind of device.

    Attributes:
        max_block: longest block of a synthetic session.
        prefill_blocks: the prompts of the synthetic prefills.
        cpu_sizes: on a CPU, the packed batch sizes proven besides the batcher's maximum
            (``None``: every size from 2, as on a GPU).
        block_stride: session ``i`` feeds ``1 + (i * block_stride) % max_block`` tokens (prime
            to ``max_block``, so the sessions cycle through every block length).
    """

    max_block: int
    prefill_blocks: tuple[int, ...]
    cpu_sizes: tuple[int, ...] | None = None
    block_stride: int = 5


#: On a GPU (forwards of milliseconds): blocks up to a verification of the default max lookahead
#: plus the bonus, a prefill long enough to be multiplied on its own
#: (:data:`~disco.models.weight_only.DENSE_MIN_ROWS`) and one whose rows share calls with others,
#: every batch size.
GPU_PROOF = ProofShape(max_block=DEFAULT_MAX_LOOKAHEAD + 1, prefill_blocks=(DENSE_MIN_ROWS + 3, 7))
#: On a CPU, where each row of the 1.5B target costs 5-150 ms: the GPU's proof took 114 s for the
#: bf16 target on the 2-core AVX2 EPYC. Blocks of 1-5, one short prefill, batches of 2 and the
#: maximum: 25.8 s there against 22.0 s for the earlier proof (16 sessions of 1-5 tokens over
#: one-token caches). Enough on a CPU: the row plans were probed for every call size of 1-32 rows
#: at load, the CPU attends one query at a time, and long prefill spans are multiplied on their
#: own by construction.
CPU_PROOF = ProofShape(max_block=5, prefill_blocks=(7,), cpu_sizes=(2,), block_stride=2)


def proof_shape(device: torch.device) -> ProofShape:
    return CPU_PROOF if device.type == "cpu" else GPU_PROOF


#: Blocks the decoding proof verifies at once, each against the same tokens decoded one at a
#: time (the longest: a verification of the default max lookahead plus the bonus).
PROOF_BLOCKS = (2, 5, 9, DEFAULT_MAX_LOOKAHEAD + 1)


@dataclass(frozen=True)
class PackingVerdict:
    """Whether packed forwards are proven exact on this machine, and what the engine does.

    Attributes:
        packed: forwards of concurrent sessions may run as one packed forward.
        detail: one line for the log, ``Info.batching`` and ``/metrics``.
    """

    packed: bool
    detail: str


@dataclass(frozen=True)
class Exactness:
    """Whether greedy speculative output is proven to equal target-only output here.

    Attributes:
        proven: a verified block gave every row, bit for bit, the logits decoding gives it
            (:func:`prove_decoding`, on the model's device, at engine start).
        statement: one line for the log, ``Info.exactness`` and ``/metrics``: starts with
            ``"bit-exact on <device>"`` or ``"not proven on <device>"``.
    """

    proven: bool
    statement: str


def _model_key(model: torch.nn.Module) -> tuple:
    """What the exactness proof depends on besides the model (whose own state keeps it): the
    weights' dtype and device (a model cast or moved proves itself again)."""
    weight = model.get_input_embeddings().weight
    return weight.dtype, str(weight.device)


def exactness_for(model: torch.nn.Module) -> Exactness:
    """:func:`prove_decoding` once per model (kept on the model, keyed like :func:`verdict_for`);
    where it fails and the model has low-precision linears without a row plan, they get
    plans proven on the device (:func:`disco.models.row_stable.stabilize`) and it proves again."""
    kept = engine_state(model).exactness
    key = _model_key(model)
    if key not in kept:
        if key[1] != "cpu" and row_stable.needs_plans(model):  # a GPU model built outside load_model
            logger.info("row plans on %s: %s", key[1], row_stable.stabilize(model))
        if supports_packing(model):
            logger.info("forwards of %s: %s", type(model).__name__, describe_forward(model))
        exactness = prove_decoding(model)
        if not exactness.proven and row_stable.needs_plans(model):
            logger.info("verified blocks differ from decoding on %s: probing row plans there (%s)",
                        key[1], row_stable.stabilize(model))
            exactness = prove_decoding(model)
        log = logger.info if exactness.proven else logger.warning
        log("exactness: %s", exactness.statement)
        kept[key] = exactness
    return kept[key]


def prove_decoding(model: torch.nn.Module, seed: int = 0) -> Exactness:
    """Decode a synthetic stream token by token, verify its prefixes of :data:`PROOF_BLOCKS`
    tokens at once, and compare the logits bit for bit (module doc)."""
    device = model.get_input_embeddings().weight.device
    started = device_clock.now(device)
    rng = random.Random(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    stream = [rng.randrange(vocab) for _ in range(max(PROOF_BLOCKS))]
    decoding = CachedSequence(model, stream[:1])
    decoded = [decoding.forward(1)[0]]
    for token in stream[1:]:
        decoding.tokens.append(token)
        decoded.append(decoding.forward(1)[0])
    decoded_logits = torch.cat(decoded)  # [max(PROOF_BLOCKS), vocab]
    worst, wrong = 0.0, []
    for size in PROOF_BLOCKS:
        verified, _ = CachedSequence(model, stream[:size]).forward(size)  # [size, vocab]
        if not torch.equal(verified, decoded_logits[:size]):
            wrong.append(size)
            worst = max(worst, (verified - decoded_logits[:size]).abs().max().item())
    logger.debug("decoding proof on %s: %.2f s", device, device_clock.now(device) - started)
    plans = model_record(model).row_plans
    how = f"; {plans}" if plans else ""
    blocks = "/".join(map(str, PROOF_BLOCKS))
    if wrong:
        return Exactness(False, f"not proven on {device}: greedy output may differ from target-only on near-ties "
                                f"(verified blocks of {'/'.join(map(str, wrong))} tokens gave logits up to "
                                f"{worst:.1e} from decoding's{how}; benchmarks report the token-identical rate)")
    return Exactness(True, f"bit-exact on {device}: verified blocks of {blocks} tokens gave decoding's logits bit "
                           f"for bit{how}")


def verdict_for(model: torch.nn.Module, sessions: int) -> PackingVerdict:
    """:func:`prove_packing` once per model and batch size (the verdict is kept on the model),
    after :func:`exactness_for` (which may give the model row plans, and so other bits).

    NOTE: kept in the model's :func:`~disco.engines.engine_state.engine_state` (a ``deepcopy``,
    perhaps cast or changed after, is another model and proves itself), keyed by the weight
    dtype too (a model cast in place proves itself again)."""
    exactness_for(model)
    verdicts = engine_state(model).verdicts
    key = (sessions, model.get_input_embeddings().weight.dtype)
    if key not in verdicts:
        verdicts[key] = (prove_packing(model, sessions) if supports_packing(model)
                         else PackingVerdict(False, "one by one (the model has no packed forward)"))
    return verdicts[key]


def batch_sizes(device: torch.device, sessions: int) -> tuple[int, ...]:
    """The packed batch sizes the proof runs for a batcher of ``sessions``: every size from 2 on a
    GPU, a few on a CPU (:data:`CPU_PROOF`)."""
    if sessions < 2:
        return ()
    chosen = proof_shape(device).cpu_sizes
    if chosen is None:
        return tuple(range(2, sessions + 1))
    return tuple(sorted({size for size in chosen if size < sessions} | {sessions}))


def prove_packing(model: torch.nn.Module, sessions: int, seed: int = 0, sizes: Sequence[int] | None = None,
                  shape: ProofShape | None = None) -> PackingVerdict:
    """Run the compositions a batcher of ``sessions`` can issue, alone and packed, and compare
    bit for bit (module doc; ``sizes``: the packed batch sizes, default :func:`batch_sizes`;
    ``shape``: the sessions, default :func:`proof_shape` of the model's device)."""
    if model.get_input_embeddings().weight.dtype == torch.float32:
        return PackingVerdict(True, "packed (float32: batched rows within ~1e-6 of solo rows)")
    if sessions < 2:
        return PackingVerdict(True, "packed (one session per forward)")
    device = model.get_input_embeddings().weight.device
    started = device_clock.now(device)
    shape = shape or proof_shape(device)
    specs = synthetic_sessions(model, sessions + len(shape.prefill_blocks), seed, shape)
    alone = []
    for spec in specs:
        sequence = spec.build(model)
        logits, _ = CachedSequence.forward_batch([sequence], [spec.num_logits], [False])[0]
        alone.append(_outcome(spec, logits, sequence))
    sizes = tuple(sizes) if sizes is not None else batch_sizes(device, sessions)
    failures: list[str] = []
    rows = 0
    for size in sizes:
        members = [(size + offset) % len(specs) for offset in range(size)]  # rotating: other mixes per size
        batch = [specs[index].build(model) for index in members]
        together = CachedSequence.forward_batch(batch, [specs[i].num_logits for i in members], [False] * size)
        rows += sum(len(specs[i].block) for i in members)
        wrong = [index for index, sequence, (logits, _) in zip(members, batch, together)
                 if not _same(_outcome(specs[index], logits, sequence), alone[index])]
        if wrong:
            failures.append(f"{size} sessions: {len(wrong)} changed ("
                            + ", ".join(specs[i].describe() for i in wrong[:3]) + ")")
    seconds = device_clock.now(device) - started
    what = (f"{len(sizes)} batches of {min(sizes)}-{max(sizes)} sessions, {rows} rows, blocks of 1-{shape.max_block}, "
            f"caches of {min(s.cache_len for s in specs)}-{max(s.cache_len for s in specs)} keys, prefills")
    if failures:
        logger.warning("packed forwards changed sessions' bits on %s (%s): batching is off, concurrent sessions "
                       "run one forward each (exact, slower)", device, "; ".join(failures))
        return PackingVerdict(False, f"one by one (a packed forward changed sessions' logits on {device}: "
                                     f"{failures[0]})")
    logger.info("packed forwards proven exact on %s: %s, bit for bit (%.1f s)", device, what, seconds)
    return PackingVerdict(True, f"packed (proven bit for bit on {device}: {what})")


@dataclass(frozen=True)
class SyntheticSession:
    """One session of the packing proof: a cache of ``cache_len`` positions filled with seeded
    random keys and values (no prefill forward: any content shows a changed bit), then
    ``block`` fed at once: a decoding step or a verification (``num_logits == len(block)``), or
    a prefill (``num_logits == 0``: its last token stays pending, its cache is compared)."""

    cache_len: int
    block: tuple[int, ...]
    num_logits: int
    seed: int

    def describe(self) -> str:
        kind = "prefill" if self.num_logits == 0 else "block"
        return f"{kind} of {len(self.block)} after {self.cache_len} keys"

    def build(self, model: torch.nn.Module) -> CachedSequence:
        """A fresh :class:`CachedSequence` in this state (same seed, same bits every time)."""
        shape = DecoderShape.of(model)
        weight = model.get_input_embeddings().weight
        tokens = [0] * self.cache_len + list(self.block) + ([0] if self.num_logits == 0 else [])
        sequence = CachedSequence(model, tokens, capacity=len(tokens) + 1)
        if self.cache_len:
            generator = torch.Generator(device=weight.device).manual_seed(self.seed)  # drawn where they live
            for layer in range(shape.layers):  # the last layer's update sets the cache's length
                keys, values = (torch.randn(1, shape.kv_heads, self.cache_len, shape.head_dim, generator=generator,
                                            device=weight.device).to(weight.dtype) for _ in range(2))
                sequence.cache.update(keys, values, layer)
        return sequence


def synthetic_sessions(model: torch.nn.Module, count: int, seed: int = 0,
                       shape: ProofShape = GPU_PROOF) -> list[SyntheticSession]:
    """``count`` sessions: blocks of 1 to ``shape.max_block`` tokens over caches spread across
    :data:`KEY_GRANULES` 64-key granules, the last ones the prefills of ``shape.prefill_blocks``."""
    rng = random.Random(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    specs = []
    for index in range(count):
        prefill = index - (count - len(shape.prefill_blocks))
        size = shape.prefill_blocks[prefill] if prefill >= 0 else 1 + (index * shape.block_stride) % shape.max_block
        granule = index % KEY_GRANULES
        cache_len = granule * KEY_GRANULE + (KEY_GRANULE if index % 7 == 3 else rng.randrange(KEY_GRANULE))
        block = tuple(rng.randrange(vocab) for _ in range(size))
        specs.append(SyntheticSession(cache_len, block, 0 if prefill >= 0 else size, seed * 1000 + index))
    return specs


def _outcome(spec: SyntheticSession, logits: torch.Tensor, sequence: CachedSequence) -> list[torch.Tensor]:
    """What a session's forward decided: its logits, or (a prefill) its new cache entries."""
    if spec.num_logits:
        return [logits]
    return [state[:, :, spec.cache_len:] for layer in sequence.cache.layers for state in (layer.keys, layer.values)]


def _same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
