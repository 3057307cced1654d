"""What the engines settled about one model, kept on the model in one place.

Built once per model and reused by every engine over it: its lean decoder (or that the HF
forward runs instead), the exactness proof of its verified blocks, the packing verdicts by
batch size (:mod:`disco.engines.packed_forward`, :mod:`disco.engines.packing_proof`) and the KV
pool of its sessions (:mod:`disco.engines.kv_pool`). The state lives in the model's
``__dict__`` (one attribute, not a module global: two models never share it) and names the model
it was settled for: a ``deepcopy`` carries the dict along but is another model (perhaps cast or changed after), so it starts from a fresh state. The row plans' line is
the models room's (:func:`disco.models.row_stable.stabilize` keeps it on the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_ATTRIBUTE = "_disco_engine_state"


@dataclass
class EngineState:
    """Attributes:
        owner: ``id`` of the model this state was settled for.
        lean: the model's lean decoder; ``False``: checked, the HF forward runs; ``None``: not
            built yet (or stale: rebuilt on use).
        exactness: :class:`~disco.engines.packing_proof.Exactness` by (weight dtype, device).
        verdicts: :class:`~disco.engines.packing_proof.PackingVerdict` by (batch size, weight dtype).
        kv_pool: the model's :class:`~disco.engines.kv_pool.KVPool` (every session's keys and values).
    """

    owner: int
    lean: object = None
    exactness: dict = field(default_factory=dict)
    verdicts: dict = field(default_factory=dict)
    kv_pool: object = None


def engine_state(model: torch.nn.Module) -> EngineState:
    """The engines' state of ``model`` (a fresh one the first time, or for a copy of another model)."""
    state = model.__dict__.get(_ATTRIBUTE)
    if state is None or state.owner != id(model):
        state = model.__dict__[_ATTRIBUTE] = EngineState(owner=id(model))
    return state
