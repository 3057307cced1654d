"""The q4 x q8 kernel: int4 weights times int8-quantized activations with AVX-512 VNNI.

torch's ``_weight_int4pack_mm_for_cpu`` multiplies the int4 engine's weights with bf16
activations; on the AMX Xeon it streamed ~14 GB/s at one row, and its cost doubled at a
fifth row (docs/engines.md). llama.cpp instead quantizes each activation row to int8 and
multiplies 4-bit weights with int8 activations in VNNI dot products. ``kernels/q4q8.cpp``
does the same over the int4 engine's own grid (``w = (q - 8) * scale + zero`` per group of
32 inputs, a GGUF Q4_K sub-block as it is): activations quantized per row and group of 32
(``max|x| / 127``, round to nearest), 16 output channels per VPDPBUSD, float32 accumulation
over the groups in order. Each row is computed from its own input row alone, by the same
instructions whatever the other rows of the call, so it is row-invariant by construction.

The kernel is C++ built at first use with the system's ``g++`` against the installed torch
(~10 s), cached under ``$DISCO_HOME/kernels`` by a hash of its source, flags and torch version,
and loaded as the torch ops ``disco_q4q8.mm`` / ``disco_q4q8.pack``. Where the CPU lacks
AVX-512 VNNI, no compiler is found or the build fails, the int4 engine keeps torch's kernel
(the load log says why). Which of the two the int4 engine runs is decided by measurement,
once per machine, torch version and thread count (:func:`choose_kernel`, cached beside the
build): every process on the machine then runs the same kernel, so replicas give the same
tokens.

The numerics differ from torch's kernel (activations rounded to int8 per group of 32, as
llama.cpp's q8 activations): docs/engines.md measures the quality against the bf16 reference.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils import cpp_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "q4q8.cpp"
#: The kernel's name in logs, costs and ``Info``; torch's kernel is :data:`TORCH_KERNEL`.
KERNEL = "q4q8-vnni"
TORCH_KERNEL = "int4pack"
#: CPU flags the kernel's instructions need (``/proc/cpuinfo``).
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_CFLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
           "-mavx512vnni", "-mfma", "-ffp-contract=off", "-w")
#: The kernel must measure at most this fraction of torch's time to be chosen (a near-tie
#: must not flip between two machines' or two starts' choices: the numerics differ).
MARGIN = 0.8
#: The linear timed for the choice: the 1.5B target's MLP gate/up projection.
PROBE_SHAPE = (8960, 1536)
PROBE_ROWS = (1, 5)
KERNELS_DIR = "kernels"


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel the int4 engine runs on this machine, and the measurement behind it."""

    kernel: str  # KERNEL or TORCH_KERNEL
    reason: str  # one line for the load log

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "reason": self.reason}


def cpu_supports() -> bool:
    """Whether this CPU has the instructions the kernel uses (Linux ``/proc/cpuinfo``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in REQUIRED_FLAGS)


def ops_loaded() -> bool:
    return hasattr(torch.ops, "disco_q4q8") and hasattr(torch.ops.disco_q4q8, "mm")


def build_key() -> str:
    """A hash of what the built library depends on: source, flags, torch, compiler."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(_CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(str(torch._C._GLIBCXX_USE_CXX11_ABI).encode())
    digest.update((shutil.which("g++") or "").encode())
    return digest.hexdigest()[:16]


def kernels_dir(home: Path) -> Path:
    return home / KERNELS_DIR / f"q4q8-{build_key()}"


