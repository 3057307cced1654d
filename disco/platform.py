"""What this machine computes fast: CPU math-library settings that must be chosen before
torch is imported, and the engine ``--dtype auto`` picks. No torch import here."""

from __future__ import annotations

import os
from typing import AbstractSet

#: CPU flags of native bfloat16 matrix math (Intel AMX tiles, AVX-512 BF16 dot products).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


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


def resolve_dtype(requested: str, device: str, flags: AbstractSet[str], role: str = "target") -> str:
    """The concrete engine for ``--dtype requested`` on ``device`` (pure: pass the CPU flags).

    ``auto``: bfloat16 on CUDA. On a CPU the draft gets int4 weight-only: its one-token
    forwards are bound by reading weights, and its quality only moves the acceptance rate,
    never the output (measured 2.5x faster per token than bf16 on an AMX Xeon, 32 vs 80 ms,
    and the fastest on AVX2). The target gets bfloat16 on CPUs that compute in bfloat16
    natively (AMX or AVX-512-BF16: a verification of k tokens costs about one step), else
    int8 weight-only (AVX2-only CPUs, where a bf16 forward over k tokens costs about k
    single-token forwards; int8 is 1.5-3x faster there). See docs/engines.md. Any other
    value is returned unchanged.
    """
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        return "bfloat16"
    if role == "draft":
        return "int4"
    return "bfloat16" if any(flag in flags for flag in BF16_CPU_FLAGS) else "int8"


def resolve_dtype_here(requested: str, device: str, role: str = "target") -> str:
    """:func:`resolve_dtype` with this machine's CPU flags (call at an entry point)."""
    return resolve_dtype(requested, device, cpu_flags() if requested == "auto" else frozenset(), role)


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
