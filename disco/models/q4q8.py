"""The q4 x q8 kernel: int4 weights times int8-quantized activations (AMX, AVX-512 VNNI or AVX2).

torch's ``_weight_int4pack_mm_for_cpu`` multiplies the int4 engine's weights with bf16
activations; on the AMX Xeon it streamed ~14 GB/s at one row, and its cost doubled at a
fifth row (docs/engines.md). llama.cpp instead quantizes each activation row to int8 and
multiplies 4-bit weights with int8 activations in VNNI dot products. ``kernels/q4q8.cpp``
does the same over the int4 engine's own grid (``w = (q - 8) * scale + zero`` per group of
32 inputs, a GGUF Q4_K sub-block as it is): activations quantized per row and group of 32
(``max|x| / 127``, round to nearest), 16 output channels per VPDPBUSD, float32 accumulation
over the groups in order. Each row is computed from its own input row alone, by the same
instructions whatever the other rows of the call, so it is row-invariant by construction.

Three builds (:data:`VARIANTS`): ``q4q8-amx`` (the VNNI build plus AMX tiles for calls of 2+
rows: TDPBSUD computes the integer dot products of up to 8 rows and two groups per tile
product, then the VNNI path's float epilogue runs on the same int32 sums; Sapphire Rapids and
later Xeons, where Linux grants the process the tile state), ``q4q8-vnni`` (AVX-512 VNNI:
Zen 4, Ice Lake) and ``q4q8-avx2`` (VPMADDUBSW + VPMADDWD in 8-lane halves, for AVX2-only
CPUs). They compute the same bits (tested). The best the CPU runs is built at first use with the
system's ``g++`` against the installed torch (~10 s), cached under ``$DISCO_HOME/kernels`` by
a hash of its source, flags and torch version, and loaded as the torch ops ``disco_q4q8.*``
(one build per process). Where the CPU has neither, no compiler is found or the build fails,
the int4 engine keeps torch's kernel (the load log says why). Which of the two the int4
engine runs is decided by measurement, once per machine, build, torch version and thread
count (:func:`choose_kernel`, cached beside the build, under a file lock): every process on
the machine then runs the same kernel, so replicas give the same tokens.

The numerics differ from torch's kernel (activations rounded to int8 per group of 32, as
llama.cpp's q8 activations): docs/engines.md measures the quality against the bf16 reference.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
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
#: Compiled into the one library: the kernel, its instruction's peak (the roofline's) and the lean
#: decoder's layer loop over it (:mod:`disco.engines.native_loop`).
SOURCES = (SOURCE, SOURCE.with_name("int8_peak.cpp"), SOURCE.with_name("decode_loop.cpp"))
TORCH_KERNEL = "int4pack"
_COMMON_CFLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w")
#: The kernel must measure at most this fraction of torch's time to be chosen (a near-tie
#: must not flip between two machines' or two starts' choices: the numerics differ).
MARGIN = 0.8
#: The linear timed for the choice: the 1.5B target's MLP gate/up projection.
PROBE_SHAPE = (8960, 1536)
PROBE_ROWS = (1, 5)
KERNELS_DIR = "kernels"
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86_64 Linux


@dataclass(frozen=True)
class Variant:
    """One build of the kernel: its name (in logs, costs, ``Info``), the CPU flags its
    instructions need (``/proc/cpuinfo``) and its compiler flags."""

    kernel: str
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


_VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma")
_VNNI_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma")
#: The builds, best first. All compute the same bits (tests/test_q4q8.py).
VARIANTS = (
    Variant("q4q8-amx", ("amx_tile", "amx_int8", *_VNNI_CPU_FLAGS), (*_VNNI_CFLAGS, "-mamx-tile", "-mamx-int8")),
    Variant("q4q8-vnni", _VNNI_CPU_FLAGS, _VNNI_CFLAGS),
    Variant("q4q8-avx2", ("avx2", "fma"), ("-mavx2", "-mfma")),
)
KERNELS = tuple(variant.kernel for variant in VARIANTS)


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel the int4 engine runs on this machine, and the measurement behind it."""

    kernel: str  # one of KERNELS, or TORCH_KERNEL
    reason: str  # one line for the load log

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "reason": self.reason}


def cpu_flags() -> frozenset[str]:
    """This CPU's flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def variant_for(flags: frozenset[str]) -> Variant | None:
    """The best build these CPU flags run (``None``: none)."""
    return next((variant for variant in VARIANTS if set(variant.cpu_flags) <= flags), None)


def request_amx() -> str:
    """Ask Linux for the AMX tile state in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, once per process, idempotent): ``""`` when granted, else why not."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"not Linux on x86_64 ({platform.system()} {platform.machine()})"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(*map(ctypes.c_long, (_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA))) != 0:
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: {os.strerror(ctypes.get_errno())}"
    return ""


