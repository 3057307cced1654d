"""Model loads never swap in Hugging Face Hub kernels: nothing at load reaches the network.

transformers 5.x (with the ``kernels`` package, which it requires) kernelizes a model at
``from_pretrained`` unless told otherwise: where the caller passes no ``use_kernels`` and the
environment does not set ``USE_HUB_KERNELS`` to a false value, it maps some layers to kernels
downloaded from the Hub (on CUDA: ``rotary_pos_emb`` -> ``kernels-community/rotary``). Offline
that load fails ("could not verify publisher trust status"); online it would run third-party
code whose numerics nobody here has checked, under exactness promises that rest on knowing
every op (:mod:`disco.engines.packing_proof`).

So every load is kept off them twice, by construction:

* :func:`keep_off` sets ``USE_HUB_KERNELS=NO`` in the process (entry points call it before
  anything loads a model, and :func:`disco.models.loading.load_model` calls it again, so a
  library caller is covered too); transformers reads the variable at each load;
* :data:`LOAD_KWARGS` (``use_kernels=False``) goes to every ``from_pretrained``;

and :func:`check_model` refuses a loaded model that was kernelized anyway. A user's
environment that asks for them (``USE_HUB_KERNELS`` set to a true value) is refused with
:class:`~disco.errors.ModelError` naming the variable, not silently overridden.
"""

from __future__ import annotations

import os
from typing import Any, MutableMapping

from disco.errors import ModelError

#: The environment variable transformers reads (``transformers.integrations.hub_kernels``).
ENV_VAR = "USE_HUB_KERNELS"
#: What :func:`keep_off` sets it to.
OFF = "NO"
#: transformers' true values for the variable (``is_env_variable_true``).
TRUE_VALUES = ("true", "1", "y", "yes", "on")
#: Keyword arguments of every ``from_pretrained`` of a model.
LOAD_KWARGS = {"use_kernels": False}


def keep_off(environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``USE_HUB_KERNELS=NO`` (idempotent).

    Raises:
        ModelError: the environment asks for Hub kernels (a true value): disco-serve does not
            load them, and says so instead of overriding the user's setting silently.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_VAR)
    if value is not None and value.strip().lower() in TRUE_VALUES:
        raise ModelError(
            f"{ENV_VAR}={value} in the environment asks transformers to swap Hugging Face Hub kernels into "
            "the model at load (a download, and third-party code whose numerics the exactness proofs do not "
            f"cover); disco-serve loads models without them: unset {ENV_VAR} or set {ENV_VAR}={OFF}")
    environ[ENV_VAR] = OFF


def check_model(model: Any, name: str) -> None:
    """Refuse a model that transformers kernelized with Hub kernels despite :func:`keep_off`.

    Raises:
        ModelError: the model runs Hub kernels.
    """
    if getattr(model, "use_kernels", False):
        raise ModelError(
            f"model {name} was loaded with Hugging Face Hub kernels (transformers' use_kernels is on): "
            f"disco-serve runs models without them; check {ENV_VAR} and the model's kernel_config")
