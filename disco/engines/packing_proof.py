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
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from disco.engines.kv import CachedSequence
from disco.engines.packed_forward import supports_packing

logger = logging.getLogger(__name__)

#: Longest block of a synthetic session (a verification of 4 draft tokens + the bonus).
MAX_BLOCK = 5


@dataclass(frozen=True)
class PackingVerdict:
    """Whether packed forwards are proven exact on this machine, and what the engine does.

    Attributes:
        packed: forwards of concurrent sessions may run as one packed forward.
        detail: one line for the log, ``Info.batching`` and ``/metrics``.
    """

    packed: bool
    detail: str


def verdict_for(model: torch.nn.Module, sessions: int) -> PackingVerdict:
    """:func:`prove_packing` once per model and batch size (the verdict is kept on the model).

    NOTE: keyed by the model object's id and weight dtype too: a ``deepcopy`` (then perhaps
    cast or changed) carries the dict along but is another model, so it proves itself."""
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
    started = time.perf_counter()
    rng = random.Random(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    blocks = [[rng.randrange(vocab) for _ in range(1 + index % MAX_BLOCK)] for index in range(sessions)]
    alone = [CachedSequence(model, block).forward(len(block))[0] for block in blocks]
    together = CachedSequence.forward_batch([CachedSequence(model, block) for block in blocks],
                                            [len(block) for block in blocks], [False] * sessions)
    wrong = [index for index, ((logits, _), expected) in enumerate(zip(together, alone))
             if not torch.equal(logits, expected)]
    rows = sum(len(block) for block in blocks)
    seconds = time.perf_counter() - started
    if wrong:
        logger.warning("a packed forward of %d sessions (%d rows) gave %d of them other logits than alone on this "
                       "machine: batching is off, concurrent sessions run one forward each (exact, slower)",
                       sessions, rows, len(wrong))
        return PackingVerdict(False, f"one by one (a packed forward of {sessions} sessions changed the logits of "
                                     f"{len(wrong)} of them here)")
    logger.info("packed forwards proven exact here: %d sessions, %d rows, bit for bit (%.1f s)",
                sessions, rows, seconds)
    return PackingVerdict(True, f"packed (proven bit for bit here: {sessions} sessions, {rows} rows)")