def best_variant() -> Variant | None:
    """The best build this CPU runs in this process: ``q4q8-amx`` only where Linux grants the
    tile state (else ``q4q8-vnni``, the same bits, with a warning)."""
    flags = cpu_flags()
    variant = variant_for(flags)
    if variant is not None and variant.kernel == "q4q8-amx" and (refused := request_amx()):
        logger.warning("the q4q8-amx kernel is not used: %s", refused)
        variant = variant_for(flags - {"amx_tile", "amx_int8"})
    return variant


def cpu_supports() -> bool:
    """Whether this CPU runs one of the builds."""
    return variant_for(cpu_flags()) is not None


def ops_loaded() -> bool:
    return hasattr(torch.ops, "disco_q4q8") and hasattr(torch.ops.disco_q4q8, "mm")


def loaded_kernel() -> str:
    """The build loaded in this process (one per process: the ops' names are shared)."""
    return torch.ops.disco_q4q8.variant()


def amx_refused() -> str:
    """Why the loaded build does not run its AMX path in this process (``""``: it does). The
    AMX build asks Linux for the tile state once per process; refused, it runs the VNNI path
    (the same bits)."""
    return torch.ops.disco_q4q8.amx_refused()


def build_key(variant: Variant) -> str:
    """A hash of what the built library depends on: source, flags, torch, compiler."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES))
    digest.update(" ".join(_COMMON_CFLAGS + variant.cflags).encode())
    digest.update(torch.__version__.encode())
    digest.update(str(torch._C._GLIBCXX_USE_CXX11_ABI).encode())
    digest.update((shutil.which("g++") or "").encode())
    return digest.hexdigest()[:16]


def kernels_dir(home: Path, variant: Variant) -> Path:
    return home / KERNELS_DIR / f"{variant.kernel}-{build_key(variant)}"


def build(home: Path, variant: Variant) -> Path:
    """The compiled library under ``home``, built once (concurrent builders wait on a file
    lock; the library appears under its name only when complete). Raises ``RuntimeError``
    with the reason."""
    folder = kernels_dir(home, variant)
    library = folder / "libdisco_q4q8.so"
    if library.exists():
        return library
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no g++ on PATH")
    with _locked(folder):  # a draft and a target service starting together build once
        if not library.exists():
            _compile(compiler, variant, library)
    return library


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _compile(compiler: str, variant: Variant, library: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as handle:
        partial = Path(handle.name)
    command = [compiler, *_COMMON_CFLAGS, *variant.cflags,
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f'-DDISCO_Q4Q8_VARIANT="{variant.kernel}"',
               *[f"-I{path}" for path in cpp_extension.include_paths()], *map(str, SOURCES), "-o", str(partial),
               *[f"-L{path}" for path in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu"]
    logger.info("building the %s kernel (once; ~10 s) into %s ...", variant.kernel, library.parent)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"g++ failed: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else '?'}")
    partial.replace(library)
    logger.info("built the %s kernel in %.1f s", variant.kernel, time.perf_counter() - started)


def load(home: Path, variant: Variant | None = None) -> str | None:
    """Make the ops of ``variant`` (default: the best this CPU runs) available in this
    process. Returns ``None``, or why they are not."""
    if ops_loaded():
        if variant is not None and loaded_kernel() != variant.kernel:
            return f"{loaded_kernel()} is loaded in this process, not {variant.kernel}"
        return None
    variant = variant or best_variant()
    if variant is None:
        return f"the CPU has neither {' nor '.join('/'.join(v.cpu_flags) for v in VARIANTS[1:])}"
    try:
        torch.ops.load_library(str(build(home, variant)))
    except (RuntimeError, OSError) as error:
        return f"the {variant.kernel} kernel could not be built or loaded: {error}"
    if variant.kernel == "q4q8-amx" and (refused := amx_refused()):  # NOTE: asked above; kept as a safety net
        logger.warning("the q4q8-amx kernel runs its VNNI path (the same bits, slower at several rows): %s", refused)
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


def int8_peak(iterations: int) -> int:
    """Run the loaded build's dot-product instruction ``iterations`` rounds on every intra-op
    thread, operands in registers (``kernels/int8_peak.cpp``); returns the multiply-adds
    issued. The caller times it: :func:`disco.engines.roofline.measure_int8_peak`."""
    return torch.ops.disco_q4q8.int8_peak(iterations)


def int8_group_peak(iterations: int) -> int:
    """:func:`int8_peak` with the kernel's float step after every group of 32 inputs (8 rows x
    16 channels a round); ``-1`` on builds without AVX-512 VNNI."""
    return torch.ops.disco_q4q8.int8_group_peak(iterations)


def dequantize(packed: torch.Tensor,  # uint8, from :func:`pack`
               out_features: int, in_features: int, start: int, end: int,
               out: torch.Tensor,  # float32 or bf16 [end - start, in_features], written in place
               ) -> None:
    """Output channels ``start:end`` (multiples of 16) as dense weights, ``(q - 8) * scale +
    zero`` in float32 (the bits of :meth:`disco.models.int4.Int4Linear.dequantized`), rounded to
    ``out``'s dtype."""
    torch.ops.disco_q4q8.dequantize(packed, out_features, in_features, start, end, out)


