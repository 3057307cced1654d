"""What the models room did to one model, kept on the model in one place.

The loader changes a model's modules after building it: quantizing swaps its linears
(:func:`disco.models.quantize.quantize_model`), a kernel choice repacks their weights
(:func:`disco.models.int4.use_chosen_kernel`), a vocabulary subset swaps the draft's head
(:func:`disco.models.vocab_subset.use_vocab_subset`) and the row plans give the linears and norms
their call sizes (:func:`disco.models.row_stable.stabilize`; also at an engine's start, when the
first exactness proof fails). Whatever is built over those modules (the engines' lean decoder
fuses their weights and its C++ loop holds their buffers) reads :attr:`ModelRecord.version`:
each of those changes moves it, so a structure built at another version is rebuilt — one integer
compared per forward instead of every module's identity.

Contract: code that changes a model's modules outside those functions calls
:func:`weights_changed` (tests do, where they swap a module by hand).

The record lives in the model's ``__dict__`` (one attribute, no module global) and names the
model it was made for: a ``deepcopy`` is another model and starts from a fresh record.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_ATTRIBUTE = "_disco_model_record"


@dataclass
class ModelRecord:
    """Attributes:
        owner: ``id`` of the model this record was made for.
        version: moved by every change of the model's modules (module doc).
        row_plans: the row plans' line for the load log and the exactness statement
            (:func:`disco.models.row_stable.stabilize`); ``None`` before any.
    """

    owner: int
    version: int = 0
    row_plans: str | None = None


def model_record(model: nn.Module) -> ModelRecord:
    """The models room's record of ``model`` (a fresh one the first time, or for a copy)."""
    record = model.__dict__.get(_ATTRIBUTE)
    if record is None or record.owner != id(model):
        record = model.__dict__[_ATTRIBUTE] = ModelRecord(owner=id(model))
    return record


def weights_changed(model: nn.Module) -> None:
    """Say that ``model``'s modules (or their weights' layout, kernels, row plans) changed."""
    model_record(model).version += 1
