"""What this machine is: CPU math-library settings that must be chosen before torch is
imported, and the engine ``--dtype auto`` means where no measurement is needed. No torch import here."""

from __future__ import annotations

import os


def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(requested: str, device: str, role: str = "target") -> str:
    """The concrete engine for ``--dtype requested`` on ``device``, where no measurement is
    needed: any value but ``auto`` is returned unchanged, and ``auto`` on CUDA is
    ``bfloat16`` (both roles). ``auto`` on a CPU is chosen by timing the candidate engines
    on the machine (:func:`disco.engines.engine_choice.choose_engine`; CPU flags do not tell:
    docs/engines.md), so it raises ``ValueError`` here."""
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        return "bfloat16"
    raise ValueError(f"--dtype auto for the {role} on {device} is chosen by measurement "
                     "(disco.engines.engine_choice.choose_engine)")


def tune_cpu_math_env() -> None:
    """Pin MKL to its AVX2 kernels on AVX2-only CPUs (e.g. AMD EPYC without AVX-512).

    NOTE: measured on this project's 2-core AMD machines, MKL's float32 GEMM takes a slow
    generic path for matrices with more than one row: a 4×1536 @ 1536×8960 ``linear`` took
    ~44 ms instead of ~10 ms with ``MKL_CBWR=AVX2`` (1 row: ~5.5 ms either way). A
    speculative verification forward has k + 1 rows, so this decides whether verification
    is nearly free or costs k single-token forwards. Call before importing torch; a value
    already set by the user wins. CPUs with AVX-512 are left alone.
    """
    flags = cpu_flags()
    if "avx2" in flags and "avx512f" not in flags:
        os.environ.setdefault("MKL_CBWR", "AVX2")