def choose_kernel(home: Path) -> KernelChoice:
    """The int4 engine's kernel on this machine: measured once per machine, build, torch
    version and thread count (cached beside the build), read afterwards. The q4 x q8 kernel is
    chosen where it loads and multiplies :data:`PROBE_SHAPE` at 1 and 5 rows in at most
    :data:`MARGIN` of torch's time."""
    threads = torch.get_num_threads()
    why_not = load(home)
    if why_not is not None:
        return KernelChoice(TORCH_KERNEL, f"int4 kernel {TORCH_KERNEL}: {why_not}")
    variant = next(variant for variant in VARIANTS if variant.kernel == loaded_kernel())
    path = kernels_dir(home, variant) / f"choice-t{threads}.json"
    if (cached := _read_choice(path)) is not None:
        return cached
    with _locked(path.parent):  # one measurement, so that every process runs the same kernel
        if (cached := _read_choice(path)) is not None:
            return cached
        choice = _measure_choice(variant.kernel, threads)
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(choice.to_json()) + "\n")
            tmp.replace(path)
        except OSError as error:  # NOTE: a read-only home only costs the next start a measurement
            logger.warning("could not cache the int4 kernel choice in %s: %s", path, error)
    return choice


def cached_choice(home: Path) -> KernelChoice | None:
    """The int4 engine's kernel as :func:`choose_kernel` has chosen it on this machine, read
    only: nothing is built, loaded or timed. ``None`` where no choice is cached yet (the next
    :func:`choose_kernel` measures it); torch's kernel where the CPU has no build or no
    compiler is found (:func:`choose_kernel` then keeps it without measuring)."""
    variant = (next(v for v in VARIANTS if v.kernel == loaded_kernel()) if ops_loaded()
               else variant_for(cpu_flags()))
    if variant is None:
        return KernelChoice(TORCH_KERNEL, f"int4 kernel {TORCH_KERNEL}: the CPU has no q4 x q8 build")
    if not (kernels_dir(home, variant) / "libdisco_q4q8.so").exists() and shutil.which("g++") is None:
        return KernelChoice(TORCH_KERNEL, f"int4 kernel {TORCH_KERNEL}: no g++ to build {variant.kernel}")
    if (cached := _read_choice(kernels_dir(home, variant) / f"choice-t{torch.get_num_threads()}.json")) is not None:
        return cached
    if variant.kernel == "q4q8-amx":  # NOTE: where Linux refuses AMX tiles, load() builds the VNNI one
        return _read_choice(kernels_dir(home, VARIANTS[1]) / f"choice-t{torch.get_num_threads()}.json")
    return None


def _read_choice(path: Path) -> KernelChoice | None:
    try:
        data = json.loads(path.read_text())
        return KernelChoice(str(data["kernel"]), str(data["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _measure_choice(kernel: str, threads: int) -> KernelChoice:
    """Time both kernels on random weights of :data:`PROBE_SHAPE` (best of 5, interleaved)."""
    out_features, in_features = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
    zeros = (torch.randn(out_features, in_features // 32, generator=generator) * 0.01).to(torch.bfloat16)
    packed_q4q8 = pack(q, scales, zeros)
    packed_torch = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    seconds = {kernel: 0.0, TORCH_KERNEL: 0.0}
    with torch.no_grad():
        for rows in PROBE_ROWS:
            inputs = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
            calls = {kernel: lambda: mm(inputs, packed_q4q8, out_features),
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
    chosen = kernel if seconds[kernel] <= MARGIN * seconds[TORCH_KERNEL] else TORCH_KERNEL
    shape = f"{out_features}x{in_features} at {'+'.join(map(str, PROBE_ROWS))} rows, {threads} threads"
    return KernelChoice(chosen, f"int4 kernel {chosen} (measured {shape}: {kernel} "
                                f"{seconds[kernel] * 1e3:.2f} ms, {TORCH_KERNEL} {seconds[TORCH_KERNEL] * 1e3:.2f} ms)")