def build(home: Path) -> Path:
    """The compiled library under ``home``, built once (concurrent builders wait on a file
    lock; the library appears under its name only when complete). Raises ``RuntimeError``
    with the reason."""
    folder = kernels_dir(home)
    library = folder / "libdisco_q4q8.so"
    if library.exists():
        return library
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no g++ on PATH")
    with _locked(folder):  # a draft and a target service starting together build once
        if not library.exists():
            _compile(compiler, folder, library)
    return library


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _compile(compiler: str, folder: Path, library: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as handle:
        partial = Path(handle.name)
    command = [compiler, *_CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *[f"-I{path}" for path in cpp_extension.include_paths()], str(SOURCE), "-o", str(partial),
               *[f"-L{path}" for path in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu"]
    logger.info("building the q4 x q8 kernel (once; ~10 s) into %s ...", folder)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"g++ failed: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else '?'}")
    partial.replace(library)
    logger.info("built the q4 x q8 kernel in %.1f s", time.perf_counter() - started)


def load(home: Path) -> str | None:
    """Make the ops available in this process. Returns ``None``, or why they are not."""
    if ops_loaded():
        return None
    if not cpu_supports():
        return f"the CPU lacks {'/'.join(REQUIRED_FLAGS)}"
    try:
        torch.ops.load_library(str(build(home)))
    except (RuntimeError, OSError) as error:
        return f"the kernel could not be built or loaded: {error}"
    return None


def pack(q: torch.Tensor,  # uint8 [out_features, in_features], in [0, 15]
         scales: torch.Tensor,  # bf16 [out_features, in_features // 32]
         zeros: torch.Tensor,  # bf16 [out_features, in_features // 32]
         ) -> torch.Tensor:  # uint8 [(out_features // 16) * (in_features // 32) * 320]
    """The kernel's weight layout (see ``kernels/q4q8.cpp``)."""
    return torch.ops.disco_q4q8.pack(q, scales, zeros)


def mm(rows: torch.Tensor,  # bf16 [n, in_features], contiguous
       packed: torch.Tensor,  # uint8, from :func:`pack`
       out_features: int) -> torch.Tensor:  # bf16 [n, out_features]
    return torch.ops.disco_q4q8.mm(rows, packed, out_features)


def dequantize(packed: torch.Tensor,  # uint8, from :func:`pack`
               out_features: int, in_features: int, start: int, end: int,
               out: torch.Tensor,  # float32 or bf16 [end - start, in_features], written in place
               ) -> None:
    """Output channels ``start:end`` (multiples of 16) as dense weights, ``(q - 8) * scale +
    zero`` in float32 (the bits of :meth:`disco.models.int4.Int4Linear.dequantized`), rounded to
    ``out``'s dtype."""
    torch.ops.disco_q4q8.dequantize(packed, out_features, in_features, start, end, out)


def choose_kernel(home: Path) -> KernelChoice:
    """The int4 engine's kernel on this machine: measured once per machine, torch version and
    thread count (cached in ``$DISCO_HOME/kernels``), read afterwards. The q4 x q8 kernel is
    chosen where it loads and multiplies :data:`PROBE_SHAPE` at 1 and 5 rows in at most
    :data:`MARGIN` of torch's time."""
    threads = torch.get_num_threads()
    why_not = load(home)
    if why_not is not None:
        return KernelChoice(TORCH_KERNEL, f"int4 kernel {TORCH_KERNEL}: {why_not}")
    path = kernels_dir(home) / f"choice-t{threads}.json"
    if (cached := _read_choice(path)) is not None:
        return cached
    with _locked(path.parent):  # one measurement, so that every process runs the same kernel
        if (cached := _read_choice(path)) is not None:
            return cached
        choice = _measure_choice(threads)
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(choice.to_json()) + "\n")
            tmp.replace(path)
        except OSError as error:  # NOTE: a read-only home only costs the next start a measurement
            logger.warning("could not cache the int4 kernel choice in %s: %s", path, error)
    return choice


def _read_choice(path: Path) -> KernelChoice | None:
    try:
        data = json.loads(path.read_text())
        return KernelChoice(str(data["kernel"]), str(data["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _measure_choice(threads: int) -> KernelChoice:
    """Time both kernels on random weights of :data:`PROBE_SHAPE` (best of 5, interleaved)."""
    out_features, in_features = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
    zeros = (torch.randn(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
    packed_q4q8 = pack(q, scales, zeros)
    packed_torch = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    seconds = {KERNEL: 0.0, TORCH_KERNEL: 0.0}
    with torch.no_grad():
        for rows in PROBE_ROWS:
            inputs = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
            calls = {KERNEL: lambda: mm(inputs, packed_q4q8, out_features),
                     TORCH_KERNEL: lambda: torch._weight_int4pack_mm_for_cpu(inputs, packed_torch, 32,
                                                                             scales_and_zeros)}
            best = {name: float("inf") for name in calls}
            for _ in range(5):
                for name, call in calls.items():
                    started = time.perf_counter()
                    for _ in range(4):
                        call()
                    best[name] = min(best[name], (time.perf_counter() - started) / 4)
            for name in seconds:
                seconds[name] += best[name]
    kernel = KERNEL if seconds[KERNEL] <= MARGIN * seconds[TORCH_KERNEL] else TORCH_KERNEL
    shape = f"{out_features}x{in_features} at {'+'.join(map(str, PROBE_ROWS))} rows, {threads} threads"
    return KernelChoice(kernel, f"int4 kernel {kernel} (measured {shape}: {KERNEL} "
                                f"{seconds[KERNEL] * 1e3:.2f} ms, {TORCH_KERNEL} {seconds[TORCH_KERNEL] * 1e3:.2f} ms)")
