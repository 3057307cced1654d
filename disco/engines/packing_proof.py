"""The engine proves, on the machine it runs on, that a packed forward changes no bits.

Cross-session batching (:mod:`disco.engines.batching`) is exact only if every session gets from a
packed forward exactly the logits its own forward gives. That rests on kernel properties
that differ between CPUs (:mod:`disco.models.row_stable`: the linears' calls are cut into row
counts proven at load). :func:`prove_packing` checks the whole forward once, at engine
start: ``sessions`` synthetic sessions (the largest packed batch) with blocks of 1 to
:data:`MAX_BLOCK` tokens, each fed alone and then all in one packed forward, must give the
same logits bit for bit. Where they do not, the engine runs forwards one by one (slower
under load, still exact) and says so (log, ``Info.batching``, ``/metrics``).

Sessions start from one token (nothing to prefill), so the check costs one forward per
session plus one packed forward (about 4 s for the 1.5B bf16 target on a 2-core CPU, if
nothing else runs: next to another service's model load it took 20-55 s). So the verdict
is kept per model (:func:`verdict_for`): a service proves it while it holds the machine's
measurement lock at load (``disco target-server``, ``disco draft-server``), and its
batcher reuses it.
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

import torch

from disco.config import DEFAULT_MAX_LOOKAHEAD
from disco.engines import device_clock
from disco.engines.kv import CachedSequence
from disco.engines.packed_forward import supports_packing
from disco.models import row_stable

logger = logging.getLogger(__name__)

#: Longest block of a synthetic session (a verification of 4 draft tokens + the bonus).
MAX_BLOCK = 5
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
    weight = model.get_input_embeddings().weight
    return id(model), weight.dtype, str(weight.device)


def exactness_for(model: torch.nn.Module) -> Exactness:
    """:func:`prove_decoding` once per model (kept on the model, keyed like :func:`verdict_for`);
    where it fails and the model has low-precision linears without a row plan, they get
    plans proven on the device (:func:`disco.models.row_stable.stabilize`) and it proves again."""
    kept = getattr(model, "_disco_exactness", None)
    if kept is None:
        kept = model._disco_exactness = {}
    key = _model_key(model)
    if key not in kept:
        exactness = prove_decoding(model)
        if not exactness.proven and row_stable.needs_plans(model):
            logger.info("verified blocks differ from decoding on %s: probing row plans there (%s)",
                        key[2], row_stable.stabilize(model))
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
    plans = getattr(model, "_disco_row_plans", None)
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

    NOTE: keyed by the model object's id and weight dtype too: a ``deepcopy`` (then perhaps
    cast or changed) carries the dict along but is another model, so it proves itself."""
    exactness_for(model)
    verdicts = getattr(model, "_disco_packing_verdicts", None)
    if verdicts is None:
        verdicts = model._disco_packing_verdicts = {}
    key = (id(model), sessions, model.get_input_embeddings().weight.dtype)
    if key not in verdicts:
        verdicts[key] = (prove_packing(model, sessions) if supports_packing(model)
                         else PackingVerdict(False, "one by one (the model has no packed forward)"))
    return verdicts[key]


def prove_packing(model: torch.nn.Module, sessions: int, seed: int = 0) -> PackingVerdict:
    """Feed ``sessions`` synthetic sessions alone and packed; compare logits bit for bit."""
    if model.get_input_embeddings().weight.dtype == torch.float32:
        return PackingVerdict(True, "packed (float32: batched rows within ~1e-6 of solo rows)")
    if sessions < 2:
        return PackingVerdict(True, "packed (one session per forward)")
    device = model.get_input_embeddings().weight.device
    started = device_clock.now(device)
    rng = random.Random(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    blocks = [[rng.randrange(vocab) for _ in range(1 + index % MAX_BLOCK)] for index in range(sessions)]
    alone = [CachedSequence(model, block).forward(len(block))[0] for block in blocks]
    together = CachedSequence.forward_batch([CachedSequence(model, block) for block in blocks],
                                            [len(block) for block in blocks], [False] * sessions)
    wrong = [index for index, ((logits, _), expected) in enumerate(zip(together, alone))
             if not torch.equal(logits, expected)]
    rows = sum(len(block) for block in blocks)
    seconds = device_clock.now(device) - started
    if wrong:
        logger.warning("a packed forward of %d sessions (%d rows) gave %d of them other logits than alone on this "
                       "machine: batching is off, concurrent sessions run one forward each (exact, slower)",
                       sessions, rows, len(wrong))
        return PackingVerdict(False, f"one by one (a packed forward of {sessions} sessions changed the logits of "
                                     f"{len(wrong)} of them here)")
    logger.info("packed forwards proven exact here: %d sessions, %d rows, bit for bit (%.1f s)",
                sessions, rows, seconds)
    return PackingVerdict(True, f"packed (proven bit for bit here: {sessions} sessions, {rows} rows)")
