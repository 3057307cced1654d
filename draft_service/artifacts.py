"""Which DISCO artifacts a draft service may open for ``disco:ARTIFACT`` policies.

The policy spec comes from the request, so a client names the file the draft service
reads. Unrestricted, ``disco:/dev/zero`` makes the artifact reader consume memory until
the kernel kills the process, and error messages reveal which paths exist. So a served
draft opens only the shipped ``disco:default`` and regular files inside the operator's
``--artifact-dir`` folders (a bare name is looked up there), no larger than
:data:`MAX_ARTIFACT_BYTES`; any other name gets the same ``INVALID_ARGUMENT`` answer
whether it exists or not. Artifacts themselves hold JSON and ``.npz`` arrays read
without pickle (:mod:`disco.speculation.policies.learned`): loading one runs no code from it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Sequence

from disco.errors import InvalidRequest
from disco.speculation.policies.base import StopPolicy
from disco.speculation.policies.spec import MAX_POLICY_SPEC_CHARS, LearnedPolicyLoader

#: Real artifacts are a few hundred KB (a compiled classifier and a small projection).
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024


def restricted_loader(inner: LearnedPolicyLoader | None,
                      artifact_dirs: Sequence[str | os.PathLike]) -> LearnedPolicyLoader | None:
    """``inner`` limited to ``default`` and to artifacts inside ``artifact_dirs``."""
    if inner is None:
        return None
    roots = [Path(folder).expanduser().resolve() for folder in artifact_dirs]

    def load(argument: str) -> Callable[[], StopPolicy]:
        return inner(argument if argument == "default" else str(allowed_path(argument, roots)))

    return load


def allowed_path(argument: str, roots: Sequence[Path]) -> Path:
    """The artifact file ``argument`` names, if it is one this service may open.

    Raises:
        InvalidRequest: anything else (the same message whether or not the path exists).
    """
    spec = "disco:" + (argument if len(argument) <= MAX_POLICY_SPEC_CHARS else argument[:MAX_POLICY_SPEC_CHARS] + "...")
    refusal = InvalidRequest(
        f"policy {spec!r} names a DISCO artifact that is not available on this draft service: it serves 'default' "
        "and the artifacts in its --artifact-dir folders"
        + (f" ({', '.join(str(r) for r in roots)})" if roots else " (none)"))
    if not argument or "\0" in argument:
        raise refusal
    candidate = Path(argument).expanduser()
    for root in roots:
        path = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if not path.is_relative_to(root):
            continue
        try:
            info = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_ARTIFACT_BYTES:
            return path
    raise refusal
